"""Resharding helpers: gather full tensors on the sender, keep a tensor-parallel slice on the receiver.

The wire always carries full tensors under their HF names, so a sender with any layout (FSDP2 shards, a TP
DTensor, Megatron TP/PP converted to HF) talks to a receiver with any layout. The sender gathers
(:func:`iter_full_tensors`, which the DTensor worker's ``iter_hf_weights`` does already); a tensor-parallel
receiver keeps its slice with a ``shard_fn`` such as :func:`tp_shard_fn`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from nemo_rl.weight_sync.buckets import gather_full
from nemo_rl.weight_sync.interfaces import NamedTensors, ShardFn


def iter_full_tensors(named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for each pair, gathering DTensors (a collective: every rank must iterate)."""
    for name, tensor in named_tensors:
        yield name, gather_full(tensor.detach())


def tp_shard_fn(tp_rank: int, tp_size: int, split_dim_of: Callable[[str], int | None]) -> ShardFn:
    """A ``shard_fn`` keeping rank ``tp_rank``'s equal slice of each tensor along ``split_dim_of(name)``.

    ``split_dim_of`` returns 0 for column-parallel weights (split output rows), 1 for row-parallel weights
    (split input columns) and ``None`` for replicated ones. The slice is a view; the loader copies it.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")

    def shard(name: str, full: torch.Tensor) -> torch.Tensor:
        dim = split_dim_of(name)
        if dim is None:
            return full
        if full.dim() <= dim or full.shape[dim] % tp_size != 0:
            raise ValueError(
                f"cannot split {name} of shape {list(full.shape)} along dim {dim} into {tp_size} equal "
                "tensor-parallel slices: choose a tensor-parallel size that divides it"
            )
        size = full.shape[dim] // tp_size
        return full.narrow(dim, tp_rank * size, size)

    return shard
