"""Hugging Face <-> Megatron-core weight layouts, tensor by tensor, for one tensor-parallel rank.

A :class:`WeightRule` ties one Megatron parameter to the Hugging Face tensors it is made of and says how
(:class:`Kind`). :func:`to_megatron` builds a rank's local shard from the full Hugging Face tensors;
:func:`to_hugging_face` rebuilds the full Hugging Face tensors from every rank's shard, in tensor-parallel
rank order. Both only reshape, slice and concatenate, so a round trip is bit-exact.

Megatron layouts (TP = tensor-parallel size, r = this rank):

- ``linear_qkv``: per query group g (= KV head), the rows of its ``G`` query heads, then its key head, then
  its value head: ``[q_g0, k_g0, v_g0, q_g1, ...]``; rank r holds groups ``[r * K/TP, (r+1) * K/TP)``.
- ``linear_fc1`` (SwiGLU): rank r holds ``[gate_r; up_r]``, the r-th row blocks of ``gate_proj`` and
  ``up_proj`` stacked (Megatron's GLU applies the activation to the first half).
- ``linear_proj`` / ``linear_fc2``: row-parallel, split along the input dim (biases are not split).
- LoRA adapters (:mod:`nemo_rl.models.megatron.lora`): a column-parallel layer's ``B`` split along its
  output dim, a row-parallel layer's ``A`` along its input dim, the other matrix replicated.
- ``word_embeddings`` / ``output_layer``: split along the vocabulary, padded with zero rows to a multiple
  of TP; the padding is cut off again on the way back.

Tensor legend: K = KV heads, G = query heads per KV head, D = head dim, H = hidden size.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class Kind(enum.Enum):
    """How a Megatron parameter is laid out relative to its Hugging Face tensors."""

    REPLICATED = "replicated"
    """The same full tensor on every rank (norms, row-parallel biases)."""

    ROW = "row"
    """One Hugging Face tensor split along dim 1 (the input dim of a row-parallel linear)."""

    COLUMN = "column"
    """One Hugging Face tensor split along dim 0 (a LoRA ``B`` of a column-parallel linear)."""

    VOCAB = "vocab"
    """One Hugging Face tensor padded to the padded vocabulary and split along dim 0."""

    QKV = "qkv"
    """q, k and v (weights or biases) fused per query group, then split by query group."""

    GATE_UP = "gate_up"
    """gate and up (weights or biases), each split along dim 0, the two slices stacked."""


@dataclass(frozen=True)
class WeightRule:
    """One Megatron parameter (name relative to the unwrapped ``GPTModel``) and its Hugging Face tensors."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind
    exported: bool = True
    """False for a copy that Hugging Face does not store (the last stage's copy of tied embeddings)."""
    expert: bool = False
    """A routed expert's weight, held by one expert-parallel rank only (every other weight is the same on all
    of them)."""


@dataclass(frozen=True)
class AttentionShape:
    """The attention sizes the fused QKV layout depends on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one KV head (G)."""
        return self.num_heads // self.num_kv_heads


def pad_vocab(vocab_size: int, tp_size: int) -> int:
    """The vocabulary size rounded up to a multiple of the tensor-parallel size (Megatron splits it evenly)."""
    return -(-vocab_size // tp_size) * tp_size


def to_megatron(
    rule: WeightRule,
    hf_tensors: Sequence[torch.Tensor],
    *,
    tp_rank: int,
    tp_size: int,
    attention: AttentionShape,
    padded_vocab: int,
) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of ``rule``'s Megatron parameter from its full Hugging Face tensors."""
    if len(hf_tensors) != len(rule.hf):
        raise ValueError(f"{rule.megatron} is made of {len(rule.hf)} tensors, got {len(hf_tensors)}")
    kind = rule.kind
    if kind is Kind.REPLICATED:
        return hf_tensors[0]
    if kind is Kind.ROW:
        return hf_tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if kind is Kind.COLUMN:
        return hf_tensors[0].chunk(tp_size, dim=0)[tp_rank]
    if kind is Kind.VOCAB:
        full = hf_tensors[0]
        if full.shape[0] < padded_vocab:
            pad = full.new_zeros((padded_vocab - full.shape[0], *full.shape[1:]))
            full = torch.cat([full, pad])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if kind is Kind.GATE_UP:
        gate, up = hf_tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    q, k, v = hf_tensors
    k_heads, d = attention.num_kv_heads, attention.head_dim
    rest = q.shape[1:]
    grouped = torch.cat(
        [
            q.reshape(k_heads, attention.heads_per_group * d, *rest),
            k.reshape(k_heads, d, *rest),
            v.reshape(k_heads, d, *rest),
        ],
        dim=1,
    )
    return grouped.chunk(tp_size, dim=0)[tp_rank].reshape(-1, *rest)


def to_hugging_face(
    rule: WeightRule,
    shards: Sequence[torch.Tensor],
    *,
    attention: AttentionShape,
    vocab_size: int,
) -> list[torch.Tensor]:
    """The full Hugging Face tensors of ``rule`` (in ``rule.hf`` order) from every rank's shard, in rank order."""
    kind = rule.kind
    if kind is Kind.REPLICATED:
        return [shards[0]]
    if kind is Kind.ROW:
        return [torch.cat(list(shards), dim=1)]
    if kind is Kind.COLUMN:
        return [torch.cat(list(shards), dim=0)]
    if kind is Kind.VOCAB:
        return [torch.cat(list(shards), dim=0)[:vocab_size]]
    if kind is Kind.GATE_UP:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    k_heads, d, g = attention.num_kv_heads, attention.head_dim, attention.heads_per_group
    rest = shards[0].shape[1:]
    grouped = torch.cat(list(shards)).reshape(k_heads, (g + 2) * d, *rest)
    q, k, v = grouped.split([g * d, d, d], dim=1)
    return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
