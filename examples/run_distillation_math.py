"""On-policy distillation on math problems: the student samples, the teacher's top-k logits score it.

    uv run python examples/run_distillation_math.py [--config PATH] [key=value ...]

The default config, ``examples/configs/distillation_math.yaml``, is NeMo RL's recipe (Qwen3-4B teaching
Qwen3-1.7B-Base, vLLM on GPUs). ``examples/configs/distillation_tiny_math.yaml`` runs on any CPU: a tiny
teacher trained longer teaches the committed tiny checkpoint on the bundled arithmetic problems, sampled by
the embedded engine. A run resumes from the latest checkpoint in ``checkpointing.checkpoint_dir``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_rl.config.cli import parse_args_and_load
from nemo_rl.config.master import DistillationMasterConfig
from nemo_rl.config.sources import check_model_source, check_policy_sources
from nemo_rl.distributed.gc_tuning import use_gc_thresholds
from nemo_rl.utils.script_exit import run_script

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "distillation_math.yaml"


def main() -> None:
    """Load and check the config, then set up and run distillation."""
    # Fewer garbage collections while torch and transformers are imported (see the module).
    use_gc_thresholds()
    config, _ = parse_args_and_load(DistillationMasterConfig, DEFAULT_CONFIG)

    # A model folder that does not exist is known from the path: say so before Ray starts.
    check_policy_sources(config.policy)
    check_model_source(config.teacher.model_name, "teacher.model_name")
    from nemo_rl.algorithms.rl_script import run_rl_script

    def load() -> tuple[Any, Any]:
        # Imported while Ray starts: torch and transformers only after the config is known to be valid.
        from nemo_rl.algorithms.distillation import distillation_train, setup

        return setup, distillation_train

    run_rl_script(
        config,
        "Distillation",
        load,
        cpu_config="examples/configs/distillation_tiny_math.yaml",
        extra_models=("teacher",),
    )


if __name__ == "__main__":
    run_script(main)
