"""Pure tensor helpers shared by the policy workers (no process groups, no models).

Tensor legend: B = sequences, T = padded tokens, V = vocabulary, K = top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict


def valid_token_mask(input_lengths_B: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, T] bool: position ``t`` holds a real (non-padding) token of its sequence."""
    positions = torch.arange(seq_len, device=input_lengths_B.device)
    return positions[None, :] < input_lengths_B[:, None]


def token_logprobs(
    logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, input_lengths_B: torch.Tensor
) -> torch.Tensor:
    """[B, T] float32 log-probs aligned with the tokens: ``lp[:, t] = log p(ids[t] | ids[:t])``.

    Position 0 (no context) and padding positions are 0. Computed as ``logit - logsumexp`` in float32, which
    never materialises the [B, T, V] log-softmax.
    """
    next_logits_BTV = logits_BTV[:, :-1].float()
    targets_BT = input_ids_BT[:, 1:]
    picked_BT = next_logits_BTV.gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
    logprobs_BT = torch.zeros(input_ids_BT.shape, dtype=torch.float32, device=logits_BTV.device)
    logprobs_BT[:, 1:] = picked_BT - torch.logsumexp(next_logits_BTV, dim=-1)
    valid_BT = valid_token_mask(input_lengths_B.to(logits_BTV.device), input_ids_BT.shape[1])
    return torch.where(valid_BT, logprobs_BT, 0.0)


