"""What a test session leaves behind: processes it started, ``/dev/shm`` segments and ``/tmp`` entries it made.

``tests/conftest.py`` gives the session a mark, the environment variable :data:`SESSION_ENV`, which every process
the session starts inherits (Ray's workers, scripts, daemons that detach with ``setsid``), and takes a
:class:`Snapshot` of ``/dev/shm`` and ``/tmp`` when the session starts. When it ends, :func:`find_leftovers`
lists the marked processes still running (after a grace period: Ray's processes take seconds to exit) and,
where :data:`CHECK_ENV` is ``all``, the ``/dev/shm`` and ``/tmp`` entries that appeared and are still there.

Processes are told apart exactly (the mark), so that check is always on. Files cannot be: on a machine where
other test sessions run at the same time, their segments and temporary files appear too. So the file check
runs where nothing else runs, in CI (``.ci/run`` sets ``NEMO_RL_LEFTOVER_CHECK=all``); ``off`` turns both off.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

SESSION_ENV = "NEMO_RL_TEST_SESSION"
"""Set by the session's main pytest process to a value of its own; every process it starts inherits it."""

CHECK_ENV = "NEMO_RL_LEFTOVER_CHECK"
"""``processes`` (the default), ``all`` (processes, ``/dev/shm`` and ``/tmp``; what CI runs) or ``off``."""

SHM_DIR = Path("/dev/shm")
TMP_DIR = Path("/tmp")

KEPT_IN_TMP = ("pytest-of-*", "ray_nemo_rl_*", "torchinductor_*", "uv-*.lock")
"""Temporary directories kept on purpose between sessions, each reused by the next: pytest's base temp
directory (its last three sessions), the Ray session folder of ``default_ray_temp_dir``, torch's compile cache
and uv's lock files."""

LEFT_BY_KILLED_PROCESSES = ("tmp*wandb-media", "tmp*wandb-artifacts", "pymp-*")
"""Folders that libraries make in a process when imported (wandb's media and artifact folders) or started
(multiprocessing's ``pymp-*``) and that only the process's exit handlers remove: the kill-and-resume tests end
drivers and workers with SIGKILL on purpose, and a killed process cannot remove them. Not counted as leftovers;
the processes themselves still are."""

PROCESS_GRACE_S = 30.0
"""How long the session's processes get to exit after the last test (Ray's shutdown ends them in seconds)."""


@dataclass(frozen=True)
class Snapshot:
    """The names in ``/dev/shm`` and ``/tmp`` at one moment."""

    shm: frozenset[str]
    tmp: frozenset[str]

    @classmethod
    def take(cls) -> Snapshot:
        return cls(_names(SHM_DIR), _names(TMP_DIR))


def _names(folder: Path) -> frozenset[str]:
    return frozenset(os.listdir(folder)) if folder.is_dir() else frozenset()


def marked_processes(session: str) -> list[psutil.Process]:
    """Running processes (zombies aside) whose environment carries ``session``, this one excluded."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):
            if process.environ().get(SESSION_ENV) == session and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def _describe(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"pid {process.pid}: {' '.join(process.cmdline())[:160] or process.name()}"
    return f"pid {process.pid} (exited)"


def find_leftovers(session: str, before: Snapshot, check: str) -> list[str]:
    """What the session left (see the module docstring); the processes among them are killed after listing."""
    if check == "off":
        return []
    deadline = time.monotonic() + PROCESS_GRACE_S
    while (processes := marked_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.5)
    problems = [f"process still running, {_describe(process)}" for process in processes]
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    if check == "all":
        after = Snapshot.take()
        problems += [
            f"/dev/shm/{name} appeared and is still there" for name in sorted(after.shm - before.shm)
        ]
        problems += [
            f"/tmp/{name} appeared and is still there"
            for name in sorted(after.tmp - before.tmp)
            if not any(fnmatch.fnmatch(name, kept) for kept in (*KEPT_IN_TMP, *LEFT_BY_KILLED_PROCESSES))
        ]
    return problems


def main(argv: list[str]) -> int:
    """``python tests/leftovers.py MARK``: after a run started with ``NEMO_RL_TEST_SESSION=MARK`` in its
    environment (``.ci/run``'s main job), name and kill its processes still running; exit 1 if there were any."""
    if len(argv) != 1:
        print("usage: python tests/leftovers.py MARK", file=sys.stderr)
        return 2
    problems = find_leftovers(argv[0], Snapshot.take(), "processes")
    for problem in problems:
        print(f"left behind: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
