"""Collective refit, for generation workers that do not share a node with the policy (non-colocated mode).

Policy rank 0 and every generation worker form a *dedicated* process group, built directly from the refit
store (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` when every member has a GPU). It never goes through
``torch.distributed.init_process_group``, so the policy's default (training) group is untouched, and it is
built once per transport and reused by every refit. Policy rank 0 broadcasts each bucket as a small header
(length, then JSON) followed by the flat payload; it packs the next bucket into a second buffer while the
current payload is in flight, and receivers load one bucket while the next arrives (double buffering). The
other policy ranks only take part in gathering the weights.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.distributed as dist

from nemo_rl.distributed.device import cuda_available, get_device
from nemo_rl.weight_sync.buckets import (
    BucketHeader,
    BucketReader,
    Message,
    StreamAbort,
    StreamEnd,
    align_up,
    decode_message,
    encode_message,
    gather_without_sending,
    pack_buckets,
    receive_stream,
)
from nemo_rl.weight_sync.interfaces import (
    LoadFn,
    NamedTensors,
    ShardFn,
    TransferStats,
    TransportKind,
    WeightReceiver,
    WeightSender,
)
from nemo_rl.weight_sync.manifest import ManifestLike
from nemo_rl.weight_sync.store import StoreAddress, StoreServer, connect_store


@dataclass(frozen=True)
class GroupSpec:
    """The dedicated refit process group: rank 0 is policy rank 0, rank ``1 + j`` generation worker ``j``."""

    store: StoreAddress
    name: str
    world_size: int
    timeout_s: float


class _Broadcaster(Protocol):
    """The one process-group operation refit needs (the c10d stubs do not declare it on backends)."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...


