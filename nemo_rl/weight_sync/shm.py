"""Shared-memory refit, for generation workers on the same node as a policy worker (colocated mode).

On each node, for each stream, one policy rank, the *writer*, packs buckets into two shared-memory segments
(files under ``/dev/shm``) in turn and announces each bucket (segment name + header) on the refit store's
queue of every generation worker of its node (a pipeline-parallel policy has one writer per stage and node;
the receivers take the streams interleaved). A receiver maps the segment, checks the bucket, hands the tensors to its loader
(which copies them out) and acknowledges; the writer reuses a segment once every reader has acknowledged the
bucket it held. So the writer packs bucket ``i + 1`` while the readers load bucket ``i`` (double buffering).
The other policy ranks only take part in gathering the weights.

Reuse: a writer creates its two segments at its first refit and keeps them, with the readers' mappings of
them, for every later refit of the same transport (:func:`~.shm_segments.writer_slots`,
:func:`~.shm_segments.reader_mappings`): a refit neither reserves nor pre-faults memory again. A tensor
larger than a bucket gets a segment of its own for one refit. A segment's name ends with a random tag, so a
segment created anew (after a sweep) never reuses a name a reader may still have mapped.

Cleanup: every segment name starts with a prefix unique to the transport
(:func:`~.shm_segments.transport_prefix`) and names the writer's process id. A writer whose refit fails
unlinks its segments; when a worker dies the driver sweeps the transport's segments on every node
(:meth:`SharedMemoryTransport.cleanup`; surviving writers create new ones at their next refit), and
:meth:`SharedMemoryTransport.shutdown` sweeps them too. What a killed run left behind (its driver and workers
gone) is swept when the next transport starts: segments of this user whose writer process no longer exists
(:func:`~.shm_segments.sweep_dead_segments`).

Size: a writer holds at most two bucket segments for the transport's life (only one when the weights fit in
one bucket), plus one per tensor larger than a bucket while it is read. A bucket segment is a sparse file of
``policy.refit.refit_buffer_size_mb``: memory backs only the bytes the writer has written, and each range is
reserved (``posix_fallocate``) just before the writer copies into it, so a model of a few MB takes a few MB of
``/dev/shm`` whatever the bucket size, and a ``/dev/shm`` too small fails with a :class:`RefitError` naming
it, not with a SIGBUS in the middle of a copy. Mappings are not pre-faulted (that would back the whole
file); their pages fault in once, at the first refit, and stay mapped for the later ones.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_rl.weight_sync.buckets import (
    BucketHeader,
    BucketReader,
    StreamAbort,
    StreamEnd,
    align_up,
    decode_message,
    encode_message,
    gather_without_sending,
    pack_buckets,
    receive_stream,
)
from nemo_rl.weight_sync.errors import RefitError
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
from nemo_rl.weight_sync.manifest import ManifestLike, format_names
from nemo_rl.weight_sync.shm_segments import (
    Segment,
    reader_mappings,
    sweep_dead_segments,
    sweep_segments,
    transport_prefix,
    writer_slots,
)
from nemo_rl.weight_sync.store import StoreAddress, StoreServer, connect_store, pop_message

_REFIT_ID_PATTERN = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_ABORT = b"abort"


def _reader_queue(refit_id: str, reader: int) -> str:
    return f"{refit_id}/shm/to_reader/{reader}"


def _writer_queue(refit_id: str, writer: int) -> str:
    return f"{refit_id}/shm/to_writer/{writer}"


@dataclass(frozen=True)
class ShmSender:
    """One policy worker's side of a shared-memory refit (a writer, or a helper that only gathers)."""

    dtype: torch.dtype
    bucket_size_bytes: int
    timeout_s: float
    store: StoreAddress
    refit_id: str
    segment_prefix: str
    """The transport's segment name prefix (:func:`transport_prefix`)."""
    writer: int | None
    """Index of the (node, stream) writer this rank is, or ``None`` when another rank writes its stream on
    its node."""
    readers: tuple[int, ...]
    """Generation workers (by index) reading this writer's segments."""
    stream: int = 0
    """The stream this rank's weights belong to."""

    def send(self, weights: NamedTensors) -> TransferStats:
        """Pack and announce every bucket; return once every reader has acknowledged every bucket."""
        start_s = time.perf_counter()
        if self.writer is None:
            # Another rank writes this stream on this node; this one still takes part in every gather.
            return gather_without_sending(weights, start_s, self.stream)
        return _ShmWriter(self, self.writer).run(weights, start_s)


