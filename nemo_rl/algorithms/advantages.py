"""Group-relative advantages for GRPO / RLOO.

Each prompt is answered ``G`` times; a response's advantage is its reward minus a baseline computed from
the rewards of its prompt's group, optionally divided by the group's reward standard deviation:

* mean baseline (GRPO): ``b_i = mean_j r_j`` over the group;
* leave-one-out baseline (RLOO, ``use_leave_one_out_baseline``): ``b_i = mean_{j != i} r_j``, an unbiased
  baseline because it does not depend on the response it is subtracted from;
* ``normalize_rewards``: ``A_i = (r_i - b_i) / (std_group + STD_EPSILON)`` with the unbiased (n - 1)
  standard deviation of the group's valid rewards.

A group whose valid rewards are all equal (every response right, or every one wrong) teaches nothing
relative to itself: its advantages are exactly 0. So are the advantages of responses that are not valid
(``valid_mask`` 0; they are also excluded from their group's baseline and spread) and of responses whose
group has fewer than two valid members.

Tensor legend: N = responses in the batch.
"""

from __future__ import annotations

import math

import torch

STD_EPSILON = 1e-6
"""Added to the group standard deviation before dividing, so tiny spreads do not blow advantages up."""


def group_ids_from_prompts(prompt_ids_NT: torch.Tensor) -> torch.Tensor:
    """Group id per response: responses whose (padded) prompt token rows are identical share a group.

    Ids are numbered by first appearance (0, 1, 2...), so contiguous repeats keep increasing ids.
    """
    if prompt_ids_NT.ndim != 2:
        raise ValueError(f"prompt ids must be [N, T]; got shape {tuple(prompt_ids_NT.shape)}")
    _, inverse_N = torch.unique(prompt_ids_NT, dim=0, return_inverse=True)
    return _renumber_by_first_appearance(inverse_N)


def contiguous_group_ids(num_responses: int, group_size: int) -> torch.Tensor:
    """Group ids for a batch laid out as consecutive groups of ``group_size`` responses."""
    if group_size < 1 or num_responses % group_size != 0:
        raise ValueError(
            f"a batch of {num_responses} responses cannot be split into groups of {group_size}: the "
            "batch must hold num_prompts * num_generations_per_prompt responses, prompt by prompt."
        )
    return torch.arange(num_responses) // group_size


def _renumber_by_first_appearance(ids_N: torch.Tensor) -> torch.Tensor:
    order: dict[int, int] = {}
    return torch.tensor([order.setdefault(int(i), len(order)) for i in ids_N.tolist()], dtype=torch.long)


