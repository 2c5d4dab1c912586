"""What every policy worker (DTensor, Megatron) does with a batch the same way.

A ``train`` call gets whole global batches (:func:`step_batches` checks and slices them and counts each
one's valid sequences and tokens over the data-parallel group for the loss normalisation); each is split
into micro-batches (:func:`micro_batches`); each step's loss and metric shares are combined over the group and
recorded in a :class:`TrainLog` (:meth:`TrainLog.end_step`). Scoring calls put their
per-micro-batch outputs back into ``[B, T, ...]`` tensors with :func:`merge_rows`. Keeping these here means a
change to batching (sequence packing, a new reduction) is made once for both backends.

Tensor legend: B = sequences, T = tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nemo_rl.config.policy import DynamicBatchingConfig, PolicyConfig, SequencePackingConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.interfaces import TrainResult
from nemo_rl.models.policy.loss_interface import group_metrics, metric_reduction, reduce_metrics
from nemo_rl.models.policy.shared_prefix import prompt_lengths, shared_prefix_groups, shared_prefix_units
from nemo_rl.models.policy.utils import (
    fixed_size_parts,
    global_valid_counts,
    packing_parts,
    pad_sequence_dim,
    round_up,
    split_parts,
    token_budget_parts,
    trim_sequence_dim,
)


def steps_in_shard(
    num_rows: int,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    dp_size: int,
    rows_per_group: int,
    dynamic_batching: bool,
) -> tuple[int, int]:
    """``(optimizer steps, rows per step)`` of a rank's ``num_rows`` rows.

    Raises on anything but whole global batches, and on batch or micro-batch sizes that would split the
    loss's groups of rows (``LossFunction.rows_per_group``, e.g. preference pairs).
    """
    if global_batch_size % dp_size != 0:
        raise ValueError(
            f"the global batch size ({global_batch_size}) must be a multiple of the data-parallel size ({dp_size})"
        )
    local_batch_size = global_batch_size // dp_size
    if num_rows == 0 or num_rows % local_batch_size != 0:
        raise ValueError(
            f"this rank got {num_rows} sequences, not a positive multiple of its share of a global batch "
            f"({global_batch_size} / {dp_size} ranks = {local_batch_size}); pass whole global batches"
        )
    group = rows_per_group
    if local_batch_size % group or micro_batch_size % group:
        raise ValueError(
            f"the loss reads groups of {group} consecutive rows (preference pairs), but this rank's batch of "
            f"{local_batch_size} rows or its micro-batches of {micro_batch_size} would split them: make both "
            f"multiples of {group}"
        )
    if group > 1 and dynamic_batching:
        raise ValueError(
            "token-budget micro-batches (policy.dynamic_batching) reorder rows and would split the loss's "
            "groups of rows (preference pairs): set policy.dynamic_batching.enabled=false"
        )
    return num_rows // local_batch_size, local_batch_size


def micro_batches(
    batch: BatchedDataDict[Any],
    *,
    micro_batch_size: int,
    max_tokens: int,
    dynamic: DynamicBatchingConfig,
    seq_multiple: int,
    device: torch.device,
    dp_group: dist.ProcessGroup | None,
    packing: SequencePackingConfig | None = None,
    shared_prefix: bool = False,
) -> Iterator[tuple[list[int], BatchedDataDict[Any]]]:
    """``(row indices, micro-batch on the device)`` pairs covering ``batch``.

    Fixed-size micro-batches; with ``policy.dynamic_batching`` micro-batches bounded by ``max_tokens``
    padded tokens and cut to their longest row (rounded to ``sequence_length_round`` and ``seq_multiple``);
    given ``packing`` (the policy packs sequences), the rows of one pack of at most ``max_tokens`` tokens (the worker lays them end
    to end for the forward pass). Every dp rank runs the same number of micro-batches (forward passes are
    collectives over dp), so the count is agreed on first.

    With ``shared_prefix`` (the worker packs a micro-batch with each shared prompt once,
    ``policy.shared_prefix``) token budgets count a group's tokens (its prompt once, then every response),
    first-fit decreasing, and keep a group in one micro-batch unless it alone exceeds the budget; fixed-size
    micro-batches are unchanged (consecutive rows, so groups of consecutive samples share within each).
    """
    if not dynamic.enabled and packing is None:
        for rows in fixed_size_parts(batch.size, micro_batch_size):
            yield rows, batch.select_indices(rows).to(device)
        return
    seq_len = int(batch["input_ids"].shape[1])
    round_to = math.lcm(dynamic.sequence_length_round, seq_multiple)
    lengths = [int(n) for n in batch["input_lengths"].tolist()]
    if packing is not None:
        parts = packing_parts(lengths, max_tokens, in_order=packing.algorithm == "concatenative")
        round_to = seq_multiple
    elif shared_prefix and "token_mask" in batch:
        prompts = prompt_lengths(batch["token_mask"], batch["input_lengths"])
        groups = shared_prefix_groups(batch["input_ids"], prompts)
        units, unit_lengths = shared_prefix_units(groups, lengths, prompts, max_tokens)
        # The worker packs a micro-batch's units end to end: a budget of their summed tokens.
        parts = [
            [row for unit in part for row in units[unit]]
            for part in packing_parts(unit_lengths, max_tokens, in_order=False)
        ]
    else:
        parts = token_budget_parts(lengths, max_tokens, round_to)
    count = torch.tensor(len(parts), device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    for rows in split_parts(parts, int(count)):
        longest = max(lengths[row] for row in rows)
        mb = trim_sequence_dim(batch.select_indices(rows), min(round_up(longest, round_to), seq_len))
        yield rows, mb.to(device)


@dataclass(frozen=True)
class StepBatch:
    """This rank's rows of one global batch, and what the loss normalises by."""

    batch: BatchedDataDict[Any]
    """The rows, padded along T to the worker's sequence multiple."""

    micro_batch_size: int
    """Rows per micro-batch (``mbs`` or ``policy.train_micro_batch_size``)."""

    global_valid_seqs: torch.Tensor
    """Valid sequences of the whole global batch (all dp ranks)."""

    global_valid_toks: torch.Tensor
    """Trained tokens of the whole global batch (all dp ranks)."""