class _ShmWriter:
    """The state of one writer during one refit."""

    def __init__(self, spec: ShmSender, writer: int) -> None:
        self.spec = spec
        self.writer = writer
        self.store = connect_store(spec.store, spec.timeout_s)
        self.deadline = time.monotonic() + spec.timeout_s
        self.capacity = align_up(spec.bucket_size_bytes)
        self.slots = writer_slots(spec.segment_prefix, writer)
        self.bucket_in_slot: list[int | None] = [None, None]
        self.segment_of: dict[int, Segment] = {}
        self.acks: Counter[int] = Counter()

    def run(self, weights: NamedTensors, start_s: float) -> TransferStats:
        num_buckets = num_tensors = wire_bytes = 0
        try:
            for header, _payload in pack_buckets(
                weights,
                dtype=self.spec.dtype,
                bucket_size_bytes=self.spec.bucket_size_bytes,
                acquire=self._acquire,
                send_oversized_in_place=False,
                wire_device=torch.device("cpu"),
                stream=self.spec.stream,
                reserve=lambda index, end: self.segment_of[index].reserve(end),
            ):
                self._announce(self.segment_of[header.index].name, encode_message(header))
                num_buckets += 1
                num_tensors += len(header.entries)
                wire_bytes += header.nbytes
            self._announce("", encode_message(StreamEnd(num_buckets, wire_bytes, self.spec.stream)))
            for index in self.bucket_in_slot:
                if index is not None:
                    self._wait_consumed(index)
        except BaseException as err:
            self._announce(
                "",
                encode_message(StreamAbort(f"the policy worker writer {self.writer} failed: {err!r}")),
            )
            # Readers may have stopped mid-bucket: start the next refit with new segments.
            for segment in self.slots:
                if segment is not None:
                    segment.unlink()
            self.slots[:] = [None, None]
            raise
        finally:
            # Tensors larger than a bucket had segments of their own; the two bucket segments stay.
            for segment in self.segment_of.values():
                if segment not in self.slots:
                    segment.unlink()
        return TransferStats(
            "sender", wire_bytes, num_buckets, num_tensors, time.perf_counter() - start_s, self.spec.stream
        )

    def _announce(self, segment_name: str, message: bytes) -> None:
        for reader in self.spec.readers:
            self.store.queue_push(
                _reader_queue(self.spec.refit_id, reader), segment_name.encode() + b"\n" + message
            )

    def _acquire(self, index: int, nbytes: int) -> torch.Tensor:
        slot = index % 2
        previous = self.bucket_in_slot[slot]
        if previous is not None:
            self._wait_consumed(previous)
        self.bucket_in_slot[slot] = index
        # The writer's pid in every name lets a later run tell leftovers of a killed one (sweep_dead_segments);
        # the random tag makes every created segment's name new.
        name = f"{self.spec.segment_prefix}w{self.writer}_p{os.getpid()}_{uuid.uuid4().hex[:8]}_"
        kept = self.slots[slot]
        if nbytes > self.capacity:
            # A tensor larger than a bucket gets a segment of its own, unlinked once it has been read.
            segment = Segment.create(f"{name}b{index}", nbytes)
        elif kept is not None and kept.path.exists():
            segment = kept  # from an earlier refit (unless the driver swept it since, after a failed refit)
        else:
            segment = Segment.create(f"{name}slot{slot}", self.capacity, reserve=False)
            self.slots[slot] = segment
        self.segment_of[index] = segment
        return segment.tensor

    def _wait_consumed(self, index: int) -> None:
        """Block until every reader acknowledged bucket ``index``, then release its segment."""
        while self.acks[index] < len(self.spec.readers):
            message = pop_message(
                self.store,
                _writer_queue(self.spec.refit_id, self.writer),
                self.deadline,
                f"generation workers {list(self.spec.readers)} to read bucket {index}",
            )
            if message == _ABORT:
                raise RefitError(
                    f"refit {self.spec.refit_id} was aborted by the driver (another worker failed)"
                )
            self.acks[int(message.decode().rpartition(":")[2])] += 1
        segment = self.segment_of.pop(index)
        if segment not in self.slots:
            segment.unlink()


