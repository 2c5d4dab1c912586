"""The driver of a run imports only what it uses: no model-parallel, checkpointing or compiler stacks.

The driver imports the algorithm loops, the data stack and the worker classes (Ray needs the classes to start
the actors), but it never shards, checkpoints or builds a model. FSDP2 / DTensor, torch.distributed.checkpoint,
torch._dynamo (pulled in by transformers' auto model classes, its model code and optimizer construction) and
math-verify cost seconds of CPU to import; every second spent there delays the first step. Neither does it
resolve ``AutoConfig``, which makes transformers index every model folder it has (half a second of CPU): a
local tokenizer with a plain tokenizers backend loads without it. The math
environment's actor, which imports what the driver imports of it, does not import math-verify either, and
the config's schema sections (all a worker reads) import no config-loading stack (OmegaConf, Hydra).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Loading the example scripts' stack as a run does: the algorithm, the data, the tokenizer, the policy and
# generation facades and the environments, then what setup and the loop call before and around the workers.
DRIVER = """
import sys
import tempfile
from pathlib import Path

# What a worker process imports of the config: its schema sections, without OmegaConf or Hydra's grammar.
import nemo_rl.config.env, nemo_rl.config.master, nemo_rl.config.policy
print(sorted(m for m in ("omegaconf", "hydra", "nemo_rl.config.cli") if m in sys.modules))

from nemo_rl.algorithms import distillation, dpo, grpo, rm, sft  # noqa: F401
from nemo_rl.algorithms.loop import check_run_setup
from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.data.datasets import setup_rl_data
from nemo_rl.environments.registry import get_env_class
from nemo_rl.models.generation.embedded.worker import EmbeddedGenerationWorker  # noqa: F401
from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker  # noqa: F401
from nemo_rl.models.tokenizer import get_policy_tokenizer

config = load_and_validate(
    Path("examples/configs/grpo_math_tiny.yaml"), GRPOMasterConfig, ["checkpointing.enabled=false"]
)
tokenizer = get_policy_tokenizer(config.policy)
setup_rl_data(config.data, tokenizer, max_total_sequence_length=config.policy.max_total_sequence_length)
check_run_setup(
    config.policy, config.checkpointing, "/tmp", policy_world_size=1, run_name="GRPO",
    metric_names={"val_accuracy"}
)
get_env_class("math")
# What the math environment's actor imports to decide certain verdicts itself and to hand its verifier
# processes their function: math-verify and sympy are imported (and warmed up) in their fork server only.
from nemo_rl.environments.math_verifier import gold_answer, quick_verdict, score_math_response  # noqa: F401
heavy = ["torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch._dynamo",
         "transformers.models.auto.modeling_auto", "transformers.modeling_utils", "math_verify", "sympy",
         "transformers.models.auto.configuration_auto"]
print(sorted(m for m in heavy if m in sys.modules))
"""


def test_the_driver_imports_no_training_or_compiler_stack() -> None:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    schema_only, driver = done.stdout.strip().splitlines()[-2:]
    assert schema_only == "[]", done.stdout
    assert driver == "[]", done.stdout
