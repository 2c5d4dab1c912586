"""The contract between loss functions and the policy workers that call them.

Tensor legend: B = sequences in the micro-batch, T = padded sequence length, V = vocabulary size.

Token alignment: ``input_ids_BT[:, t]`` is predicted by ``next_token_logits_BTV[:, t - 1]``; per-token
quantities (``token_mask``, ``advantages``, ``*_logprobs``) are aligned with ``input_ids`` and their
position 0 is never trained on. A loss therefore compares ``next_token_logits[:, :-1]`` with
``input_ids[:, 1:]`` under ``token_mask[:, 1:] * sample_mask[:, None]``.

Normalisation: a loss returns its micro-batch's *share* of the global loss, i.e. a sum over its own tokens
(or sequences) divided by ``global_valid_toks`` (or ``global_valid_seqs``), the counts over the whole global
batch on all data-parallel ranks. Summing the returned losses over micro-batches and ranks gives the loss of
the step, so neither the data-parallel size nor the micro-batch size changes the loss or the gradients.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict


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
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return this micro-batch's share of the global loss (a scalar) and its metrics.

        Metrics are additive shares as well (summed over micro-batches and ranks by the caller), except
        names ending in ``_min`` / ``_max`` which are reduced with min / max.
        """
        ...
