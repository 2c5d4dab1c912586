"""Shared-memory segments of the refit (:mod:`nemo_rl.weight_sync.shm`): creating, mapping and reserving
them, keeping them between refits in each process, and sweeping them away.

Names: every segment name starts with :data:`SEGMENT_NAME_PREFIX`, then a prefix unique to its transport
(:func:`transport_prefix`), and names the writer's process id, so a sweep can remove one transport's segments
(:func:`sweep_segments`) or those whose writer process is gone (:func:`sweep_dead_segments`).

Size: a segment may be a sparse file whose memory :meth:`Segment.reserve` backs (``posix_fallocate``) range
by range just before a copy into it, so a ``/dev/shm`` too small fails with a :class:`RefitError` naming it,
not with a SIGBUS in the middle of a copy.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from nemo_rl.weight_sync.errors import RefitError

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
"""Where segments live: the RAM-backed ``/dev/shm`` on Linux, the temp directory elsewhere."""

SEGMENT_NAME_PREFIX = "nemo_rl_refit_"


def transport_prefix(transport_uid: str) -> str:
    """The name prefix of every segment of one transport."""
    return f"{SEGMENT_NAME_PREFIX}{transport_uid}_"


# Per process: each writer's bucket segments, kept between refits, by (transport prefix, writer index); and
# each reader's mappings of them, by (transport prefix, reader index), then segment name. Entries of another
# transport are dropped when a refit of a new one starts in the process.
_V = TypeVar("_V")
_WRITER_SLOTS: dict[tuple[str, int], list[Segment | None]] = {}
_READER_MAPPINGS: dict[tuple[str, int], dict[str, Segment]] = {}
_CACHE_LOCK = threading.Lock()  # endpoints may share a process (threads in tests)


def writer_slots(prefix: str, writer: int) -> list[Segment | None]:
    """The two bucket segments writer ``writer`` of the transport with segment ``prefix`` keeps in this
    process between refits (``None`` until created); fill them in place."""
    return _entry(_WRITER_SLOTS, (prefix, writer), lambda: [None, None])


def reader_mappings(prefix: str, reader: int) -> dict[str, Segment]:
    """Reader ``reader``'s mappings of the transport's segments in this process, by segment name, kept
    between refits; add and drop entries in place."""
    return _entry(_READER_MAPPINGS, (prefix, reader), dict)


def _entry(cache: dict[tuple[str, int], _V], key: tuple[str, int], new: Callable[[], _V]) -> _V:
    """``cache[key]`` (created with ``new()`` if missing), after dropping the entries of other transports
    (a process refits with one transport at a time; a new one means the old one is done)."""
    with _CACHE_LOCK:
        for other in [k for k in cache if k[0] != key[0]]:
            _release(cache.pop(other))
        if key not in cache:
            cache[key] = new()
        return cache[key]


def _release(entry: object) -> None:
    """Unlink a writer's kept segments (a reader's mappings just go)."""
    if isinstance(entry, list):
        for segment in entry:
            if isinstance(segment, Segment):
                segment.unlink()


_WRITER_PID = re.compile(r"_p(\d+)_")


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def sweep_dead_segments() -> list[str]:
    """Unlink this node's refit segments that belong to this user and whose writer process is gone (left by
    a run that was killed); returns the names removed. Segments of live processes and of other users stay."""
    removed = []
    for path in SHM_DIR.glob(f"{SEGMENT_NAME_PREFIX}*"):
        match = _WRITER_PID.search(path.name)
        try:
            owned = path.stat().st_uid == os.getuid()
        except FileNotFoundError:
            continue
        if match is not None and owned and not _process_exists(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def sweep_segments(prefix: str) -> list[str]:
    """Unlink every segment on this node whose name starts with ``prefix``; returns the names removed."""
    if not prefix.startswith(SEGMENT_NAME_PREFIX):
        raise ValueError(
            f"refusing to sweep {prefix!r}: refit segment prefixes start with {SEGMENT_NAME_PREFIX!r}"
        )
    removed = []
    for path in SHM_DIR.glob(f"{prefix}*"):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


class Segment:
    """A named shared-memory segment mapped into this process as a flat uint8 tensor.

    The mapping lives as long as :attr:`tensor` or any view of it, even after the file is unlinked, so a
    loader that keeps a view never reads unmapped memory.
    """

    def __init__(self, path: Path, tensor: torch.Tensor, reserved: int) -> None:
        self.path = path
        self.tensor = tensor
        self.reserved = reserved
        """Bytes from the start known to be backed by memory."""

    @property
    def name(self) -> str:
        """The segment's file name."""
        return self.path.name

    @property
    def nbytes(self) -> int:
        """Size of the segment."""
        return self.tensor.numel()

    @classmethod
    def create(cls, name: str, nbytes: int, *, reserve: bool = True) -> Segment:
        """Create a new segment of ``nbytes`` (fails if the name exists: names are unique per refit).

        With ``reserve`` its memory is reserved at once; without, the file stays sparse and :meth:`reserve`
        backs it range by range as it fills.
        """
        path = SHM_DIR / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            segment = cls(
                path, torch.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), dtype=torch.uint8), 0
            )
            if reserve:
                segment.reserve(nbytes)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return segment

    def reserve(self, end: int) -> None:
        """Back the segment's first ``end`` bytes with memory now: a write into a sparse file on a full tmpfs
        would SIGBUS, a reservation fails with an error that says what to do."""
        if end <= self.reserved:
            return
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, self.reserved, end - self.reserved)
        except OSError as err:
            free = shutil.disk_usage(SHM_DIR).free
            raise RefitError(
                f"{SHM_DIR} cannot hold {end / 2**20:.1f} MiB of a refit segment ({free / 2**20:.1f} MiB free, "
                f"{err.strerror}): give the container more shared memory (docker run --shm-size, a larger "
                "/dev/shm emptyDir on Kubernetes), lower policy.refit.refit_buffer_size_mb, or use the "
                "collective transport (policy.refit.transport=collective)"
            ) from None
        finally:
            os.close(fd)
        self.reserved = end

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment (raises ``FileNotFoundError`` when it is gone)."""
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR)
        try:
            nbytes = os.fstat(fd).st_size
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(path, torch.frombuffer(mapping, dtype=torch.uint8), 0)

    def unlink(self) -> None:
        """Remove the segment's name; memory is freed once every mapping is gone."""
        self.path.unlink(missing_ok=True)
