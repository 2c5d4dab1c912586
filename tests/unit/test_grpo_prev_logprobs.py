"""When GRPO takes the previous policy's log-probs from the training forward instead of a scoring pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from nemo_rl.algorithms.grpo import prev_logprobs_from_training_forward
from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.master import GRPOMasterConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
TINY_SFT = ROOT / "examples" / "assets" / "tiny_math_sft"


def config(*overrides: str) -> GRPOMasterConfig:
    return load_and_validate(
        CONFIG,
        GRPOMasterConfig,
        [
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "policy.train_micro_batch_size=8",
            f"policy.model_name={TINY_SFT}",
            *list(overrides),
        ],
    )


def test_one_optimizer_step_per_batch_takes_them_from_the_forward() -> None:
    assert prev_logprobs_from_training_forward(config("policy.train_global_batch_size=16"))


def test_several_optimizer_steps_per_batch_need_the_scoring_pass() -> None:
    # The second step's forward runs on weights the first step changed.
    assert not prev_logprobs_from_training_forward(config("policy.train_global_batch_size=8"))


def test_a_model_with_dropout_needs_the_scoring_pass(tmp_path: Path) -> None:
    # Training runs in train mode: with dropout its forward is not the scoring (eval mode) forward.
    model_dir = tmp_path / "with_dropout"
    shutil.copytree(TINY_SFT, model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**hf_config, "attention_dropout": 0.1}))
    assert not prev_logprobs_from_training_forward(
        config("policy.train_global_batch_size=16", f"policy.model_name={model_dir}")
    )
