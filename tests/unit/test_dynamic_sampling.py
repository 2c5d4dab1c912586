"""DAPO's dynamic sampling: which groups are kept, how batches accumulate, and the error after the last one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.dynamic_sampling import (
    EndlessBatches,
    groups_with_distinct_rewards,
    sample_until_full,
)
from nemo_rl.config.algorithms import GRPOConfig
from nemo_rl.config.errors import UserError
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

GROUP = 2


def test_groups_whose_rewards_all_equal_are_dropped() -> None:
    rewards_B = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.25])
    assert groups_with_distinct_rewards(rewards_B, GROUP) == [2, 3, 6, 7]
    assert groups_with_distinct_rewards(torch.zeros(4), GROUP) == []
    with pytest.raises(ValueError, match="groups of 2"):
        groups_with_distinct_rewards(torch.zeros(3), GROUP)


def _rollouts(rewards_per_batch: list[list[float]]) -> tuple[Iterator[int], Any]:
    """Batches are numbers; rolling out batch ``n`` gives ``rewards_per_batch[n]`` (tagged with ``n``)."""

    def roll_out(n: int) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        rewards = torch.tensor(rewards_per_batch[n])
        rollout = BatchedDataDict({"total_reward": rewards, "batch": torch.full_like(rewards, n)})
        return rollout, {"reward": float(rewards.mean()), "tokens": 10.0 * (n + 1)}

    return iter(range(1, len(rewards_per_batch))), roll_out


def test_batches_accumulate_until_the_step_is_full_and_the_surplus_is_discarded() -> None:
    later, roll_out = _rollouts(
        [
            [1.0, 1.0, 0.0, 1.0],  # one group kept
            [0.0, 0.0, 1.0, 1.0],  # none
            [1.0, 0.0, 0.0, 1.0],  # two: one too many
        ]
    )
    selected, metrics = sample_until_full(
        0, lambda: next(later), roll_out, num_samples=4, group_size=GROUP, max_gen_batches=3
    )
    assert selected["total_reward"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert selected["batch"].tolist() == [0.0, 0.0, 2.0, 2.0]  # whole groups, in generation order
    assert metrics["dynamic_sampling_num_gen_batches"] == 3
    assert metrics["dynamic_sampling_num_discarded_valid_samples"] == 2
    assert metrics["filtered_reward"] == pytest.approx(0.5)
    # Rollout metrics cover every generated batch (reward: all 12 responses).
    assert metrics["reward"] == pytest.approx(7 / 12)
    assert metrics["tokens"] == pytest.approx(20.0)


def test_a_full_first_batch_draws_no_other() -> None:
    later, roll_out = _rollouts([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    selected, metrics = sample_until_full(
        0, lambda: next(later), roll_out, num_samples=4, group_size=GROUP, max_gen_batches=1
    )
    assert selected.size == 4 and metrics["dynamic_sampling_num_gen_batches"] == 1
    assert next(later) == 1  # untouched


def test_too_few_distinct_groups_after_the_last_batch_fail_naming_the_knobs() -> None:
    later, roll_out = _rollouts([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    with pytest.raises(UserError, match=r"found 2 of the 4 .*dynamic_sampling_max_gen_batches=2"):
        sample_until_full(
            0, lambda: next(later), roll_out, num_samples=4, group_size=GROUP, max_gen_batches=2
        )


def test_endless_batches_run_epoch_after_epoch() -> None:
    batches = EndlessBatches([1, 2, 3])
    assert [next(batches) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(UserError, match="no batch"):
        next(EndlessBatches([]))


def test_batch_multiplier_sizes_generation_batches_only_under_dynamic_sampling() -> None:
    cfg = GRPOConfig(num_prompts_per_step=4, use_dynamic_sampling=True, batch_multiplier=1.5)
    assert cfg.prompts_per_generation_batch == 6
    assert GRPOConfig(num_prompts_per_step=4).prompts_per_generation_batch == 4
    with pytest.raises(ValueError, match=r"grpo\.batch_multiplier=2\.0 .*use_dynamic_sampling=true"):
        GRPOConfig(batch_multiplier=2)
