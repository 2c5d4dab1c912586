"""DAPO's dynamic sampling (``grpo.use_dynamic_sampling``): train only on prompt groups with a learning signal.

A group whose responses all earn the same reward has zero advantage everywhere, so it adds nothing to the
policy gradient but dilutes the batch. Dynamic sampling drops such groups and rolls out further prompt
batches (``batch_multiplier`` x ``num_prompts_per_step`` prompts each) until ``num_prompts_per_step`` x
``num_generations_per_prompt`` responses with distinct rewards are collected; the surplus of the last batch
is discarded. A step that needs more than ``dynamic_sampling_max_gen_batches`` batches fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from nemo_rl.config.errors import UserError
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

B = TypeVar("B")

RollOut = Callable[[B], tuple[BatchedDataDict[Any], dict[str, float]]]
"""Rolls out one prompt batch: the scored responses (``total_reward`` [B], groups of consecutive samples)
and the batch's metrics (per-sample means)."""


def groups_with_distinct_rewards(rewards_B: torch.Tensor, group_size: int) -> list[int]:
    """Indices of the samples whose group (``group_size`` consecutive samples) has rewards that are not all
    equal, in order."""
    if rewards_B.numel() % group_size != 0:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    groups_GN = rewards_B.reshape(-1, group_size)
    distinct_G = (groups_GN != groups_GN[:, :1]).any(dim=1)
    return [
        int(g) * group_size + i
        for g in torch.nonzero(distinct_G).flatten().tolist()
        for i in range(group_size)
    ]


def _mean_metrics(per_batch: list[dict[str, float]]) -> dict[str, float]:
    """Each metric averaged over the generation batches that report it (batches are equal-sized)."""
    names = {name for metrics in per_batch for name in metrics}
    return {
        name: sum(m[name] for m in per_batch if name in m) / sum(1 for m in per_batch if name in m)
        for name in sorted(names)
    }


def sample_until_full(
    first_batch: B,
    next_batch: Callable[[], B],
    roll_out: RollOut[B],
    *,
    num_samples: int,
    group_size: int,
    max_gen_batches: int,
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    """Roll out ``first_batch``, then batches from ``next_batch()``, until ``num_samples`` responses in groups
    with distinct rewards are collected; return the first ``num_samples`` of them and the step's metrics.

    Metrics: those of :data:`RollOut` averaged over the generation batches (``reward`` among them, so it
    covers every response generated), plus ``filtered_reward`` (mean reward of the responses kept),
    ``dynamic_sampling_num_gen_batches`` and ``dynamic_sampling_num_discarded_valid_samples`` (responses
    with distinct rewards left over).

    Raises:
        UserError: ``max_gen_batches`` batches leave fewer than ``num_samples`` such responses.
    """
    kept: list[BatchedDataDict[Any]] = []
    num_kept = 0
    per_batch: list[dict[str, float]] = []
    batch = first_batch
    while True:
        rollout, metrics = roll_out(batch)
        per_batch.append(metrics)
        keep = groups_with_distinct_rewards(rollout["total_reward"], group_size)
        if keep:
            kept.append(rollout.select_indices(keep))
            num_kept += len(keep)
        if num_kept >= num_samples:
            break
        if len(per_batch) >= max_gen_batches:
            raise UserError(
                f"dynamic sampling found {num_kept} of the {num_samples} responses a step needs in prompt "
                f"groups with distinct rewards after grpo.dynamic_sampling_max_gen_batches={max_gen_batches} "
                "generation batches: raise it or grpo.batch_multiplier, sample more responses per prompt "
                "(grpo.num_generations_per_prompt), or use prompts whose rewards vary"
            )
        batch = next_batch()
    selected = BatchedDataDict.from_batches(kept) if len(kept) > 1 else kept[0]
    selected = selected.slice(0, num_samples)
    return selected, {
        **_mean_metrics(per_batch),
        "filtered_reward": float(selected["total_reward"].mean()),
        "dynamic_sampling_num_gen_batches": float(len(per_batch)),
        "dynamic_sampling_num_discarded_valid_samples": float(num_kept - num_samples),
    }


class EndlessBatches(Iterator[B]):
    """A loader's batches epoch after epoch, as one stream: the training loop takes one batch per step and
    dynamic sampling draws more from the same stream within a step (a resumed loader continues where its
    checkpoint left it)."""

    def __init__(self, loader: Iterable[B]) -> None:
        self.loader = loader
        self._epoch: Iterator[B] | None = None

    def __iter__(self) -> EndlessBatches[B]:
        return self

    def __next__(self) -> B:
        for fresh in (False, True):
            if self._epoch is None or fresh:
                self._epoch = iter(self.loader)
            try:
                return next(self._epoch)
            except StopIteration:
                self._epoch = None
        raise UserError("the training data yields no batch: it has fewer prompts than one generation batch")