def topk_logits(
    logits_BTV: torch.Tensor, input_lengths_B: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits at every position ([B, T, K] float32) and their token ids ([B, T, K] long).

    Not shifted: position ``t`` is the distribution of the token after ``t``. Padding positions are 0.
    """
    if not 1 <= k <= logits_BTV.shape[-1]:
        raise ValueError(f"k must be between 1 and the vocabulary size ({logits_BTV.shape[-1]}), got {k}")
    values_BTK, indices_BTK = torch.topk(logits_BTV.float(), k, dim=-1)
    valid_BT1 = valid_token_mask(input_lengths_B.to(logits_BTV.device), logits_BTV.shape[1]).unsqueeze(-1)
    return torch.where(valid_BT1, values_BTK, 0.0), torch.where(valid_BT1, indices_BTK, 0)


def global_valid_counts(batch: BatchedDataDict[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (valid sequences, valid tokens) in ``batch``, as float64 scalars, for loss normalisation.

    Tokens are counted as the losses train on them: ``token_mask[:, 1:] * sample_mask[:, None]``.
    """
    for key in ("token_mask", "sample_mask"):
        if key not in batch:
            raise KeyError(
                f"a training batch needs {key!r} (see nemo_rl/models/policy/loss_interface.py); it has "
                f"{sorted(batch.keys())}"
            )
    sample_mask_B = batch["sample_mask"].double()
    token_mask_BT = batch["token_mask"].double()
    num_seqs = sample_mask_B.sum()
    num_toks = (token_mask_BT[:, 1:] * sample_mask_B[:, None]).sum()
    return num_seqs, num_toks


def pad_sequence_dim(batch: BatchedDataDict[Any], multiple: int) -> BatchedDataDict[Any]:
    """Right-pad every per-token tensor of ``batch`` with zeros so T is a multiple of ``multiple``.

    Per-token tensors are those with ``shape[1] == T`` (T = ``input_ids.shape[1]``), e.g. masks and
    log-probs; padding is masked out by ``input_lengths`` / ``token_mask``, so zeros are safe.
    """
    seq_len = int(batch["input_ids"].shape[1])
    padded_len = math.ceil(seq_len / multiple) * multiple
    if padded_len == seq_len:
        return batch
    out: BatchedDataDict[Any] = BatchedDataDict()
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == seq_len:
            pad = value.new_zeros((value.shape[0], padded_len - seq_len, *value.shape[2:]))
            value = torch.cat([value, pad], dim=1)
        out[key] = value
    return out


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def fixed_size_parts(num_rows: int, micro_batch_size: int) -> list[list[int]]:
    """Row indices of consecutive micro-batches of ``micro_batch_size`` rows (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {micro_batch_size}")
    return [
        list(range(start, min(start + micro_batch_size, num_rows)))
        for start in range(0, num_rows, micro_batch_size)
    ]


def token_budget_parts(lengths: list[int], max_tokens: int, round_to: int) -> list[list[int]]:
    """Row indices of micro-batches holding at most ``max_tokens`` padded tokens each (dynamic batching).

    Rows are taken longest first, so each micro-batch holds rows of similar length; a micro-batch costs
    ``rows * round_up(longest row, round_to)`` tokens. A row longer than the budget gets a micro-batch alone.
    """
    parts: list[list[int]] = []
    current: list[int] = []
    current_len = 0
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        padded_len = round_up(max(lengths[row], 1), round_to)
        if current and (len(current) + 1) * max(current_len, padded_len) > max_tokens:
            parts.append(current)
            current, current_len = [], 0
        current.append(row)
        current_len = max(current_len, padded_len)
    if current:
        parts.append(current)
    return parts


def packing_parts(lengths: list[int], max_tokens: int, in_order: bool) -> list[list[int]]:
    """Row indices of packs holding at most ``max_tokens`` tokens each (sequence packing).

    First-fit decreasing (rows longest first, each into the first pack with room: few packs), or with
    ``in_order`` the rows in order, a new pack when the next row does not fit. A row longer than the budget
    gets a pack alone.
    """
    packs: list[list[int]] = []
    room: list[int] = []
    order = list(range(len(lengths)))
    if not in_order:
        order.sort(key=lambda i: -lengths[i])
    for row in order:
        length = max(lengths[row], 1)
        candidates = range(len(packs))[-1:] if in_order else range(len(packs))
        target = next((j for j in candidates if room[j] >= length), None)
        if target is None:
            packs.append([])
            room.append(max_tokens)
            target = len(packs) - 1
        packs[target].append(row)
        room[target] -= length
    return packs


@dataclass(frozen=True)
class PackedRows:
    """Right-padded rows ``[B, T]`` laid end to end in one row ``[1, L]``, and the way back.

    ``position_ids_1L`` restart at 0 at every sequence (Hugging Face models then keep attention within each
    sequence); the pack is padded at its end to a multiple of the requested length, as a sequence of its own.
    """

    input_ids_1L: torch.Tensor
    position_ids_1L: torch.Tensor
    index_BT: torch.Tensor
    """Position in the pack of each row's token (0 where the row is padding)."""
    valid_BT: torch.Tensor
    """Whether the row has a token there."""

    @staticmethod
    def pack(input_ids_BT: torch.Tensor, lengths_B: torch.Tensor, multiple: int) -> PackedRows:
        """Pack ``input_ids_BT``'s first ``lengths_B[b]`` tokens of each row (at least one per row)."""
        num_rows, seq_len = input_ids_BT.shape
        lengths_B = lengths_B.to(input_ids_BT.device).clamp(1, seq_len)
        valid_BT = torch.arange(seq_len, device=input_ids_BT.device)[None, :] < lengths_B[:, None]
        starts_B = torch.cumsum(lengths_B, 0) - lengths_B
        total = int(lengths_B.sum())
        packed_len = round_up(total, multiple)
        index_BT = torch.where(valid_BT, starts_B[:, None] + torch.arange(seq_len, device=valid_BT.device), 0)
        input_ids_1L = input_ids_BT.new_zeros(1, packed_len)
        input_ids_1L[0, index_BT[valid_BT]] = input_ids_BT[valid_BT]
        position_ids_1L = torch.arange(packed_len, device=valid_BT.device)[None, :].clone()
        position_ids_1L[0, index_BT[valid_BT]] = torch.arange(seq_len, device=valid_BT.device).expand(
            num_rows, -1
        )[valid_BT]
        position_ids_1L[0, total:] -= total  # the end padding is a sequence of its own
        return PackedRows(input_ids_1L, position_ids_1L, index_BT, valid_BT)

    def unpack(self, values_1L: torch.Tensor) -> torch.Tensor:
        """``[1, L, ...]`` per-token values of the pack back to ``[B, T, ...]`` (zeros at the rows' padding)."""
        values_BT = values_1L[0][self.index_BT]
        mask = self.valid_BT.reshape(*self.valid_BT.shape, *([1] * (values_BT.ndim - 2)))
        return torch.where(mask, values_BT, torch.zeros((), dtype=values_BT.dtype, device=values_BT.device))


def fed_token_mask(index_BT: torch.Tensor, valid_BT: torch.Tensor, length: int) -> torch.Tensor:
    """``[1, L]``: which positions of a packed row (:class:`PackedRows`, ``SharedPrefixRows``) hold a real
    token, from where each row's tokens went (``index_BT`` where ``valid_BT``)."""
    mask_1L = torch.zeros(1, length, dtype=torch.bool, device=index_BT.device)
    mask_1L[0, index_BT[valid_BT]] = True
    return mask_1L


def split_parts(parts: list[list[int]], count: int) -> list[list[int]]:
    """Halve the largest micro-batches until there are ``count`` (ranks must run equally many passes)."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        largest = max(range(len(parts)), key=lambda j: len(parts[j]))
        rows = parts.pop(largest)
        if len(rows) < 2:
            raise ValueError(f"cannot split {sum(map(len, parts)) + 1} rows into {count} micro-batches")
        half = len(rows) // 2
        parts[largest:largest] = [rows[:half], rows[half:]]
    return parts


def trim_sequence_dim(batch: BatchedDataDict[Any], length: int) -> BatchedDataDict[Any]:
    """Cut every per-token tensor (``shape[1] == T``, as in :func:`pad_sequence_dim`) to ``length`` tokens."""
    seq_len = int(batch["input_ids"].shape[1])
    if length >= seq_len:
        return batch
    out: BatchedDataDict[Any] = BatchedDataDict()
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == seq_len:
            value = value[:, :length]
        out[key] = value
    return out
