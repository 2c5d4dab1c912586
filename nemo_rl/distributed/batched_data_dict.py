"""A dict of batched values (tensors with dim 0 = batch, or per-sample lists) moved between the driver and workers.

Every value holds one entry per sample: a tensor whose dim 0 is the batch, or a list whose length is the batch.
The helpers here keep the keys aligned while the batch is concatenated, sharded over data-parallel ranks,
split into micro-batches and put back in order.

Sharding with length balancing (``balance_by_length_key``) permutes the samples; the same arguments given to
:meth:`BatchedDataDict.shard_indices` return the permutation, and :meth:`BatchedDataDict.from_shards` puts
per-shard results back in the original order::

    indices = data.shard_indices(dp, batch_size=gbs, balance_by_length_key="input_lengths")
    shards = [data.select_indices(idx) for idx in indices]  # == data.shard_by_batch_size(dp, gbs, ...)
    results = [run(shard) for shard in shards]
    merged = BatchedDataDict.from_shards(results, indices)  # rows back in the order of `data`

Importing this module makes the process send torch tensors through Ray as numpy arrays
(:mod:`nemo_rl.distributed.serialization`).
"""

from __future__ import annotations

import copy as copy_module
import heapq
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch

from nemo_rl.distributed.serialization import register_tensor_serializer

# Every process that sends or receives these batches (the driver, policy and generation workers, environments)
# imports this module, so each of them sends its torch tensors through Ray as numpy arrays.
register_tensor_serializer()

V = TypeVar("V")


