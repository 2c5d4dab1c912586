"""Stop what is left of a local Ray session once the driver that started it has ended, however it ended.

Why it is needed: a raylet starts two agents, ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` (with or
without the dashboard: ``include_dashboard=False`` only changes what they load). When the raylet ends without a
SIGTERM (its driver was SIGKILLed, and Ray's processes die with their driver through ``PR_SET_PDEATHSIG``; or
``ray.shutdown`` escalated to SIGKILL after its grace period on a busy machine), each agent notices within about
2 s, judges the end unexpected and reports it to the driver through the GCS, which is gone too. Ray gives that
report a fixed 60 s timeout (``ray._private.utils.publish_error_to_driver``), so the agents outlive the job by a
minute, holding their ports and memory. (Ray 2.60's raylet logs ``received SIGTERM`` where the agents look for
``Raylet received SIGTERM``, so even a graceful end counts as unexpected when the agents notice it first.)

The reaper is a small process started with a local Ray, in a session of its own so that neither the driver's
death nor a signal to its process group stops it. It holds the read end of a pipe whose write end only the
driver holds, and every :data:`POLL_S` it lists the session's processes: the Ray processes the driver started
(those whose command line names the Ray temp dir) and all their descendants, each remembered by pid and start
time. When the pipe closes (the driver has exited) or the listed roots are all gone (``ray.shutdown``), it gives
the processes :data:`GRACE_S` to end on their own and SIGKILLs the ones still running, then exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil

POLL_S = 2.0
"""Seconds between two listings of the session's processes (workers start and end during a run)."""

GRACE_S = 3.0
"""Seconds the session's processes get to end on their own before the reaper kills them."""

# The running reapers: holding them keeps their pipes' write ends open until this process exits.
_reapers: list[subprocess.Popen[bytes]] = []


def start_reaper(temp_dir: str) -> None:
    """Start a reaper for the local Ray this process started with ``_temp_dir=temp_dir`` (see the module); call
    it right after ``ray.init``."""
    roots: list[int] = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if temp_dir in " ".join(child.cmdline()):
                roots.append(child.pid)
    if not roots:
        return
    atexit.register(_stop_side_processes, [psutil.Process(pid) for pid in roots])
    for done in [reaper for reaper in _reapers if reaper.poll() is not None]:
        _reapers.remove(done)
        if done.stdin is not None:
            done.stdin.close()
    _reapers.append(spawn_reaper(roots))


# Ray's head processes that no driver call goes through: the autoscaler's monitor and the dashboard's API server.
_SIDE_PROCESS_SCRIPTS = ("/autoscaler/_private/monitor.py", "/dashboard/dashboard.py")


def _stop_side_processes(roots: Sequence[psutil.Process]) -> None:
    """Ask Ray's side processes among ``roots`` to end, all at once and without waiting: registered after Ray's
    exit hook, this runs before it. ``ray.shutdown`` stops its processes one after the other, waiting up to a
    second for each to exit (about 0.2-0.5 s each, more on a busy machine); the side processes then exit
    while it stops the raylet and the GCS, and it finds them gone. The raylet and the GCS are left to it (the
    driver is still connected to them), and so is the log monitor (it may still be forwarding workers' last
    lines)."""
    for process in roots:
        with contextlib.suppress(psutil.Error):
            if any(script in " ".join(process.cmdline()) for script in _SIDE_PROCESS_SCRIPTS):
                process.terminate()


def spawn_reaper(root_pids: Sequence[int]) -> subprocess.Popen[bytes]:
    """A reaper process watching ``root_pids`` and their descendants; it acts when this process (the only
    holder of its pipe's write end, which children do not inherit) exits or the roots are gone.

    The processes are listed here first and handed over, so that a driver killed before the reaper has
    started still has them reaped.
    """
    known: dict[int, float] = {}
    _list_session(root_pids, known)
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), json.dumps({"roots": list(root_pids), "known": known})],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: Ctrl-C or a kill of the driver's process group leaves it to clean up after them.
        start_new_session=True,
    )


def _list_session(roots: Sequence[int], known: dict[int, float]) -> bool:
    """Add the live roots and their descendants to ``known`` (pid -> start time); whether any root lives."""
    alive = False
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            if root.status() == psutil.STATUS_ZOMBIE:
                continue
            alive = True
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    known[process.pid] = process.create_time()
    return alive


def _still_running(known: dict[int, float]) -> list[psutil.Process]:
    """The processes of ``known`` still running (a reused pid has another start time and is left alone)."""
    running = []
    for pid, started in known.items():
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
    return running


def reap(roots: Sequence[int], known: dict[int, float], pipe_fd: int) -> None:
    """The reaper's loop (see the module): list the session into ``known`` until ``pipe_fd`` closes or the roots
    are gone, then kill what has not ended within :data:`GRACE_S`."""
    while _list_session(roots, known):
        readable, _, _ = select.select([pipe_fd], [], [], POLL_S)
        if readable and not os.read(pipe_fd, 4096):
            break
    deadline = time.monotonic() + GRACE_S
    while (running := _still_running(known)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in running:
        with contextlib.suppress(psutil.Error):
            process.kill()


if __name__ == "__main__":
    session = json.loads(sys.argv[1])
    reap(
        session["roots"], {int(pid): started for pid, started in session["known"].items()}, sys.stdin.fileno()
    )
