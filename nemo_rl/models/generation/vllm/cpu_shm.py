"""The shared-memory segments of vLLM's CPU tensor-parallel communicator: named per engine, removed at the end.

vLLM's CPU build runs a tensor-parallel engine's collectives through shared memory of its own: every rank of a
group creates ``/dev/shm/<ident>-<group>-[<ranks>]-cpushm_<rank>`` and maps the others'. ``<ident>`` comes from
``VLLM_DIST_IDENT``, which vLLM's CPU worker derives from its distributed init method; under the external
launcher nemo_rl's engines use (``env://``) it is the same on every engine, and ``shm_open`` drops it, so all
TP engines on a machine share the names ``-tp:0-[0-1]-cpushm_0`` and ``_1``. vLLM unlinks its segments only in
a static destructor that a killed Ray actor never runs: they outlive the engine, and every later engine fails
to create them ("create shm in SHMManager failed. errno: 17").

:func:`prepare_cpu_shm` (called by each rank before the engine starts) gives the engine its own ident,
``nemo_rl_vllm_<pid of rank 0>``, and removes the segments of engines whose rank-0 process is gone (and of
a dead one that had the same pid);
:meth:`CpuShmSegments.remove` (at the worker's shutdown) removes the engine's own. Segments named by a vLLM
without this (the shared names above) are left alone: nothing tells whether their engine still runs.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

SHM_DIR = Path("/dev/shm")
"""Where ``shm_open`` puts its segments on Linux (vLLM's CPU build is Linux only)."""

IDENT_PREFIX = "nemo_rl_vllm_"
"""Start of every engine ident; the rest is the process id of the engine's rank 0."""

_SEGMENT = re.compile(rf"^{IDENT_PREFIX}(\d+)-.*-cpushm_\d+$")


@dataclass(frozen=True)
class CpuShmSegments:
    """The segments of one CPU tensor-parallel engine: every ``/dev/shm`` entry named after ``ident``."""

    ident: str

    def paths(self) -> list[Path]:
        """The engine's segments that exist now."""
        return sorted(SHM_DIR.glob(f"{self.ident}-*-cpushm_*"))

    def remove(self) -> None:
        """Unlink the engine's segments (each rank may call it: a missing one is fine). Ranks that still map
        a segment keep their mapping; only its name goes."""
        for path in self.paths():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def remove_stale_segments() -> list[Path]:
    """Unlink the segments of engines whose rank-0 process no longer exists; returns what was removed."""
    removed = []
    for path in SHM_DIR.glob(f"{IDENT_PREFIX}*-cpushm_*"):
        match = _SEGMENT.match(path.name)
        if match and not psutil.pid_exists(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


def name_segments_after(ident: str) -> None:
    """Make vLLM's CPU shared-memory communicator of this process name its segments after ``ident`` (vLLM
    reads ``VLLM_DIST_IDENT`` when it names a group, after its worker has set it from the init method)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    original: Any = _CPUSHMDistributed.make_group_name
    vllm_naming = getattr(original, "nemo_rl_vllm_naming", original)

    def make_group_name(communicator: Any) -> str:
        os.environ["VLLM_DIST_IDENT"] = ident
        return str(vllm_naming(communicator))

    make_group_name.nemo_rl_vllm_naming = vllm_naming  # type: ignore[attr-defined]
    setattr(_CPUSHMDistributed, "make_group_name", staticmethod(make_group_name))  # noqa: B010


def prepare_cpu_shm() -> CpuShmSegments:
    """Before a CPU tensor-parallel engine starts, on every rank of its (initialised) torch.distributed world:
    agree on the engine's ident (rank 0's process id), remove stale segments and name this engine's."""
    if torch.distributed.get_rank() == 0:
        # Before the broadcast releases the other ranks, so none of this engine's segments exists yet: the
        # segments of dead engines, and any named after this pid (a dead process that had it before).
        remove_stale_segments()
        CpuShmSegments(f"{IDENT_PREFIX}{os.getpid()}").remove()
    rank0_pid = [os.getpid()]
    torch.distributed.broadcast_object_list(rank0_pid, src=0)
    segments = CpuShmSegments(f"{IDENT_PREFIX}{rank0_pid[0]}")
    name_segments_after(segments.ident)
    return segments
