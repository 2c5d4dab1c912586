"""GRPO as a library with a user's environment passed through ``task_to_env`` (in-process, session Ray)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup
from nemo_rl.config import load_and_validate
from nemo_rl.config.errors import UserError
from nemo_rl.data.datasets import setup_data
from nemo_rl.data.processors import math_processor
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Message
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
TINY_SFT = ROOT / "examples" / "assets" / "tiny_math_sft"
TIMEOUT_S = 120
REWARD = 0.25


class ConstantRewardEnv(EnvironmentInterface[dict[str, Any]]):
    """Scores every response ``reward``, and reports how many samples it scored."""

    def __init__(self, reward: float) -> None:
        self.reward = reward
        self.num_scored = 0

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        n = len(message_log_batch)
        self.num_scored += n
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": ""}] * n,
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.full((n,), self.reward),
            terminateds=torch.ones(n, dtype=torch.bool),
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        return batch, {"mean_reward": float(batch["total_reward"].mean()), "scored": float(self.num_scored)}

    def scored(self) -> int:
        return self.num_scored


@pytest.mark.usefixtures("ray_cluster")
def test_user_environment_through_task_to_env(tmp_path: Path) -> None:
    config = load_and_validate(
        CONFIG,
        MasterConfig,
        [
            f"policy.model_name={TINY_SFT}",
            "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4",
            "grpo.max_num_steps=1",
            "policy.generation.max_new_tokens=8",
            "grpo.val_at_start=false",
            "grpo.val_period=0",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=8",
            "data.num_train_samples=16",
            "data.num_val_samples=0",
            "checkpointing.enabled=false",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            f"logger.log_dir={tmp_path / 'logs'}",
            "logger.console_enabled=false",
            "logger.progress_bar=false",
        ],
    )
    tokenizer = get_policy_tokenizer(config.policy)
    # The tiny arithmetic prompts, labelled with the user's task.
    train, _ = setup_data(
        config.data, tokenizer, processor=math_processor, task_name="constant", max_seq_length=32
    )
    env = ray.remote(ConstantRewardEnv).remote(REWARD)

    # A task the given environments do not cover fails before anything starts.
    with pytest.raises(UserError, match=r"task 'constant'.*cover"):
        setup(config, tokenizer, train, None, task_to_env={"math": env})

    components = setup(config, tokenizer, train, None, task_to_env={"constant": env})
    try:
        assert components.owned_envs == [] and components.val_task_to_env == {"constant": env}
        metrics = grpo_train(components)
    finally:
        components.shutdown()

    assert components.state.step == 1
    assert metrics["reward"] == pytest.approx(REWARD)
    assert metrics["constant/mean_reward"] == pytest.approx(REWARD)
    assert metrics["advantages/max"] == 0.0  # equal rewards within each group
    # The environment passed in is the caller's: shutdown() left it running.
    assert ray.get(env.scored.remote(), timeout=TIMEOUT_S) == 2 * 4
    ray.kill(env)
