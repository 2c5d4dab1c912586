"""Collective refit, for generation workers that do not share a node with the policy (non-colocated mode).

For each stream (one per pipeline stage of the policy), the stream's first policy rank and every generation
worker form a *dedicated* process group, built directly from the refit store (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` when every member has a GPU of its own). It never goes through ``torch.distributed.init_process_group``,
so the policy's default (training) group is untouched, and it is built once per transport and reused by
every refit. The stream's root broadcasts each bucket as a small header (length, then JSON) followed by the
flat payload; it packs the next bucket into a second buffer while the current payload is in flight, and
receivers load one bucket while the next arrives (double buffering). Receivers take the streams one after
the other. The other policy ranks only take part in gathering the weights.

Members announce their device through the store before the group is built. NCCL refuses two ranks on one
GPU ("Duplicate GPU detected"), which is what a colocated layout gives when its refit goes through this
transport (forced, or picked by ``auto`` when shared memory cannot serve every generation node): when two
members name the same GPU UUID the group is built on gloo instead (:func:`choose_group_backend`).
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, cast

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
    TransportSettings,
    WeightReceiver,
    WeightSender,
)
from nemo_rl.weight_sync.manifest import ManifestLike
from nemo_rl.weight_sync.store import StoreAddress, StoreServer, connect_store


@dataclass(frozen=True)
class GroupSpec:
    """The dedicated refit process group of one stream: rank 0 is the stream's root policy rank, rank ``1 + j``
    generation worker ``j``."""

    store: StoreAddress
    name: str
    world_size: int
    timeout_s: float
    stream: int = 0


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
        group_store.set(f"device/{rank}", local_device_key())
        keys = [group_store.get(f"device/{r}").decode() for r in range(spec.world_size)]
        self.backend = choose_group_backend(keys)
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


_CPU_DEVICE_KEY = "cpu"


def local_device_key() -> str:
    """What this process announces to its refit group: ``cuda:<GPU UUID>`` for the GPU it computes on,
    or ``cpu`` without CUDA."""
    if not cuda_available():
        return _CPU_DEVICE_KEY
    return f"cuda:{torch.cuda.get_device_properties(get_device()).uuid}"


def choose_group_backend(device_keys: Sequence[str]) -> Literal["nccl", "gloo"]:
    """The refit group's backend from its members' :func:`local_device_key` values, in rank order.

    NCCL only when every member has a GPU and no two members share one: one CPU-only member, or two ranks
    on the same GPU (NCCL fails with "Duplicate GPU detected"), put the whole group on gloo, which moves the
    payload through host memory.
    """
    if any(key == _CPU_DEVICE_KEY for key in device_keys):
        return "gloo"
    if len(set(device_keys)) < len(device_keys):
        return "gloo"
    return "nccl"


_groups: dict[tuple[str, int, int, int], RefitGroup] = {}


def connect_group(spec: GroupSpec, rank: int) -> RefitGroup:
    """This process's member of the refit group ``spec`` (created on first use, then reused).

    A process keeps one group per refit store, stream and rank (several ranks in one process are the threads
    of single-process tests; one rank may receive on different threads of a threaded actor, which take turns):
    when the driver moves to a new group (after a failed refit) the old one is dropped.
    """
    key = (spec.store.host, spec.store.port, rank, spec.stream)
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
    """One policy worker's side of a collective refit (each stream's root broadcasts, the others only gather)."""

    dtype: torch.dtype
    bucket_size_bytes: int
    group: GroupSpec
    """The refit group of this rank's stream."""
    is_root: bool
    """Whether this policy rank broadcasts its stream (the stream's first rank)."""

    def send(self, weights: NamedTensors) -> TransferStats:
        """Broadcast every bucket to the generation workers."""
        start_s = time.perf_counter()
        stream = self.group.stream
        if not self.is_root:
            return gather_without_sending(weights, start_s, stream)
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
            stream=stream,
        )
        num_buckets = num_tensors = wire_bytes = 0
        while True:
            try:
                item = next(buckets, None)
            except Exception as err:
                # The weights could not be produced: tell the receivers instead of leaving them waiting.
                settle(0)
                settle(1)
                group.broadcast_message(
                    StreamAbort(f"the root of stream {stream} failed to produce the weights: {err!r}")
                )
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
        group.broadcast_message(StreamEnd(num_buckets, wire_bytes, stream))
        return TransferStats(
            "sender", wire_bytes, num_buckets, num_tensors, time.perf_counter() - start_s, stream
        )


