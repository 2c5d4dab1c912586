"""Reward transforms applied between the environments and the advantages (NeMo RL's ``grpo.reward_scaling``
and ``grpo.reward_shaping``), in that order.

Tensor legend: N = responses in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_rl.config.algorithms import RewardScalingConfig, RewardShapingConfig


def scale_rewards(rewards_N: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """Clamp to [source_min, source_max] and map linearly onto [target_min, target_max] (when enabled)."""
    if not cfg.enabled:
        return rewards_N
    clamped_N = rewards_N.clamp(cfg.source_min, cfg.source_max)
    share_N = (clamped_N - cfg.source_min) / (cfg.source_max - cfg.source_min)
    return cfg.target_min + share_N * (cfg.target_max - cfg.target_min)


def first_response_lengths(message_logs: Sequence[Sequence[dict[str, Any]]]) -> torch.Tensor:
    """[N] tokens of each rollout's first assistant turn (what DAPO's length penalty counts)."""
    lengths = []
    for index, log in enumerate(message_logs):
        turn = next((m for m in log if m["role"] == "assistant"), None)
        if turn is None:
            raise ValueError(f"rollout {index} has no assistant turn to measure for grpo.reward_shaping")
        lengths.append(int(turn["token_ids"].shape[0]))
    return torch.tensor(lengths)


def shape_rewards(
    rewards_N: torch.Tensor,
    response_lengths_N: torch.Tensor,
    truncated_N: torch.Tensor,
    cfg: RewardShapingConfig,
) -> torch.Tensor:
    """DAPO's overlong penalty, or the truncation factor ``stop_properly_penalty_coef`` (see the config)."""
    if not cfg.enabled:
        return rewards_N
    if cfg.stop_properly_penalty_coef is not None:
        return torch.where(truncated_N.bool(), rewards_N * cfg.stop_properly_penalty_coef, rewards_N)
    assert cfg.max_response_length is not None  # checked by RewardShapingConfig
    expected = cfg.max_response_length - cfg.overlong_buffer_length
    exceed_N = response_lengths_N.to(rewards_N.dtype) - expected
    penalty_N = (-exceed_N / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty).clamp(max=0.0)
    return rewards_N + penalty_N
