"""The vision-language environment: each response scored against the sample's ``ground_truth`` by a weighted
sum of reward functions (:mod:`nemo_rl.environments.vlm_rewards`), single turn.

It is registered under NeMo RL's names, each with its own section and default reward
(:data:`nemo_rl.config.vlm_env.DEFAULT_REWARD_FUNCTIONS`): ``clevr-cogent`` (the ``<answer>`` text against the
CLEVR answer, plus the format), ``geometry3k``, ``refcoco``, ``vlm``, and ``tiny_clevr``, the counting verifier
of the generated pictures (the last ``\\boxed{}`` integer against the count).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nemo_rl.config.vlm_env import VlmEnvConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    check_ground_truths,
    check_step_batch,
)
from nemo_rl.environments.metrics import batch_rewards, group_ids, last_assistant_text, pass_at_samples
from nemo_rl.environments.vlm_rewards import CombinedReward

VlmMetadata = dict[str, Any]
"""Per-sample state: ``ground_truth`` (from the dataset); each step adds ``extracted_answer`` and ``correct``."""


class VlmEnvironment(EnvironmentInterface[VlmMetadata]):
    """Scores vision-language responses with the section's reward functions (see the module docstring).

    Args:
        cfg: The environment's section, a :class:`VlmEnvConfig` (``EnvConfig.section`` builds it, defaults
            filled in).
    """

    def __init__(self, cfg: VlmEnvConfig | Mapping[str, Any]) -> None:
        self.cfg = cfg if isinstance(cfg, VlmEnvConfig) else VlmEnvConfig.model_validate(dict(cfg))
        self.reward = CombinedReward.from_config(self.cfg.reward_functions)

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[VlmMetadata]
    ) -> EnvironmentReturn[VlmMetadata]:
        """Score the last assistant message of each conversation against its ``ground_truth``."""
        check_step_batch(message_log_batch, metadata)
        check_ground_truths(
            metadata, "vision-language", "the VLM data processor puts the expected answer there"
        )
        terms = [
            self.reward(str(m["ground_truth"]), last_assistant_text(log))
            for log, m in zip(message_log_batch, metadata, strict=True)
        ]
        return EnvironmentReturn(
            observations=[
                {"role": "environment", "content": f"Environment: {'correct' if t.correct else 'incorrect'}"}
                for t in terms
            ],
            metadata=[
                {**m, "extracted_answer": t.answer, "correct": t.correct}
                for m, t in zip(metadata, terms, strict=True)
            ],
            next_stop_strings=[self.cfg.stop_strings] * len(terms),
            rewards=torch.tensor([t.score for t in terms], dtype=torch.float32),
            terminateds=torch.ones(len(terms), dtype=torch.bool),
            answers=[t.answer for t in terms],
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """Accuracy (the share of correct answers), mean reward and pass@(samples per prompt) of a finished
        batch; the batch is returned unchanged."""
        rewards_B = batch_rewards(batch)
        infos = batch["extra_env_info"] if "extra_env_info" in batch else [None] * rewards_B.numel()
        correct_B = torch.tensor(
            [bool(info.get("correct")) if isinstance(info, Mapping) else False for info in infos],
            dtype=torch.float32,
        )
        groups = group_ids(batch)
        metrics = {
            "accuracy": correct_B.mean().item() if correct_B.numel() else 0.0,
            "mean_reward": rewards_B.mean().item() if rewards_B.numel() else 0.0,
            "pass@samples_per_prompt": pass_at_samples(correct_B, groups, threshold=1.0),
            "num_problems_in_batch": float(len(set(groups))),
        }
        return batch, metrics
