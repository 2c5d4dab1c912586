"""Group-relative advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl.algorithms.advantages import (
    STD_EPSILON,
    compute_advantages,
    contiguous_group_ids,
    group_ids_from_prompts,
)


def sample_std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


REWARDS = [1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0]  # two groups of four


def test_mean_baseline_without_normalisation() -> None:
    adv = compute_advantages(
        torch.tensor(REWARDS), use_leave_one_out_baseline=False, normalize_rewards=False, group_size=4
    )
    # Group means 0.5 and 2.0.
    expected = [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_leave_one_out_baseline() -> None:
    adv = compute_advantages(
        torch.tensor(REWARDS), use_leave_one_out_baseline=True, normalize_rewards=False, group_size=4
    )
    # r_i - mean of the other three.
    expected = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 3 - 5 / 3, 1 - 7 / 3, 2 - 2.0, 2 - 2.0]
    torch.testing.assert_close(adv, torch.tensor(expected))


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_std_normalisation(leave_one_out: bool) -> None:
    adv = compute_advantages(
        torch.tensor(REWARDS, dtype=torch.float64),
        use_leave_one_out_baseline=leave_one_out,
        normalize_rewards=True,
        group_size=4,
    )
    expected = []
    for g in range(2):
        group = REWARDS[4 * g : 4 * g + 4]
        std = sample_std(group)  # 0.577 and 0.816
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            baseline = sum(others) / 3 if leave_one_out else sum(group) / 4
            expected.append((r - baseline) / (std + STD_EPSILON))
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_zero_spread_groups_get_exactly_zero(leave_one_out: bool, normalize: bool) -> None:
    # 0.1 three times: the float mean is not exactly 0.1, the advantages must still be exactly 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0])
    adv = compute_advantages(
        rewards, use_leave_one_out_baseline=leave_one_out, normalize_rewards=normalize, group_size=3
    )
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert (adv[3:] != 0).all()


def test_group_ids_in_any_order() -> None:
    rewards = torch.tensor([1.0, 5.0, 0.0, 7.0, 2.0])
    group_ids = torch.tensor([4, 9, 4, 9, 4])  # groups {1, 0, 2} and {5, 7}
    adv = compute_advantages(
        rewards, use_leave_one_out_baseline=False, normalize_rewards=False, group_ids_N=group_ids
    )
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.0, -1.0, 1.0, 1.0]))


def test_invalid_samples_are_excluded_and_zeroed() -> None:
    rewards = torch.tensor([1.0, 0.0, 100.0, 0.0, 1.0, 1.0])
    valid = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    adv = compute_advantages(
        rewards, use_leave_one_out_baseline=True, normalize_rewards=False, group_size=3, valid_mask_N=valid
    )
    # Group 0: valid {1, 0}: LOO baselines 0 and 1; the invalid 100 counts for nothing.
    # Group 1: one valid response: no comparison possible.
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0]))


def test_group_ids_from_prompts() -> None:
    prompts = torch.tensor([[5, 6, 0], [5, 6, 0], [1, 2, 3], [5, 6, 0], [1, 2, 3]])
    assert group_ids_from_prompts(prompts).tolist() == [0, 0, 1, 0, 1]
    assert contiguous_group_ids(6, 3).tolist() == [0, 0, 0, 1, 1, 1]


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        contiguous_group_ids(6, 4)
    with pytest.raises(ValueError, match="exactly one"):
        compute_advantages(torch.zeros(4), use_leave_one_out_baseline=True, normalize_rewards=True)
    with pytest.raises(ValueError, match="finite"):
        compute_advantages(
            torch.tensor([1.0, float("nan")]),
            use_leave_one_out_baseline=True,
            normalize_rewards=True,
            group_size=2,
        )
