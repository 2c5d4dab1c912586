"""The refit wire format: weights packed into fixed-size byte buckets, each with a small JSON header.

A bucket's payload is a flat ``uint8`` buffer holding several tensors, already cast to the generation dtype,
each starting at a 64-byte aligned offset (so any dtype can be viewed in place). Its header lists the
tensors (HF name, dtype, shape, offset, byte count) and a checksum of the payload. A tensor larger than a
bucket travels alone in a bucket of its own size. The stream ends with an ``end`` message carrying the number
of buckets and bytes sent, so a receiver notices a lost bucket even when its names are unknown to it. Headers
and end messages carry their stream's number (see :mod:`nemo_rl.weight_sync.interfaces`); buckets are
numbered per stream.

Both transports share this module: :func:`pack_buckets` on the sender, :class:`BucketReader` (driven by
:func:`receive_stream`) on the receiver.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from nemo_rl.weight_sync.checksums import Checksum, tensor_checksum
from nemo_rl.weight_sync.errors import RefitError, RefitIntegrityError
from nemo_rl.weight_sync.interfaces import LoadFn, NamedTensors, ShardFn, TransferStats
from nemo_rl.weight_sync.manifest import (
    ManifestCheck,
    ManifestLike,
    WeightManifest,
    dtype_from_name,
    dtype_name,
    format_names,
)

ALIGN_BYTES = 64
"""Every tensor in a payload starts at a multiple of this many bytes (a cache line; >= any dtype's size)."""

_CHECKSUM_BLOCK_WORDS = 512
_MASK64 = (1 << 64) - 1


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN_BYTES`."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def payload_checksum(payload: torch.Tensor) -> int:
    """A 64-bit checksum of a flat ``uint8`` buffer, on whatever device it lives.

    Position-weighted sums of 64-bit words over 4 KiB blocks (Fletcher-style): it catches flipped, zeroed,
    truncated and reordered blocks at memory speed (a CRC runs ~6x slower on CPU and needs the host). It is
    an integrity check against transport bugs, not a defence against tampering. Integer sums wrap, so the
    result is identical on every device and thread count.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError("payload_checksum expects a flat uint8 tensor")
    num_words = payload.numel() // 8
    if payload.data_ptr() % 8 != 0:
        payload = payload.clone()  # int64 views need 8-byte aligned storage
    words = payload[: num_words * 8].view(torch.int64)
    num_blocks = num_words // _CHECKSUM_BLOCK_WORDS
    block_sums = (
        words[: num_blocks * _CHECKSUM_BLOCK_WORDS].view(num_blocks, _CHECKSUM_BLOCK_WORDS).sum(dim=1)
    )
    positions = torch.arange(1, num_blocks + 1, dtype=torch.int64, device=payload.device)
    rest_words = words[num_blocks * _CHECKSUM_BLOCK_WORDS :]
    rest_bytes = payload[num_words * 8 :].to(torch.int64)
    rest_positions = torch.arange(1, rest_words.numel() + rest_bytes.numel() + 1, device=payload.device)
    sums = torch.stack(
        [
            block_sums.sum() + rest_words.sum() + rest_bytes.sum(),
            (block_sums * positions).sum(),
            (torch.cat([rest_words, rest_bytes]) * rest_positions).sum(),
        ]
    ).tolist()
    plain, weighted, tail = (s & _MASK64 for s in sums)
    return (plain ^ (weighted * 0x9E3779B97F4A7C15) ^ (tail * 0xC2B2AE3D27D4EB4F) ^ payload.numel()) & _MASK64


@dataclass(frozen=True)
class WireEntry:
    """One tensor inside a bucket payload."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketHeader:
    """Describes one bucket: its position in the stream, its payload size and checksum, its tensors."""

    index: int
    nbytes: int
    checksum: int
    entries: tuple[WireEntry, ...]
    stream: int = 0

    @property
    def names(self) -> list[str]:
        """HF names of the tensors in this bucket."""
        return [entry.name for entry in self.entries]


@dataclass(frozen=True)
class StreamEnd:
    """Closes a stream: how many buckets and payload bytes the sender sent."""

    num_buckets: int
    wire_bytes: int
    stream: int = 0


@dataclass(frozen=True)
class StreamAbort:
    """The sender failed mid-stream; receivers stop and report ``reason``."""

    reason: str


Message = BucketHeader | StreamEnd | StreamAbort


def encode_message(message: Message) -> bytes:
    """JSON bytes of a header, end or abort message (JSON, not pickle: it crosses process boundaries)."""
    if isinstance(message, BucketHeader):
        body: dict[str, object] = {
            "kind": "bucket",
            "stream": message.stream,
            "index": message.index,
            "nbytes": message.nbytes,
            "checksum": message.checksum,
            "entries": [
                [e.name, dtype_name(e.dtype), list(e.shape), e.offset, e.nbytes] for e in message.entries
            ],
        }
    elif isinstance(message, StreamEnd):
        body = {
            "kind": "end",
            "stream": message.stream,
            "num_buckets": message.num_buckets,
            "wire_bytes": message.wire_bytes,
        }
    else:
        body = {"kind": "abort", "reason": message.reason}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_message(data: bytes) -> Message:
    """Inverse of :func:`encode_message`; raises :class:`RefitError` on bytes that are not a message."""
    try:
        body = json.loads(data)
        kind = body["kind"]
        if kind == "bucket":
            entries = tuple(
                WireEntry(name, dtype_from_name(dtype), tuple(shape), offset, nbytes)
                for name, dtype, shape, offset, nbytes in body["entries"]
            )
            return BucketHeader(body["index"], body["nbytes"], body["checksum"], entries, body["stream"])
        if kind == "end":
            return StreamEnd(body["num_buckets"], body["wire_bytes"], body["stream"])
        if kind == "abort":
            return StreamAbort(body["reason"])
    except (ValueError, KeyError, TypeError) as err:
        raise RefitError(f"received a malformed refit header ({err}): {data[:200]!r}") from err
    raise RefitError(f"received a refit header of unknown kind {kind!r}")


def gather_full(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a possibly sharded one (a collective for DTensors: call it on every rank)."""
    # Only a process that imported torch.distributed.tensor can hold a DTensor; looking the module up instead
    # of importing it spares the generation workers, which import this module, seconds of start-up CPU.
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        return tensor.full_tensor()
    return tensor


def gather_without_sending(weights: NamedTensors, start_s: float, stream: int = 0) -> TransferStats:
    """What a policy rank that puts nothing on the wire does: take part in every gather, send nothing.

    Gathering a sharded parameter is a collective over the policy's own group, so every rank must walk the
    whole stream even when another rank sends. ``start_s`` is when the refit began (``time.perf_counter``).
    """
    num_tensors = 0
    for _, tensor in weights:
        gather_full(tensor)
        num_tensors += 1
    return TransferStats("sender", 0, 0, num_tensors, time.perf_counter() - start_s, stream)


AcquireBuffer = Callable[[int, int], torch.Tensor]
"""``acquire(bucket_index, nbytes)`` returns a flat uint8 buffer of at least ``nbytes`` that is free to
overwrite: the transport waits there until the bucket that last used it has been consumed."""

ReserveBytes = Callable[[int, int], None]
"""``reserve(bucket_index, end)``: the first ``end`` bytes of that bucket's buffer are about to be written (a
transport whose buffers are only backed as they fill reserves the memory here, and fails cleanly if it can't)."""


def pack_buckets(
    weights: NamedTensors,
    *,
    dtype: torch.dtype,
    bucket_size_bytes: int,
    acquire: AcquireBuffer,
    send_oversized_in_place: bool,
    wire_device: torch.device,
    stream: int = 0,
    reserve: ReserveBytes | None = None,
) -> Iterator[tuple[BucketHeader, torch.Tensor]]:
    """Pack a weight stream into buckets of at most ``bucket_size_bytes``, floating-point tensors cast to ``dtype``.

    Yields ``(header, payload)`` as soon as a bucket is full, so the caller can put it on the wire while the
    next one is packed into another buffer (double buffering). Each tensor is copied into the bucket as it
    arrives, so at most one gathered tensor is alive on top of the buckets. A tensor larger than a bucket is
    sent alone; with ``send_oversized_in_place`` its own memory, cast and moved to ``wire_device``, is the
    payload, so no bucket-sized copy is made. Headers carry ``stream``. ``reserve``, if given, is told how
    much of a bucket's buffer is about to be used before each tensor is copied into it.
    """
    if bucket_size_bytes < 1:
        raise ValueError(f"bucket_size_bytes must be positive, got {bucket_size_bytes}")
    capacity = align_up(bucket_size_bytes)
    bucket = _OpenBucket(stream)
    for name, tensor in weights:
        full = gather_full(tensor)
        # Only floating-point weights take the generation dtype; integer buffers keep theirs.
        wire_dtype = dtype if full.is_floating_point() else full.dtype
        nbytes = full.numel() * wire_dtype.itemsize
        if nbytes > capacity:
            if bucket.entries:
                yield bucket.finish_buffer()
            bucket.entries.append(WireEntry(name, wire_dtype, tuple(full.shape), 0, nbytes))
            if send_oversized_in_place:
                yield bucket.finish(_wire_bytes(full, wire_dtype, wire_device))
            else:
                buffer = acquire(bucket.index, align_up(nbytes))
                _copy_into(buffer, 0, full, wire_dtype)
                yield bucket.finish(buffer[: align_up(nbytes)])
            continue
        if bucket.used + nbytes > capacity:
            yield bucket.finish_buffer()
        if bucket.buffer is None:
            bucket.buffer = acquire(bucket.index, capacity)
        if reserve is not None:
            reserve(bucket.index, bucket.used + nbytes)
        bucket.add(name, full, wire_dtype, nbytes)
    if bucket.entries:
        yield bucket.finish_buffer()


class _OpenBucket:
    """The bucket :func:`pack_buckets` is filling: its index, buffer, entries and bytes used so far."""

    def __init__(self, stream: int):
        self.stream = stream
        self.index = 0
        self.buffer: torch.Tensor | None = None
        self.entries: list[WireEntry] = []
        self.used = 0

    def add(self, name: str, full: torch.Tensor, wire_dtype: torch.dtype, nbytes: int) -> None:
        """Copy ``full`` (cast to ``wire_dtype``) into the buffer after the bytes used, aligned for the next."""
        assert self.buffer is not None
        _copy_into(self.buffer, self.used, full, wire_dtype)
        self.entries.append(WireEntry(name, wire_dtype, tuple(full.shape), self.used, nbytes))
        self.used = align_up(self.used + nbytes)

    def finish(self, payload: torch.Tensor) -> tuple[BucketHeader, torch.Tensor]:
        """Close the bucket with ``payload`` as its bytes on the wire, and open the next (empty) one."""
        header = BucketHeader(
            self.index, payload.numel(), payload_checksum(payload), tuple(self.entries), self.stream
        )
        self.index, self.buffer, self.entries, self.used = self.index + 1, None, [], 0
        return header, payload

    def finish_buffer(self) -> tuple[BucketHeader, torch.Tensor]:
        """Close the bucket with the used part of its buffer as the payload."""
        assert self.buffer is not None
        return self.finish(self.buffer[: self.used])


def _copy_into(buffer: torch.Tensor, offset: int, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Copy ``tensor`` cast to ``dtype`` into ``buffer[offset:]``; casting first if that shrinks a transfer."""
    if tensor.device != buffer.device and tensor.dtype.itemsize > dtype.itemsize:
        tensor = tensor.to(dtype)  # cast on the source device: fewer bytes cross the bus
    nbytes = tensor.numel() * dtype.itemsize
    buffer[offset : offset + nbytes].view(dtype).view(tensor.shape).copy_(tensor)


def _wire_bytes(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``tensor`` cast to ``dtype`` on ``device`` as a flat, aligned uint8 view (no copy when it already is)."""
    cast = tensor.detach().to(device=device, dtype=dtype).contiguous()
    if cast.data_ptr() % ALIGN_BYTES != 0:
        cast = cast.clone()
    return cast.reshape(-1).view(torch.uint8)


class BucketReader:
    """Receiver-side checks of one refit stream, shared by every transport.

    The transport feeds it each message (:meth:`admit`, :meth:`unpack`, :meth:`end`), each stream's in order
    (streams may interleave). It verifies bucket order, payload size and checksum, and the manifest, which
    the union of the ``num_streams`` streams must cover. Once anything is wrong the reader is *poisoned*: it
    keeps accepting messages (so the transport drains the streams and no peer hangs) but hands out no more
    tensors, and :meth:`raise_if_failed` reports every problem at the end.
    """

    def __init__(
        self,
        manifest: WeightManifest,
        shard_fn: ShardFn | None,
        num_streams: int = 1,
        tensor_checksums: bool = False,
    ) -> None:
        self._check = ManifestCheck(manifest)
        self._shard_fn = shard_fn
        self.checksums: dict[str, Checksum] | None = {} if tensor_checksums else None
        """With ``tensor_checksums``: the checksum of every full tensor unpacked so far (the refit guard's)."""
        self._problems: list[str] = []
        self._next_index = [0] * num_streams
        self._buckets_of = [0] * num_streams
        self._open = set(range(num_streams))
        self.num_buckets = 0
        self.num_tensors = 0
        self.wire_bytes = 0
        self.ended = False

    @property
    def failed(self) -> bool:
        """Whether a problem has been found (later buckets are then drained, not loaded)."""
        return bool(self._problems)

    def fail(self, problem: str) -> None:
        """Record a problem found by the transport itself (e.g. a segment that cannot be read)."""
        self._problems.append(problem)

    def admit(self, header: BucketHeader, payload_nbytes: int) -> bool:
        """Check a bucket's header against the stream and the manifest before touching its payload.

        ``payload_nbytes`` is how many bytes actually arrived. Returns whether the payload should be loaded.
        """
        stream = header.stream
        if stream not in self._open:
            self._problems.append(f"bucket {header.index} of stream {stream}, which is not an open stream")
            return False
        if header.index != self._next_index[stream]:
            self._problems.append(
                f"bucket {header.index}{self._of(stream)} arrived when bucket {self._next_index[stream]} was "
                "expected (a bucket was lost or repeated)"
            )
        self._next_index[stream] = header.index + 1
        self._buckets_of[stream] += 1
        self.num_buckets += 1
        self.wire_bytes += payload_nbytes
        bad_layout = [
            e.name
            for e in header.entries
            if e.offset < 0
            or e.offset + e.nbytes > header.nbytes
            or e.nbytes != _numel(e.shape) * e.dtype.itemsize
        ]
        if payload_nbytes != header.nbytes:
            self._problems.append(
                f"bucket {header.index} is {payload_nbytes} bytes but its header says {header.nbytes} "
                f"(holding {format_names(header.names)})"
            )
        if bad_layout:
            self._problems.append(
                f"bucket {header.index} has an inconsistent layout for {format_names(bad_layout)}"
            )
        self._problems.extend(
            f"bucket {header.index}: {p}"
            for p in self._check.admit([(e.name, e.shape, e.dtype) for e in header.entries])
        )
        return not self._problems

    def unpack(self, header: BucketHeader, payload: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Verify the payload's checksum and return its tensors (views, after ``shard_fn``).

        Returns an empty list when the checksum fails (the problem is recorded) or the reader is poisoned.
        """
        if self.failed:
            return []
        if payload_checksum(payload) != header.checksum:
            self._problems.append(
                f"bucket {header.index} is corrupt (checksum mismatch); it holds {format_names(header.names)}"
            )
            return []
        tensors = []
        for entry in header.entries:
            view = payload[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            if self.checksums is not None:
                self.checksums[entry.name] = tensor_checksum(view)
            if self._shard_fn is not None:
                view = self._shard_fn(entry.name, view)
            tensors.append((entry.name, view))
        self.num_tensors += len(tensors)
        return tensors

    def end(self, message: StreamEnd | StreamAbort) -> None:
        """Record the end of a stream; after the last one (or an abort), check that every weight arrived."""
        if isinstance(message, StreamAbort):
            self.ended = True
            self._problems.append(f"the sender aborted the refit: {message.reason}")
            return
        stream = message.stream
        if stream not in self._open:
            self._problems.append(f"stream {stream} ended twice or was never expected")
            return
        self._open.discard(stream)
        if message.num_buckets != self._buckets_of[stream]:
            self._problems.append(
                f"the sender{self._of(stream)} sent {message.num_buckets} buckets but "
                f"{self._buckets_of[stream]} arrived"
            )
        if self._open:
            return
        self.ended = True
        missing = self._check.missing()
        if missing:
            self._problems.append(f"weights that never arrived: {format_names(missing)}")

    def _of(self, stream: int) -> str:
        """`` of stream S`` when the refit has several streams (messages of one-stream refits stay short)."""
        return f" of stream {stream}" if len(self._next_index) > 1 else ""

    def raise_if_failed(self, where: str) -> None:
        """Raise :class:`RefitIntegrityError` listing every problem found, if any."""
        if self._problems:
            raise RefitIntegrityError(f"refit into {where} failed: " + "; ".join(self._problems))


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def receive_stream(
    load_fn: LoadFn,
    manifest: ManifestLike,
    shard_fn: ShardFn | None,
    stream: Callable[[BucketReader], Iterator[tuple[str, torch.Tensor]]],
    where: str,
    num_streams: int = 1,
    tensor_checksums: bool = False,
) -> TransferStats:
    """A receiver's refit, whatever the transport: check and load what ``stream(reader)`` yields.

    ``stream`` takes the transport's messages of all ``num_streams`` streams off the wire, passes each
    through the :class:`BucketReader` and yields the tensors to load; ``where`` names this receiver in the
    error raised when anything failed. With ``tensor_checksums`` the stats carry the checksum of every tensor
    that arrived (the refit guard's).
    """
    start_s = time.perf_counter()
    reader = BucketReader(WeightManifest.coerce(manifest), shard_fn, num_streams, tensor_checksums)
    feed_loader(load_fn, stream(reader))
    reader.raise_if_failed(where)
    return TransferStats(
        "receiver",
        reader.wire_bytes,
        reader.num_buckets,
        reader.num_tensors,
        time.perf_counter() - start_s,
        checksums=reader.checksums,
    )


def feed_loader(load_fn: LoadFn, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Run ``load_fn`` on ``stream`` and make sure the whole stream was consumed.

    The stream drives the transport, so a loader that stops early would leave the sender waiting; draining
    it keeps the protocol in step and the error says what happened.
    """
    load_fn(stream)
    leftover = sum(1 for _ in stream)
    if leftover:
        raise RefitError(f"the weight loader stopped early: {leftover} tensors of the stream were not loaded")