def _batch_len(key: str, value: Any) -> int:
    """Number of samples held by one value; raises for values that are not batched."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            raise TypeError(
                f"BatchedDataDict key {key!r} holds a 0-dim tensor; values need a batch dim 0 "
                "(use value.reshape(1) or store per-sample values)"
            )
        return int(value.shape[0])
    if isinstance(value, list):
        return len(value)
    raise TypeError(
        f"BatchedDataDict key {key!r} holds a {type(value).__name__}; values must be torch tensors "
        "(dim 0 = batch) or lists (one entry per sample)"
    )


def _take(value: Any, indices: Sequence[int]) -> Any:
    """Rows ``indices`` of one value, in that order."""
    if isinstance(value, torch.Tensor):
        return value[torch.as_tensor(list(indices), dtype=torch.long, device=value.device)]
    return [value[i] for i in indices]


def _pad_dim1(tensor: torch.Tensor, length: int, pad_value: float) -> torch.Tensor:
    """Right-pad ``tensor`` along dim 1 to ``length`` with ``pad_value``."""
    if tensor.shape[1] == length:
        return tensor
    padded = tensor.new_full((tensor.shape[0], length, *tensor.shape[2:]), pad_value)
    padded[:, : tensor.shape[1]] = tensor
    return padded


def _balanced_parts(indices: Sequence[int], lengths: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """Split ``indices`` into parts of sizes ``counts`` with similar total ``lengths``.

    Longest first, each sample goes to the part with the fewest tokens that still has room (a capacity-bounded
    greedy deal, which balances at least as well as a round-robin deal of the sorted samples). Each part keeps
    its samples in their original relative order.
    """
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    parts: list[list[int]] = [[] for _ in counts]
    # Open parts keyed by (tokens so far, samples so far, part index); a full part leaves the heap.
    open_parts = [(0, 0, p) for p, count in enumerate(counts) if count > 0]
    heapq.heapify(open_parts)
    for i in order:
        tokens, taken, p = heapq.heappop(open_parts)
        parts[p].append(i)
        if taken + 1 < counts[p]:
            heapq.heappush(open_parts, (tokens + lengths[i], taken + 1, p))
    return [sorted(part) for part in parts]


def _shard_positions(
    total: int,
    shards: int,
    batch_size: int | None,
    allow_uneven_shards: bool,
    lengths: Sequence[int] | None,
    unit: str,
) -> list[list[int]]:
    """Positions ``0..total-1`` dealt to ``shards`` shards (see :meth:`BatchedDataDict.shard_by_batch_size`)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if batch_size is None:
        groups = [(0, total)]
    else:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if total % batch_size != 0 and not allow_uneven_shards:
            raise ValueError(
                f"cannot split {total} {unit} into global batches of {batch_size}: pass a multiple of "
                f"{batch_size} {unit} or allow_uneven_shards=True"
            )
        groups = [(start, min(start + batch_size, total)) for start in range(0, total, batch_size)]
    result: list[list[int]] = [[] for _ in range(shards)]
    for start, end in groups:
        count = end - start
        if count % shards != 0 and not allow_uneven_shards:
            what = "the batch" if batch_size is None else f"each global batch of {batch_size}"
            raise ValueError(
                f"cannot split {what} ({count} {unit}) into {shards} equal shards: make it a multiple "
                f"of {shards} or pass allow_uneven_shards=True"
            )
        # As torch.tensor_split: the first `count % shards` shards take one extra sample.
        counts = [count // shards + (1 if s < count % shards else 0) for s in range(shards)]
        if lengths is None:
            offset = start
            for s, n in enumerate(counts):
                result[s].extend(range(offset, offset + n))
                offset += n
        else:
            for s, part in enumerate(_balanced_parts(range(start, end), lengths, counts)):
                result[s].extend(part)
    return result


class BatchedDataDict(dict[str, V], Generic[V]):
    """A ``dict`` whose values are batched: tensors (dim 0 = batch) or lists (one entry per sample).

    Methods that return a new dict never copy tensor storage unless indexing requires it; list entries are
    shared, except in :meth:`repeat_interleave`, which deep-copies them so repeats can be mutated separately.
    """

    @property
    def size(self) -> int:
        """Number of samples (0 for an empty dict); raises if the values disagree on it."""
        sizes = {key: _batch_len(key, value) for key, value in self.items()}
        distinct = set(sizes.values())
        if len(distinct) > 1:
            raise ValueError(f"BatchedDataDict values have different batch sizes: {sizes}")
        return distinct.pop() if distinct else 0

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, float] | None = None,
    ) -> BatchedDataDict[Any]:
        """Concatenate ``batches`` along the batch dim.

        Tensors with 2+ dims are right-padded along dim 1 to the longest one first, with
        ``pad_value_dict[key]`` (0 for keys not in it). Lists are concatenated. Every batch needs the same keys.
        """
        if not batches:
            raise ValueError("from_batches needs at least one batch")
        keys = list(batches[0].keys())
        for number, batch in enumerate(batches[1:], start=1):
            if set(batch.keys()) != set(keys):
                raise ValueError(
                    f"from_batches: batch {number} has keys {sorted(batch.keys())} but batch 0 has "
                    f"{sorted(keys)}; every batch needs the same keys"
                )
        pad_values = dict(pad_value_dict or {})
        merged: BatchedDataDict[Any] = cls()
        for key in keys:
            values = [batch[key] for batch in batches]
            for value in values:
                _batch_len(key, value)
            if all(isinstance(v, torch.Tensor) for v in values):
                ndims = {v.ndim for v in values}
                if len(ndims) > 1:
                    raise ValueError(
                        f"from_batches: key {key!r} has tensors of different ranks {sorted(ndims)}"
                    )
                if ndims.pop() >= 2:
                    length = max(v.shape[1] for v in values)
                    values = [_pad_dim1(v, length, pad_values.get(key, 0)) for v in values]
                merged[key] = torch.cat(values, dim=0)
            elif all(isinstance(v, list) for v in values):
                merged[key] = [item for v in values for item in v]
            else:
                kinds = sorted({type(v).__name__ for v in values})
                raise TypeError(f"from_batches: key {key!r} mixes value types {kinds} across batches")
        return merged

    @classmethod
    def from_shards(
        cls,
        shards: Sequence[Mapping[str, Any]],
        shard_indices: Sequence[Sequence[int]],
        pad_value_dict: Mapping[str, float] | None = None,
    ) -> BatchedDataDict[Any]:
        """Concatenate per-shard results and put their rows back in the order before sharding.

        ``shard_indices`` is what :meth:`shard_indices` returned for the sharding that produced ``shards``.
        """
        if len(shards) != len(shard_indices):
            raise ValueError(f"from_shards: got {len(shards)} shards but {len(shard_indices)} index lists")
        for number, (shard, indices) in enumerate(zip(shards, shard_indices, strict=True)):
            shard_size = BatchedDataDict(shard).size
            if shard_size != len(indices):
                raise ValueError(
                    f"from_shards: shard {number} holds {shard_size} rows but its index list has {len(indices)}"
                )
        merged = cls.from_batches([shard for shard in shards if shard], pad_value_dict)
        merged.reorder_data([i for indices in shard_indices for i in indices])
        return merged

    def shard_indices(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        balance_by_length_key: str | None = None,
        group_size: int = 1,
    ) -> list[list[int]]:
        """The sample indices each shard of :meth:`shard_by_batch_size` holds, in the order it holds them."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        total = self.size
        for what, count in (("the batch", total), ("batch_size", batch_size or 0)):
            if count % group_size != 0:
                raise ValueError(
                    f"{what} ({count}) is not a multiple of group_size={group_size}: groups of consecutive "
                    "samples (e.g. preference pairs) must stay whole"
                )
        lengths = self._lengths(balance_by_length_key) if balance_by_length_key is not None else None
        group_lengths = (
            None
            if lengths is None
            else [sum(lengths[g * group_size : (g + 1) * group_size]) for g in range(total // group_size)]
        )
        group_shards = _shard_positions(
            total // group_size,
            shards,
            None if batch_size is None else batch_size // group_size,
            allow_uneven_shards,
            group_lengths,
            unit="samples" if group_size == 1 else f"groups of {group_size} samples",
        )
        return [
            [g * group_size + offset for g in shard for offset in range(group_size)] for shard in group_shards
        ]

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        balance_by_length_key: str | None = None,
        group_size: int = 1,
    ) -> list[BatchedDataDict[V]]:
        """Split the batch into ``shards`` parts, e.g. one per data-parallel rank.

        Without ``batch_size`` the batch is split into contiguous parts. With it, the batch is first cut into
        global batches of ``batch_size`` samples and each global batch is split; shard ``i`` holds its part of
        every global batch, in order, so a rank iterating its shard in steps of ``batch_size // shards`` sees
        one global batch per step.

        ``balance_by_length_key`` (a [B] tensor or list of ints, e.g. ``"input_lengths"``) deals the samples of
        each global batch so that shards get similar token counts; the shards then hold permuted samples, and
        :meth:`shard_indices` (same arguments) with :meth:`from_shards` restores the order.

        ``group_size`` deals consecutive groups of that many samples as one unit (kept together and in order,
        balanced by their summed lengths), e.g. 2 for (chosen, rejected) preference pairs; every count above
        is then in groups.

        Raises ``ValueError`` when a split is uneven and ``allow_uneven_shards`` is false; when it is true, the
        first shards take one extra sample (shards may be empty).
        """
        indices = self.shard_indices(
            shards, batch_size, allow_uneven_shards, balance_by_length_key, group_size=group_size
        )
        return [self.select_indices(shard) for shard in indices]

    def chunk(self, rank: int, chunks: int) -> BatchedDataDict[V]:
        """Contiguous part ``rank`` of ``chunks`` near-equal parts (the first ``size % chunks`` take one more)."""
        if chunks < 1 or not 0 <= rank < chunks:
            raise ValueError(
                f"chunk needs chunks >= 1 and 0 <= rank < chunks, got rank={rank} chunks={chunks}"
            )
        total = self.size
        base, extra = divmod(total, chunks)
        start = rank * base + min(rank, extra)
        return self.slice(start, start + base + (1 if rank < extra else 0))

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[BatchedDataDict[V]]:
        """Consecutive slices of ``microbatch_size`` samples (the last one may be smaller)."""
        if microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
        total = self.size
        for start in range(0, total, microbatch_size):
            yield self.slice(start, min(start + microbatch_size, total))

    def slice(self, start: int, end: int) -> BatchedDataDict[V]:
        """Samples ``start`` (inclusive) to ``end`` (exclusive); indices must lie within the batch."""
        total = self.size
        if not 0 <= start <= end <= total:
            raise IndexError(f"slice({start}, {end}) is outside a batch of {total} samples")
        return BatchedDataDict({key: value[start:end] for key, value in self.items()})  # type: ignore[index]

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict[V]:
        """The samples at ``indices``, in that order (repeats allowed)."""
        index_list = indices.tolist() if isinstance(indices, torch.Tensor) else [int(i) for i in indices]
        total = self.size
        bad = [i for i in index_list if not 0 <= i < total]
        if bad:
            raise IndexError(f"select_indices: indices {bad[:8]} are outside a batch of {total} samples")
        return BatchedDataDict({key: _take(value, index_list) for key, value in self.items()})

    def repeat_interleave(self, num_repeats: int) -> BatchedDataDict[V]:
        """Every sample repeated ``num_repeats`` times in a row (``[a, b] -> [a, a, b, b]``).

        List entries are deep-copied, so each repeat (e.g. a message log) can be extended on its own.
        """
        if num_repeats < 1:
            raise ValueError(f"num_repeats must be >= 1, got {num_repeats}")
        repeated: BatchedDataDict[Any] = BatchedDataDict()
        for key, value in self.items():
            _batch_len(key, value)
            if isinstance(value, torch.Tensor):
                repeated[key] = value.repeat_interleave(num_repeats, dim=0)
            else:
                repeated[key] = [_copy_sample(item) for item in value for _ in range(num_repeats)]  # type: ignore[attr-defined]
        return repeated

    def to(self, device: torch.device | str) -> BatchedDataDict[V]:
        """Move every tensor value to ``device`` (in place; lists are left as they are) and return ``self``."""
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device)  # type: ignore[assignment]
        return self

    def get_batch(self, batch_idx: int, batch_size: int) -> BatchedDataDict[V]:
        """Samples ``[batch_idx * batch_size, (batch_idx + 1) * batch_size)``; the last batch may be partial."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        total = self.size
        start = batch_idx * batch_size
        if batch_idx < 0 or start >= total:
            raise IndexError(f"get_batch({batch_idx}, {batch_size}) is outside a batch of {total} samples")
        return self.slice(start, min(start + batch_size, total))

    def reorder_data(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Move sample ``i`` to position ``indices[i]``, in place.

        With the concatenated index lists of :meth:`shard_indices`, this undoes a sharding permutation.
        """
        index_list = indices.tolist() if isinstance(indices, torch.Tensor) else [int(i) for i in indices]
        total = self.size
        if sorted(index_list) != list(range(total)):
            raise ValueError(
                f"reorder_data needs a permutation of range({total}); got {len(index_list)} indices "
                f"{index_list[:8]}{'...' if len(index_list) > 8 else ''}"
            )
        source = [0] * total
        for current, target in enumerate(index_list):
            source[target] = current
        for key, value in list(self.items()):
            self[key] = _take(value, source)

    def copy(self) -> BatchedDataDict[V]:
        """A shallow copy: a new dict holding the same value objects."""
        return BatchedDataDict(self)

    def _lengths(self, key: str) -> list[int]:
        """Per-sample lengths stored under ``key`` as a list of ints."""
        if key not in self:
            raise KeyError(
                f"balance_by_length_key {key!r} is not in the batch; keys are {sorted(self.keys())}"
            )
        value: Any = self[key]
        if isinstance(value, torch.Tensor):
            if value.ndim != 1:
                raise ValueError(f"length key {key!r} must be a [B] tensor, got shape {tuple(value.shape)}")
            return [int(x) for x in value.tolist()]
        if isinstance(value, list):
            return [int(x) for x in value]
        raise TypeError(
            f"length key {key!r} must be a [B] tensor or a list of ints, got {type(value).__name__}"
        )


def _copy_sample(item: Any) -> Any:
    """A deep copy of one sample's entry (a message log: lists of dicts of strings and tensors), built
    directly for those types: ``copy.deepcopy`` of each small tensor costs several times a ``clone``."""
    if isinstance(item, torch.Tensor):
        return item.clone()
    if type(item) is dict:
        return {key: _copy_sample(value) for key, value in item.items()}
    if type(item) is list:
        return [_copy_sample(value) for value in item]
    if isinstance(item, str | int | float | bool | None):
        return item
    return copy_module.deepcopy(item)
