"""Order-free checksums of tensors, which survive the ways an engine stores the weights it was sent.

The refit guard (:mod:`nemo_rl.weight_sync.guard`) compares what arrived in a refit with what an engine holds
afterwards. An engine rarely holds the tensors it was sent one by one: vLLM fuses ``q_proj``, ``k_proj`` and
``v_proj`` into one ``qkv_proj`` parameter, stacks the experts of a MoE layer, pads the vocabulary with zero
rows, shards across tensor-parallel ranks and, on CPU, repacks expert weights into a kernel layout. A
checksum that is a *sum over elements* of a function of each element's bits is unchanged by all of these:
the checksum of a fused parameter is the sum of its parts', that of a tensor the sum of its shards', and
zero padding adds nothing. Each element's bit pattern is read as an integer ``x``; a :data:`Checksum` is
``(sum x, sum x*x)`` modulo 2**32. A corrupted, stale, zeroed or mis-cast value changes it (the squares
catch changes that cancel in the plain sum); moving values around inside one fused group does not: a
transposed or permuted tensor passes the checksum, and the guard's probe on the step's ``gen_kl_error``
is what catches such layout errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

Checksum = tuple[int, int]
"""``(sum of the elements' bit patterns, sum of their squares)``, each modulo 2**32 (see the module)."""

ZERO: Checksum = (0, 0)
"""The checksum of no elements (and of zeros)."""

_MASK = (1 << 32) - 1
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Elements squared at a time: the temporary stays in the caches. Sums wrap in the words' own width, which
# keeps them vectorised (widening each element first runs ~20x slower on CPU), and modular sums are exact
# in any order, so every device, thread count and partition of the elements gives the same result.
_CHUNK_ELEMENTS = 1 << 18


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Checksum:
    """The :data:`Checksum` of ``tensor``'s elements, on whatever device it lives.

    ``dtype`` (when given) is the dtype the tensor was sent in: a floating-point tensor held in another one
    (an engine keeping a router weight in float32) is cast to it first, so it sums as it was sent.
    """
    values = tensor.detach()
    if dtype is not None and values.is_floating_point() and values.dtype != dtype:
        values = values.to(dtype)
    if values.dtype == torch.bool:
        values = values.to(torch.uint8)
    flat = values.contiguous().reshape(-1)
    words = flat.view(_INT_VIEWS[flat.element_size()])
    # 32-bit words at least: 1- and 2-byte elements are widened chunk by chunk (their squares fit).
    accumulate = torch.int64 if words.dtype == torch.int64 else torch.int32
    sums = torch.zeros(2, dtype=accumulate, device=words.device)
    for chunk in words.split(_CHUNK_ELEMENTS):
        wide = chunk.to(accumulate)
        sums[0] += wide.sum(dtype=accumulate)
        sums[1] += (wide * wide).sum(dtype=accumulate)
    plain, squares = sums.tolist()
    return plain & _MASK, squares & _MASK


def add(a: Checksum, b: Checksum) -> Checksum:
    """The checksum of the union of two disjoint sets of elements."""
    return (a[0] + b[0]) & _MASK, (a[1] + b[1]) & _MASK


def total(checksums: Iterable[Checksum]) -> Checksum:
    """The checksum of the union of disjoint sets of elements."""
    result = ZERO
    for checksum in checksums:
        result = add(result, checksum)
    return result


def named_checksums(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> dict[str, Checksum]:
    """``{name: tensor_checksum(tensor, dtype)}``."""
    return {name: tensor_checksum(tensor, dtype) for name, tensor in named_tensors}


def combine_ranks(reports: Sequence[Mapping[str, Checksum]]) -> dict[str, Checksum]:
    """One engine's checksums from those of its tensor-parallel ranks (one report per rank).

    A parameter every rank reports with the same checksum is replicated (a norm, a bias applied after the
    all-reduce) and counts once; any other is a shard on each rank and the shards add up. (A sharded tensor
    whose shards all sum alike, say all zeros, counts once too; zeros sum to zero either way.)
    """
    if len(reports) == 1:
        return dict(reports[0])
    combined: dict[str, Checksum] = {}
    for name in {name for report in reports for name in report}:
        values = [report[name] for report in reports if name in report]
        combined[name] = values[0] if len(set(values)) == 1 and len(values) == len(reports) else total(values)
    return combined