def step_batches(
    data: BatchedDataDict[Any],
    cfg: PolicyConfig,
    *,
    gbs: int | None,
    mbs: int | None,
    rows_per_group: int,
    dp_size: int,
    seq_multiple: int,
    device: torch.device,
    dp_group: dist.ProcessGroup | None,
) -> Iterator[StepBatch]:
    """The global batches of a ``train`` call, one per optimizer step, in order (see :func:`steps_in_shard`).

    ``gbs`` / ``mbs`` override ``cfg.train_global_batch_size`` / ``train_micro_batch_size``.
    """
    global_batch_size = gbs if gbs is not None else cfg.train_global_batch_size
    micro_batch_size = mbs if mbs is not None else cfg.train_micro_batch_size
    num_steps, local_batch_size = steps_in_shard(
        data.size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        dp_size=dp_size,
        rows_per_group=rows_per_group,
        dynamic_batching=cfg.dynamic_batching.enabled or cfg.packs_sequences,
    )
    for step in range(num_steps):
        batch = pad_sequence_dim(
            data.slice(step * local_batch_size, (step + 1) * local_batch_size), seq_multiple
        )
        seqs, toks = global_valid_counts_over_dp(batch, device, dp_group)
        yield StepBatch(batch, micro_batch_size, seqs, toks)


def global_valid_counts_over_dp(
    batch: BatchedDataDict[Any], device: torch.device, dp_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid sequences, valid tokens) of the whole global batch: this rank's counts summed over dp (float32)."""
    counts = torch.stack(global_valid_counts(batch)).to(device)
    dist.all_reduce(counts, group=dp_group)
    seqs, toks = counts.float().unbind()
    return seqs, toks


