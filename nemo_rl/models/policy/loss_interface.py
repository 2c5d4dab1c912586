"""The contract between loss functions and the policy workers that call them.

It lives with the policy because the policy workers call it; algorithms implement it (``loss_functions.py``)
and import it from here (``nemo_rl.algorithms.interfaces`` re-exports it for users).

Tensor legend: B = sequences in the micro-batch, T = padded sequence length, V = vocabulary size.

Token alignment: ``input_ids_BT[:, t]`` is predicted by ``next_token_logits_BTV[:, t - 1]``; per-token
quantities (``token_mask``, ``advantages``, ``*_logprobs``) are aligned with ``input_ids`` and their
position 0 is never trained on. A loss therefore compares ``next_token_logits[:, :-1]`` with
``input_ids[:, 1:]`` under ``token_mask[:, 1:] * sample_mask[:, None]``.

Normalisation: a loss returns its micro-batch's *share* of the global loss, i.e. a sum over its own tokens
(or sequences) divided by ``global_valid_toks`` (or ``global_valid_seqs``), the counts over the whole global
batch on all data-parallel ranks. Summing the returned losses over micro-batches and ranks gives the loss of
the step, so neither the data-parallel size nor the micro-batch size changes the loss or the gradients.

Metrics: a loss's metrics are shares too, combined by :func:`reduce_metrics`: summed over micro-batches and
data-parallel ranks, except names ending in ``_min`` / ``_max``, which take the min / max.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict

MetricReduction = Literal["sum", "mean", "min", "max"]


class LossType(enum.Enum):
    """How a loss averages: over all valid tokens of the batch, or per sequence then over sequences."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossFunction(Protocol):
    """A loss the policy workers can train with."""

    loss_type: LossType

    rows_per_group: int
    """The loss reads the batch in groups of this many consecutive rows (1: rows are independent; 2: a
    preference pair, chosen then rejected). The policy keeps every group on one data-parallel rank and in one
    micro-batch, so batch and micro-batch sizes must be multiples of it."""

    def __call__(
        self,
        next_token_logits_BTV: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        /,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return this micro-batch's share of the global loss (a scalar) and its metrics.

        The workers pass the arguments by position: the model's output (next-token logits [B, T, V], or a
        reward model's rewards [B] / [B, 1]), the micro-batch, and the global batch's valid sequence and token
        counts.

        Metrics are additive shares as well (summed over micro-batches and ranks by the caller), except
        names ending in ``_min`` / ``_max`` which are reduced with min / max.
        """
        ...


def metric_reduction(name: str, additive: Literal["sum", "mean"] = "sum") -> MetricReduction:
    """How values of metric ``name`` combine: ``*_min`` -> min, ``*_max`` -> max, anything else ``additive``."""
    if name.endswith("_min"):
        return "min"
    if name.endswith("_max"):
        return "max"
    return additive


def group_metrics(metrics: Iterable[Mapping[str, float]]) -> dict[str, list[float]]:
    """Per name, the values of the dicts that have it, in order (``[{"a": 1}, {"a": 2}]`` -> ``{"a": [1, 2]}``)."""
    out: dict[str, list[float]] = {}
    for m in metrics:
        for name, value in m.items():
            out.setdefault(name, []).append(float(value))
    return out


def reduce_metrics(
    values_by_name: Mapping[str, Sequence[float]], additive: Literal["sum", "mean"] = "sum"
) -> dict[str, float]:
    """One number per metric from its list of values, by :func:`metric_reduction`.

    ``additive="sum"`` combines a loss's shares (micro-batches, data-parallel ranks); ``"mean"`` averages
    per-step values (several optimizer steps in one ``train`` call). Names with no values are left out.
    """
    out: dict[str, float] = {}
    for name, values in values_by_name.items():
        if not values:
            continue
        how = metric_reduction(name, additive)
        if how == "min":
            out[name] = min(values)
        elif how == "max":
            out[name] = max(values)
        elif how == "sum":
            out[name] = sum(values)
        else:
            out[name] = sum(values) / len(values)
    return out
