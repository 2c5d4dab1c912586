"""GRPO's reward transforms (NeMo RL's ``grpo.reward_scaling`` and ``grpo.reward_shaping``)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from nemo_rl.algorithms.rewards import first_response_lengths, scale_rewards, shape_rewards
from nemo_rl.config.algorithms import RewardScalingConfig, RewardShapingConfig


def test_scaling_clamps_then_maps_linearly() -> None:
    rewards = torch.tensor([-1.0, 0.0, 0.5, 1.0, 3.0])
    cfg = RewardScalingConfig(enabled=True, source_min=0.0, source_max=1.0, target_min=-1.0, target_max=1.0)
    assert torch.equal(scale_rewards(rewards, cfg), torch.tensor([-1.0, -1.0, 0.0, 1.0, 1.0]))
    assert scale_rewards(rewards, RewardScalingConfig()) is rewards  # off by default
    with pytest.raises(ValidationError, match="source_max"):
        RewardScalingConfig(source_min=1.0, source_max=1.0)


def test_dapo_overlong_penalty_and_truncation_factor() -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    lengths = torch.tensor([10, 12, 16, 16])
    truncated = torch.tensor([False, False, True, True])
    # Penalty ramps from 0 at 16 - 8 = 8 tokens to 0.5 at 16: 0.5 * (len - 8) / 8.
    dapo = RewardShapingConfig(
        enabled=True, max_response_length=16, overlong_buffer_length=8, overlong_buffer_penalty=0.5
    )
    expected = torch.tensor([1.0 - 0.125, 1.0 - 0.25, 0.5, -0.5])
    assert torch.allclose(shape_rewards(rewards, lengths, truncated, dapo), expected)
    short = torch.tensor([2, 3, 4, 8])
    assert torch.equal(shape_rewards(rewards, short, truncated, dapo), rewards)  # within budget: unchanged
    coef = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.25)
    assert torch.equal(shape_rewards(rewards, lengths, truncated, coef), torch.tensor([1.0, 1.0, 0.25, 0.0]))
    with pytest.raises(ValidationError, match="max_response_length"):
        RewardShapingConfig(enabled=True)


def test_response_length_is_the_first_assistant_turn() -> None:
    logs = [
        [{"role": "user", "token_ids": torch.ones(5)}, {"role": "assistant", "token_ids": torch.ones(3)}],
        [
            {"role": "assistant", "token_ids": torch.ones(2)},
            {"role": "assistant", "token_ids": torch.ones(9)},
        ],
    ]
    assert first_response_lengths(logs).tolist() == [3, 2]
    with pytest.raises(ValueError, match="rollout 0 has no assistant turn"):
        first_response_lengths([[{"role": "user", "token_ids": torch.ones(1)}]])


def test_grpo_applies_scaling_then_shaping_to_the_rollout() -> None:
    from nemo_rl.algorithms.scored_rollouts import transformed_rewards
    from nemo_rl.config.algorithms import GRPOConfig
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    rollout = BatchedDataDict(
        total_reward=torch.tensor([0.5, 2.0]),
        truncated=torch.tensor([False, True]),
        message_log=[[{"role": "assistant", "token_ids": torch.ones(4)}]] * 2,
    )
    cfg = GRPOConfig.model_validate(
        {
            "reward_scaling": {"enabled": True, "target_max": 2.0},
            "reward_shaping": {"enabled": True, "stop_properly_penalty_coef": 0.5},
        }
    )
    # [0.5, 2.0] -> clamped to [0, 1] and scaled to [0, 2]: [1.0, 2.0]; the truncated one halved: [1.0, 1.0].
    assert torch.equal(transformed_rewards(rollout, cfg), torch.tensor([1.0, 1.0]))
    assert torch.equal(transformed_rewards(rollout, GRPOConfig()), rollout["total_reward"])