class RefitGroup:
    """A member's handle on the refit process group, plus its two reusable bucket buffers."""

    def __init__(self, spec: GroupSpec, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        store = connect_store(spec.store, spec.timeout_s)
        store.set_timeout(datetime.timedelta(seconds=spec.timeout_s))
        group_store = dist.PrefixStore(f"refit_group/{spec.name}/", store)
        # NCCL only when every member has a GPU; one CPU-only member puts the whole group on gloo.
        group_store.set(f"backend/{rank}", "nccl" if cuda_available() else "gloo")
        backends = {group_store.get(f"backend/{r}").decode() for r in range(spec.world_size)}
        self.backend = "nccl" if backends == {"nccl"} else "gloo"
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        pg_store = dist.PrefixStore("pg/", group_store)
        self.pg: _Broadcaster
        if self.backend == "nccl":
            self.device = get_device()
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = cast(_Broadcaster, dist.ProcessGroupNCCL(pg_store, rank, spec.world_size, options))
        else:
            self.device = torch.device("cpu")
            self.pg = cast(_Broadcaster, dist.ProcessGroupGloo(pg_store, rank, spec.world_size, timeout))
        self._buffers: list[torch.Tensor | None] = [None, None]

    def buffer(self, slot: int, nbytes: int, capacity: int) -> torch.Tensor:
        """Reusable buffer ``slot`` (0 or 1) of ``capacity`` bytes, or a one-off one for a larger payload."""
        if nbytes > capacity:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        current = self._buffers[slot]
        if current is None or current.numel() != capacity:
            current = torch.empty(capacity, dtype=torch.uint8, device=self.device)
            self._buffers[slot] = current
        return current

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting ``tensor`` from rank 0."""
        return self.pg.broadcast(tensor, root=0)

    def broadcast_message(self, message: Message | None) -> Message:
        """Rank 0 passes its message, the others ``None``; everyone gets the message back."""
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        data = b""
        if message is not None:
            data = encode_message(message)
            length.fill_(len(data))
        self.broadcast(length).wait()
        if message is not None:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(payload).wait()
        return message if message is not None else decode_message(payload.cpu().numpy().tobytes())


_groups: dict[tuple[str, int, int], RefitGroup] = {}


def connect_group(spec: GroupSpec, rank: int) -> RefitGroup:
    """This process's member of the refit group ``spec`` (created on first use, then reused).

    A process keeps one group per refit store (per thread, for single-process tests): when the driver
    moves to a new group (after a failed refit) the old one is dropped.
    """
    key = (spec.store.host, spec.store.port, threading.get_ident())
    group = _groups.get(key)
    if group is None or group.spec != spec or group.rank != rank:
        _groups.pop(key, None)
        group = RefitGroup(spec, rank)
        _groups[key] = group
    return group


def close_refit_groups() -> None:
    """Drop this process's refit groups (worker shutdown)."""
    _groups.clear()


@dataclass(frozen=True)
class CollectiveSender:
    """One policy worker's side of a collective refit (rank 0 broadcasts, the others only gather)."""

    dtype: torch.dtype
    bucket_size_bytes: int
    group: GroupSpec
    is_root: bool
    """Whether this policy rank broadcasts (policy rank 0)."""

    def send(self, weights: NamedTensors) -> TransferStats:
        """Broadcast every bucket to the generation workers."""
        start_s = time.perf_counter()
        if not self.is_root:
            return gather_without_sending(weights, start_s)
        group = connect_group(self.group, 0)
        capacity = align_up(self.bucket_size_bytes)
        # (work, payload) per buffer slot: the payload must stay alive until its broadcast completes.
        in_flight: list[tuple[dist.Work, torch.Tensor] | None] = [None, None]

        def settle(slot: int) -> None:
            pending = in_flight[slot]
            if pending is not None:
                pending[0].wait()
                in_flight[slot] = None

        def acquire(index: int, nbytes: int) -> torch.Tensor:
            settle(index % 2)
            return group.buffer(index % 2, nbytes, capacity)

        buckets = pack_buckets(
            weights,
            dtype=self.dtype,
            bucket_size_bytes=self.bucket_size_bytes,
            acquire=acquire,
            send_oversized_in_place=True,
            wire_device=group.device,
        )
        num_buckets = num_tensors = wire_bytes = 0
        while True:
            try:
                item = next(buckets, None)
            except Exception as err:
                # The weights could not be produced: tell the receivers instead of leaving them waiting.
                settle(0)
                settle(1)
                group.broadcast_message(StreamAbort(f"policy rank 0 failed to produce the weights: {err!r}"))
                raise
            if item is None:
                break
            header, payload = item
            group.broadcast_message(header)
            settle(header.index % 2)
            in_flight[header.index % 2] = (group.broadcast(payload), payload)
            num_buckets += 1
            num_tensors += len(header.entries)
            wire_bytes += header.nbytes
        settle(0)
        settle(1)
        group.broadcast_message(StreamEnd(num_buckets, wire_bytes))
        return TransferStats("sender", wire_bytes, num_buckets, num_tensors, time.perf_counter() - start_s)


@dataclass(frozen=True)
class CollectiveReceiver:
    """One generation worker's side of a collective refit."""

    bucket_size_bytes: int
    group: GroupSpec
    index: int
    """This generation worker's index (its group rank is ``1 + index``)."""

    def receive(
        self, load_fn: LoadFn, manifest: ManifestLike, shard_fn: ShardFn | None = None
    ) -> TransferStats:
        """Receive, check and load every bucket policy rank 0 broadcasts."""
        return receive_stream(
            load_fn, manifest, shard_fn, self._stream, f"generation worker {self.index} (collective)"
        )

    def _stream(self, reader: BucketReader) -> Iterator[tuple[str, torch.Tensor]]:
        group = connect_group(self.group, 1 + self.index)
        capacity = align_up(self.bucket_size_bytes)
        loaded: tuple[BucketHeader, torch.Tensor] | None = None
        num_received = 0
        while True:
            message = group.broadcast_message(None)
            if not isinstance(message, BucketHeader):
                if loaded is not None:
                    yield from _load(reader, *loaded)
                reader.end(message)
                return
            # Every payload is received, even once the reader failed, so the broadcast stays in step.
            payload = group.buffer(num_received % 2, message.nbytes, capacity)[: message.nbytes]
            work = group.broadcast(payload)
            num_received += 1
            if loaded is not None:
                yield from _load(reader, *loaded)  # the loader works while the next payload arrives
            work.wait()
            loaded = (message, payload)


def _load(
    reader: BucketReader, header: BucketHeader, payload: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    if reader.admit(header, payload.numel()):
        yield from reader.unpack(header, payload)


class CollectiveTransport:
    """Driver side of the collective transport: hosts the store the refit group meets on."""

    kind: TransportKind = "collective"

    def __init__(
        self,
        *,
        num_policy_workers: int,
        num_generation_workers: int,
        dtype: torch.dtype,
        bucket_size_bytes: int,
        timeout_s: float,
        store_host: str,
    ) -> None:
        if num_policy_workers < 1 or num_generation_workers < 1:
            raise ValueError("a refit needs at least one policy worker and one generation worker")
        self._num_policy_workers = num_policy_workers
        self._num_generation_workers = num_generation_workers
        self._dtype = dtype
        self._bucket_size_bytes = bucket_size_bytes
        self._timeout_s = timeout_s
        self._server = StoreServer(store_host, timeout_s)
        self._uid = uuid.uuid4().hex[:10]
        self._epoch = 0

    @property
    def num_senders(self) -> int:
        """Policy workers taking part."""
        return self._num_policy_workers

    @property
    def num_receivers(self) -> int:
        """Generation workers receiving."""
        return self._num_generation_workers

    def _group(self) -> GroupSpec:
        return GroupSpec(
            self._server.address,
            f"{self._uid}-{self._epoch}",
            1 + self._num_generation_workers,
            self._timeout_s,
        )

    def endpoints(self, refit_id: str) -> tuple[list[WeightSender], list[WeightReceiver]]:
        """One :class:`CollectiveSender` per policy worker and one :class:`CollectiveReceiver` per generation
        worker. The refit group is the same for every refit until one fails."""
        del refit_id  # the group carries one refit at a time; buckets are numbered per stream
        group = self._group()
        senders: list[WeightSender] = [
            CollectiveSender(self._dtype, self._bucket_size_bytes, group, rank == 0)
            for rank in range(self._num_policy_workers)
        ]
        receivers: list[WeightReceiver] = [
            CollectiveReceiver(self._bucket_size_bytes, group, j) for j in range(self._num_generation_workers)
        ]
        return senders, receivers

    def abort(self, refit_id: str) -> None:
        """Members still blocked in the failed refit's group give up at its timeout; the next refit builds a
        fresh group so they are not needed."""
        del refit_id
        self._epoch += 1

    def cleanup(self, refit_id: str) -> None:
        """Nothing outlives a collective refit but the process group, which is reused."""
        del refit_id

    def shutdown(self) -> None:
        """Move to a fresh group so no endpoint can use the old one."""
        self._epoch += 1