def all_reduce_metrics(
    metrics: dict[str, float], dp_group: dist.ProcessGroup | None, device: torch.device
) -> dict[str, float]:
    """Combine one step's metric shares over the dp ranks, as :func:`reduce_metrics` does within a rank."""
    # A rank whose micro-batches lacked a metric (e.g. a min over no valid tokens) must still join every
    # collective, so the ranks agree on the names first; a missing share is 0 (sum) or neutral (min/max).
    gathered: list[list[str] | None] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(gathered, sorted(metrics), group=dp_group)
    names = sorted({name for rank_names in gathered for name in rank_names or ()})
    neutral = {dist.ReduceOp.MIN: math.inf, dist.ReduceOp.MAX: -math.inf, dist.ReduceOp.SUM: 0.0}
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    out: dict[str, float] = {}
    for how, op in ops.items():
        selected = [n for n in names if metric_reduction(n) == how]
        if not selected:
            continue
        values = torch.tensor(
            [metrics.get(n, neutral[op]) for n in selected], dtype=torch.float64, device=device
        )
        dist.all_reduce(values, op=op, group=dp_group)
        out.update(zip(selected, values.tolist(), strict=True))
    return out


def merge_rows(
    outputs: Sequence[tuple[Sequence[int], dict[str, torch.Tensor]]], num_rows: int, seq_len: int
) -> BatchedDataDict[Any]:
    """Put per-micro-batch ``(rows, {key: value})`` outputs back in row order, on the host.

    Per-token values ``[b, t, ...]`` become ``[num_rows, seq_len, ...]`` (a micro-batch may be shorter along T
    with dynamic batching, or longer when padded for sequence parallelism); per-sequence values ``[b]`` become
    ``[num_rows]``.
    """
    merged: dict[str, torch.Tensor] = {}
    for rows, values in outputs:
        for key, value in values.items():
            value = value.cpu()
            if value.ndim == 1:
                merged.setdefault(key, value.new_zeros(num_rows))[list(rows)] = value
                continue
            if key not in merged:
                merged[key] = value.new_zeros((num_rows, seq_len, *value.shape[2:]))
            length = min(seq_len, value.shape[1])
            merged[key][list(rows), :length] = value[:, :length]
    return BatchedDataDict(merged)


@dataclass
class TrainLog:
    """The per-step record of one ``train`` call, turned into its :class:`TrainResult`."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    valid_seqs: list[float] = field(default_factory=list)
    valid_toks: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)

    def end_step(
        self,
        step: StepBatch,
        loss: float,
        micro_batch_metrics: list[dict[str, float]],
        dp_group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        """Record one step: this rank's ``loss`` and metric shares (summed over its micro-batches) are
        combined over the dp ranks first (a collective)."""
        loss_sum = torch.tensor(loss, dtype=torch.float64, device=device)
        dist.all_reduce(loss_sum, group=dp_group)
        self.losses.append(float(loss_sum))
        self.valid_seqs.append(float(step.global_valid_seqs))
        self.valid_toks.append(float(step.global_valid_toks))
        self.metrics.append(
            all_reduce_metrics(reduce_metrics(group_metrics(micro_batch_metrics)), dp_group, device)
        )

    def add_update(self, grad_norm: float, lr: float) -> None:
        """Record one optimizer update's gradient norm (before clipping) and learning rate."""
        self.grad_norms.append(grad_norm)
        self.lrs.append(lr)

    def result(self, eval_mode: bool) -> TrainResult:
        """The :class:`TrainResult` of the recorded steps (no ``grad_norm`` / ``lr`` in ``eval_mode``)."""
        result: TrainResult = {
            "loss": torch.tensor(self.losses),
            "global_valid_seqs": torch.tensor(self.valid_seqs),
            "global_valid_toks": torch.tensor(self.valid_toks),
            "metrics": {
                name: [m.get(name, math.nan) for m in self.metrics]
                for name in sorted({name for m in self.metrics for name in m})
            },
        }
        if not eval_mode:
            result["grad_norm"] = torch.tensor(self.grad_norms)
            result["lr"] = torch.tensor(self.lrs)
        return result