@dataclass(frozen=True)
class CollectiveReceiver:
    """One generation worker's side of a collective refit."""

    bucket_size_bytes: int
    groups: tuple[GroupSpec, ...]
    """The refit group of each stream, by stream."""
    index: int
    """This generation worker's index (its group rank is ``1 + index``)."""
    tensor_checksums: bool = False
    """Take the checksum of every tensor that arrives (the refit guard's)."""

    def receive(
        self, load_fn: LoadFn, manifest: ManifestLike, shard_fn: ShardFn | None = None
    ) -> TransferStats:
        """Receive, check and load every bucket the streams' roots broadcast."""
        return receive_stream(
            load_fn,
            manifest,
            shard_fn,
            self._streams,
            f"generation worker {self.index} (collective)",
            num_streams=len(self.groups),
            tensor_checksums=self.tensor_checksums,
        )

    def _streams(self, reader: BucketReader) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self.groups:
            yield from self._stream(reader, connect_group(spec, 1 + self.index))
            if reader.ended:  # an abort ends every stream
                return

    def _stream(self, reader: BucketReader, group: RefitGroup) -> Iterator[tuple[str, torch.Tensor]]:
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
    """Driver side of the collective transport: hosts the store the refit groups (one per stream) meet on.

    ``policy_streams[r]`` is the stream of policy worker ``r`` (default: one stream); each stream's root is
    its first rank.
    """

    kind: TransportKind = "collective"

    def __init__(
        self,
        settings: TransportSettings,
        *,
        num_policy_workers: int,
        num_generation_workers: int,
        policy_streams: Sequence[int] | None = None,
    ) -> None:
        if num_policy_workers < 1 or num_generation_workers < 1:
            raise ValueError("a refit needs at least one policy worker and one generation worker")
        streams = list(policy_streams) if policy_streams is not None else [0] * num_policy_workers
        if len(streams) != num_policy_workers or set(streams) != set(range(max(streams) + 1)):
            raise ValueError(
                f"policy_streams must give each of the {num_policy_workers} policy workers a stream, numbered "
                f"0..S-1 with none missing; got {streams}"
            )
        self._streams = streams
        self._roots = [streams.index(stream) for stream in range(max(streams) + 1)]
        self._num_policy_workers = num_policy_workers
        self._num_generation_workers = num_generation_workers
        self._settings = settings
        self._server = StoreServer(settings.store_host, settings.timeout_s)
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

    @property
    def num_streams(self) -> int:
        """Streams the weights arrive in (one refit group each)."""
        return len(self._roots)

    def _group(self, stream: int) -> GroupSpec:
        return GroupSpec(
            self._server.address,
            f"{self._uid}-{self._epoch}-s{stream}",
            1 + self._num_generation_workers,
            self._settings.timeout_s,
            stream,
        )

    def endpoints(self, refit_id: str) -> tuple[list[WeightSender], list[WeightReceiver]]:
        """One :class:`CollectiveSender` per policy worker and one :class:`CollectiveReceiver` per generation
        worker. The refit groups are the same for every refit until one fails."""
        del refit_id  # the groups carry one refit at a time; buckets are numbered per stream
        groups = tuple(self._group(stream) for stream in range(self.num_streams))
        senders: list[WeightSender] = [
            CollectiveSender(
                self._settings.dtype,
                self._settings.bucket_size_bytes,
                groups[stream],
                rank == self._roots[stream],
            )
            for rank, stream in enumerate(self._streams)
        ]
        receivers: list[WeightReceiver] = [
            # One receiver's checksums suffice: every receiver verified the same buckets.
            CollectiveReceiver(
                self._settings.bucket_size_bytes, groups, j, self._settings.tensor_checksums and j == 0
            )
            for j in range(self._num_generation_workers)
        ]
        return senders, receivers

    def abort(self, refit_id: str) -> None:
        """Members still blocked in the failed refit's groups give up at their timeout; the next refit builds
        fresh groups so they are not needed."""
        del refit_id
        self._epoch += 1

    def cleanup(self, refit_id: str) -> None:
        """Nothing outlives a collective refit but the process groups, which are reused."""
        del refit_id

    def shutdown(self) -> None:
        """Move to fresh groups so no endpoint can use the old ones."""
        self._epoch += 1
