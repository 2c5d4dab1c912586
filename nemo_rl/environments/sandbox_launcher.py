"""The first process of a sandbox run: applies the limits to itself, then ``exec``s the program.

It is not imported by nemo_rl: :mod:`nemo_rl.environments.sandbox` reads this file's source and runs it with
``python -I -S -c <source> <spec json> <program argv...>`` (inside bubblewrap when that is used), so it may
import only the standard library. Limits set here are inherited by everything the program starts. The same
source, given ``{"kill_uid": uid}``, kills every process of that user id (the clean-up of the rlimits
backend, which has no PID namespace to end).

Spec keys: ``rlimits`` (resource name -> [soft, hard]), ``nproc`` (``RLIMIT_NPROC``, counted on top of the
user's current processes when ``nproc_relative``), ``unshare_net`` (enter a new network namespace; a failure
exits with status 125), ``uid`` (drop to this user and group id, no supplementary groups). Every run is
marked ``no_new_privs`` before the program starts.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_NO_NEW_PRIVS = 38
SETUP_FAILED_EXIT_CODE = 125


def _count_user_processes(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass  # the process ended while we counted
    return count


def _unshare_net() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    # Root can make a network namespace outright; another user needs a user namespace around it.
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")


def _no_new_privs() -> None:
    # A setuid program the run starts (su, mount) then gains neither a uid nor capabilities.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


def _kill_uid(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    # kill(-1) as this user signals every process of this user but the caller; repeat while a fork bomb's
    # last forks are still landing.
    for _ in range(100):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return


def main() -> None:
    spec = json.loads(sys.argv[1])
    if "kill_uid" in spec:
        _kill_uid(spec["kill_uid"])
        return
    argv = sys.argv[2:]
    try:
        if spec["unshare_net"]:
            _unshare_net()
        for name, (soft, hard) in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        uid = spec["uid"]
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        nproc = spec["nproc"]
        if spec["nproc_relative"]:
            nproc += _count_user_processes(os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        _no_new_privs()
    except (OSError, ValueError) as err:  # setrlimit raises ValueError for a limit it may not raise
        sys.stderr.write(f"sandbox setup failed: {err}\n")
        sys.exit(SETUP_FAILED_EXIT_CODE)
    os.execv(argv[0], argv)


if __name__ == "__main__":  # run as ``python -c <source>``
    main()