@dataclass(frozen=True)
class ShmReceiver:
    """One generation worker's side of a shared-memory refit."""

    timeout_s: float
    store: StoreAddress
    refit_id: str
    segment_prefix: str
    """The transport's segment name prefix (:func:`transport_prefix`)."""
    reader: int
    """This generation worker's index."""
    writers: tuple[int, ...]
    """Index of the writer of each stream on this worker's node (by stream)."""
    tensor_checksums: bool = False
    """Take the checksum of every tensor that arrives (the refit guard's)."""

    def receive(
        self, load_fn: LoadFn, manifest: ManifestLike, shard_fn: ShardFn | None = None
    ) -> TransferStats:
        """Read, check and load every bucket the node's writers announce."""
        return receive_stream(
            load_fn,
            manifest,
            shard_fn,
            self._stream,
            f"generation worker {self.reader} (shared memory, refit {self.refit_id})",
            num_streams=len(self.writers),
            tensor_checksums=self.tensor_checksums,
        )

    def _stream(self, reader: BucketReader) -> Iterator[tuple[str, torch.Tensor]]:
        store = connect_store(self.store, self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        # The writers' bucket segments, mapped at an earlier refit; those this refit does not name are dropped.
        kept = reader_mappings(self.segment_prefix, self.reader)
        attached = dict(kept)
        used: set[str] = set()
        while not reader.ended:
            raw = pop_message(
                store,
                _reader_queue(self.refit_id, self.reader),
                deadline,
                f"a bucket from the policy workers writing for this node ({reader.num_buckets} so far)",
            )
            segment_name, _, body = raw.partition(b"\n")
            message = decode_message(body)
            if not isinstance(message, BucketHeader):
                reader.end(message)
                continue
            if not 0 <= message.stream < len(self.writers):
                # Nobody to acknowledge to: a protocol error, reported when the streams end.
                reader.fail(f"bucket {message.index} belongs to unknown stream {message.stream}")
                continue
            name = segment_name.decode()
            segment = self._attach(name, message, attached, reader)
            available = min(segment.nbytes, message.nbytes) if segment is not None else 0
            if reader.admit(message, available) and segment is not None:
                yield from reader.unpack(message, segment.tensor[: message.nbytes])
            # Reached only once the loader asked for the next tensor, i.e. it is done with this bucket.
            if name.endswith(tuple(f"_slot{slot}" for slot in range(2))):
                used.add(name)
            else:
                attached.pop(name, None)
            store.queue_push(
                _writer_queue(self.refit_id, self.writers[message.stream]),
                f"{self.reader}:{message.index}".encode(),
            )
        kept.clear()
        kept.update({name: attached[name] for name in used if name in attached})

    def _attach(
        self, name: str, header: BucketHeader, attached: dict[str, Segment], reader: BucketReader
    ) -> Segment | None:
        if not name.startswith(self.segment_prefix) or "/" in name:
            reader.fail(f"bucket {header.index} names segment {name!r}, which is not one of this refit's")
            return None
        if name not in attached:
            try:
                attached[name] = Segment.attach(name)
            except FileNotFoundError:
                reader.fail(
                    f"the shared-memory segment {name!r} of bucket {header.index} is gone "
                    f"(it held {format_names(header.names)})"
                )
                return None
        return attached[name]


def _streams_of(policy_node_ids: Sequence[str], policy_streams: Sequence[int] | None) -> list[int]:
    """Each policy worker's stream (all 0 by default); checks that streams are numbered 0..S-1."""
    streams = list(policy_streams) if policy_streams is not None else [0] * len(policy_node_ids)
    if len(streams) != len(policy_node_ids) or set(streams) != set(range(max(streams, default=0) + 1)):
        raise ValueError(
            f"policy_streams must give each of the {len(policy_node_ids)} policy workers a stream, numbered "
            f"0..S-1 with none missing; got {streams}"
        )
    return streams


def _missing_writers(
    policy_node_ids: Sequence[str], generation_node_ids: Sequence[str], streams: Sequence[int]
) -> list[tuple[str, int]]:
    """(generation node, stream) pairs with no policy worker of that stream on that node."""
    held = {(node, stream) for node, stream in zip(policy_node_ids, streams, strict=True)}
    return [
        (node, stream)
        for node in dict.fromkeys(generation_node_ids)
        for stream in range(max(streams) + 1)
        if (node, stream) not in held
    ]


@ray.remote(num_cpus=0)
def _sweep_segments_task(prefix: str | None) -> list[str]:
    return sweep_segments(prefix) if prefix is not None else sweep_dead_segments()


class SharedMemoryTransport:
    """Driver side of the shared-memory transport: one writer per (node, stream), readers on the same node.

    ``policy_node_ids[r]`` / ``generation_node_ids[j]`` name the node of policy worker ``r`` / generation
    worker ``j`` (Ray node ids, or any labels in single-process use); ``policy_streams[r]`` is the stream of
    policy worker ``r`` (default: one stream). Every generation worker's node must host a policy worker of
    every stream (:meth:`supports`).
    """

    kind: TransportKind = "shared_memory"

    def __init__(
        self,
        settings: TransportSettings,
        *,
        policy_node_ids: Sequence[str],
        generation_node_ids: Sequence[str],
        policy_streams: Sequence[int] | None = None,
    ) -> None:
        if not policy_node_ids or not generation_node_ids:
            raise ValueError("a refit needs at least one policy worker and one generation worker")
        streams = _streams_of(policy_node_ids, policy_streams)
        missing = _missing_writers(policy_node_ids, generation_node_ids, streams)
        if missing:
            nodes = sorted({node for node, _ in missing})
            raise ValueError(
                f"shared-memory refit needs a policy worker of every stream (pipeline stage) on every generation "
                f"node, but nodes {nodes} lack streams {sorted({s for _, s in missing})}: use the collective "
                "transport (refit transport=collective)"
            )
        self._num_streams = max(streams) + 1
        # One writer per (generation node, stream): the lowest policy rank of that stream on that node.
        self._writers: list[tuple[str, int]] = []
        self._writer_rank: list[int] = []
        for node in dict.fromkeys(generation_node_ids):
            for stream in range(self._num_streams):
                rank = min(r for r, n in enumerate(policy_node_ids) if n == node and streams[r] == stream)
                self._writers.append((node, stream))
                self._writer_rank.append(rank)
        self._policy_node_ids = list(policy_node_ids)
        self._policy_streams = streams
        self._generation_node_ids = list(generation_node_ids)
        self._settings = settings
        self._server = StoreServer(settings.store_host, settings.timeout_s)
        self._uid = uuid.uuid4().hex[:10]
        self._sweep_everywhere(None)

    @staticmethod
    def supports(
        policy_node_ids: Sequence[str],
        generation_node_ids: Sequence[str],
        policy_streams: Sequence[int] | None,
    ) -> bool:
        """Whether every generation node hosts a policy worker of every stream."""
        streams = _streams_of(policy_node_ids, policy_streams)
        return not _missing_writers(policy_node_ids, generation_node_ids, streams)

    @property
    def num_senders(self) -> int:
        """Policy workers taking part."""
        return len(self._policy_node_ids)

    @property
    def num_receivers(self) -> int:
        """Generation workers receiving."""
        return len(self._generation_node_ids)

    @property
    def num_streams(self) -> int:
        """Streams the weights arrive in."""
        return self._num_streams

    def endpoints(self, refit_id: str) -> tuple[list[WeightSender], list[WeightReceiver]]:
        """One :class:`ShmSender` per policy worker and one :class:`ShmReceiver` per generation worker."""
        if not _REFIT_ID_PATTERN.match(refit_id):
            raise ValueError(f"refit id {refit_id!r} must be 1-64 letters, digits or dashes")
        prefix = transport_prefix(self._uid)
        senders: list[WeightSender] = []
        for rank, node in enumerate(self._policy_node_ids):
            stream = self._policy_streams[rank]
            writer = self._writer_rank.index(rank) if rank in self._writer_rank else None
            readers = tuple(j for j, n in enumerate(self._generation_node_ids) if n == node)
            senders.append(
                ShmSender(
                    self._settings.dtype,
                    self._settings.bucket_size_bytes,
                    self._settings.timeout_s,
                    self._server.address,
                    refit_id,
                    prefix,
                    writer,
                    readers if writer is not None else (),
                    stream,
                )
            )
        receivers: list[WeightReceiver] = [
            ShmReceiver(
                self._settings.timeout_s,
                self._server.address,
                refit_id,
                prefix,
                j,
                tuple(self._writers.index((node, stream)) for stream in range(self._num_streams)),
                # One receiver's checksums suffice: every receiver verified the same buckets.
                tensor_checksums=self._settings.tensor_checksums and j == 0,
            )
            for j, node in enumerate(self._generation_node_ids)
        ]
        return senders, receivers

    def abort(self, refit_id: str) -> None:
        """Wake every writer and reader of ``refit_id`` still waiting, so they stop and unlink."""
        store = self._server.store
        for writer in range(len(self._writers)):
            store.queue_push(_writer_queue(refit_id, writer), _ABORT)
        reason = encode_message(StreamAbort("the driver aborted the refit because another worker failed"))
        for reader in range(self.num_receivers):
            store.queue_push(_reader_queue(refit_id, reader), b"\n" + reason)

    def cleanup(self, refit_id: str) -> None:
        """After a failed refit: sweep the transport's segments on every node (a dead writer cannot unlink
        its own; the others create new ones at their next refit) and drop ``refit_id``'s queues."""
        self._sweep_everywhere(transport_prefix(self._uid))
        store = self._server.store
        for writer in range(len(self._writers)):
            store.delete_key(_writer_queue(refit_id, writer))
        for reader in range(self.num_receivers):
            store.delete_key(_reader_queue(refit_id, reader))

    def shutdown(self) -> None:
        """Sweep every segment this transport may have left on any node."""
        self._sweep_everywhere(transport_prefix(self._uid))

    def _sweep_everywhere(self, prefix: str | None) -> None:
        """Sweep ``prefix`` on every policy node (``None``: the segments of dead writers)."""
        if prefix is None:
            sweep_dead_segments()
        else:
            sweep_segments(prefix)
        if not ray.is_initialized():
            return
        here = ray.get_runtime_context().get_node_id()
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        remote = [n for n in dict.fromkeys(self._policy_node_ids) if n != here and n in alive]
        refs = [
            _sweep_segments_task.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(prefix)
            for node in remote
        ]
        ray.get(refs, timeout=self._settings.timeout_s)