def group_baseline_and_std(
    rewards_N: torch.Tensor,
    group_ids_N: torch.Tensor,
    *,
    use_leave_one_out_baseline: bool,
    valid_mask_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response baseline, group standard deviation and group valid count (all [N], float).

    Only valid responses (``valid_mask`` 1, all by default) contribute. The leave-one-out baseline of a
    valid response excludes its own reward; that of an invalid one is the plain mean of the valid rewards.
    Groups with no valid response get baseline 0 and std 0.
    """
    if rewards_N.ndim != 1 or group_ids_N.shape != rewards_N.shape:
        raise ValueError(
            f"rewards must be [N] with one group id each; got rewards {tuple(rewards_N.shape)} and group "
            f"ids {tuple(group_ids_N.shape)}"
        )
    rewards = rewards_N.detach().to(torch.float64)
    valid = (
        torch.ones_like(rewards)
        if valid_mask_N is None
        else valid_mask_N.detach().to(device=rewards.device, dtype=torch.float64)
    )
    _, group_N = torch.unique(group_ids_N.to(rewards.device), return_inverse=True)
    num_groups = int(group_N.max().item()) + 1 if group_N.numel() else 0

    def per_group_sum(values_N: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(
            0, group_N, values_N
        )

    count_G = per_group_sum(valid)
    sum_G = per_group_sum(rewards * valid)
    count_N, sum_N = count_G[group_N], sum_G[group_N]
    mean_N = sum_N / count_N.clamp(min=1)
    # Two-pass variance (squared deviations from the mean) avoids the cancellation of E[r^2] - E[r]^2.
    sq_dev_G = per_group_sum(((rewards - mean_N) ** 2) * valid)
    std_N = torch.sqrt(sq_dev_G[group_N] / (count_N - 1).clamp(min=1))

    if use_leave_one_out_baseline:
        others_N = count_N - valid
        baseline_N = torch.where(others_N > 0, (sum_N - rewards * valid) / others_N.clamp(min=1), mean_N)
    else:
        baseline_N = mean_N
    # Equal rewards must give a std of exactly 0, which float sums (0.1 * 3 / 3 != 0.1) do not guarantee.
    valid_rewards_N = rewards[valid != 0]
    valid_groups_N = group_N[valid != 0]
    max_G = torch.full((num_groups,), -math.inf, dtype=torch.float64, device=rewards.device)
    min_G = torch.full((num_groups,), math.inf, dtype=torch.float64, device=rewards.device)
    max_G = max_G.scatter_reduce(0, valid_groups_N, valid_rewards_N, reduce="amax")
    min_G = min_G.scatter_reduce(0, valid_groups_N, valid_rewards_N, reduce="amin")
    std_N = torch.where(max_G[group_N] > min_G[group_N], std_N, torch.zeros_like(std_N))
    out_dtype = torch.promote_types(rewards_N.dtype, torch.float32)
    return baseline_N.to(out_dtype), std_N.to(out_dtype), count_N.to(out_dtype)


def compute_advantages(
    rewards_N: torch.Tensor,
    *,
    use_leave_one_out_baseline: bool,
    normalize_rewards: bool,
    group_ids_N: torch.Tensor | None = None,
    group_size: int | None = None,
    valid_mask_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages [N] of responses scored with ``rewards_N``, relative to their prompt's group.

    Args:
        rewards_N: One scalar reward per response.
        use_leave_one_out_baseline: Baseline each response with the mean of the *other* responses of its
            group (``grpo.use_leave_one_out_baseline``) instead of the group mean.
        normalize_rewards: Divide by the group's reward std plus :data:`STD_EPSILON`
            (``grpo.normalize_rewards``).
        group_ids_N: Group of each response (any integer labels). Give exactly one of this and
            ``group_size``.
        group_size: The batch is consecutive groups of this many responses.
        valid_mask_N: 1 for responses that take part (e.g. the batch's ``sample_mask``); others get
            advantage 0 and do not affect their group. ``None`` means all are valid.

    Returns:
        Advantages with the dtype and device of ``rewards_N``; broadcast them over the response tokens
        with ``advantages[:, None] * token_mask`` (or ``expand``) for the loss.
    """
    if (group_ids_N is None) == (group_size is None):
        raise ValueError("give exactly one of group_ids_N (a group label per response) and group_size")
    if group_ids_N is None:
        assert group_size is not None
        group_ids_N = contiguous_group_ids(rewards_N.shape[0], group_size)
    rewards_N = rewards_N.to(torch.promote_types(rewards_N.dtype, torch.float32))
    if not torch.isfinite(rewards_N).all():
        raise ValueError(
            f"rewards must be finite; got {rewards_N.tolist()}: check the environment's reward function"
        )
    baseline_N, std_N, count_N = group_baseline_and_std(
        rewards_N,
        group_ids_N,
        use_leave_one_out_baseline=use_leave_one_out_baseline,
        valid_mask_N=valid_mask_N,
    )
    advantages_N = rewards_N - baseline_N
    if normalize_rewards:
        advantages_N = advantages_N / (std_N + STD_EPSILON)
    # Zero spread, too few valid members or an invalid response: exactly 0, not a rounding residue.
    informative_N = (std_N > 0) & (count_N >= 2)
    if valid_mask_N is not None:
        informative_N &= valid_mask_N.to(device=rewards_N.device) != 0
    return torch.where(informative_N, advantages_N, torch.zeros_like(advantages_N))
