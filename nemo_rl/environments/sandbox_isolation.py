"""Which isolation a sandbox run gets on this machine, and the bubblewrap command line that gives it.

Untrusted code runs only under an isolation that contains it (bubblewrap), unless the config asks for the weak
resource-limit mode on purpose (``isolation: rlimits``). :func:`detect_isolation` finds what works by running
a probe once per process, and refuses with one line that says what to do when nothing that contains a run
works here. docs/security.md says what each isolation promises.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nemo_rl.config.errors import UserError

logger = logging.getLogger(__name__)

BWRAP_ENV_VAR = "NEMO_RL_SANDBOX_BWRAP"
"""Environment variable naming the bubblewrap binary to use instead of ``bwrap`` on the ``PATH``; ``none`` makes
the sandbox act as if bubblewrap were not installed (how the tests check that path on a machine that has it)."""

SANDBOX_DIR = "/sandbox"
"""Where a bubblewrap run sees its directory (and its working directory)."""

Network = Literal["namespace", "socket_refusal"]
"""How runs are kept off the network (see :attr:`Isolation.network`)."""
_FALLBACK_NETWORKS: tuple[Network, ...] = ("namespace", "socket_refusal")


@dataclass(frozen=True)
class Isolation:
    """What a sandbox run is isolated by on this machine (see :func:`detect_isolation`)."""

    backend: Literal["bubblewrap", "rlimits"]
    """``bubblewrap``: namespaces and a private read-only filesystem view; ``rlimits``: limits and a session."""

    network: Network
    """A network namespace of its own, or only Python's ``socket`` module refusing to open sockets."""

    run_uid: bool
    """Each run has a user id of its own (the parent is root): ``RLIMIT_NPROC`` counts only its processes,
    it can write only to its directory, and at the end every process of that id is killed."""

    @property
    def contains(self) -> bool:
        """Whether runs are contained (docs/security.md lists the classes): only bubblewrap's are."""
        return self.backend == "bubblewrap"

    def describe(self) -> str:
        """One line for logs and results."""
        fs = "private read-only view" if self.backend == "bubblewrap" else "host filesystem readable"
        uid = (
            "own uid"
            if self.run_uid
            else "user namespace"
            if self.backend == "bubblewrap"
            else "caller's uid"
        )
        return f"{self.backend} (network: {self.network}; filesystem: {fs}; {uid})"


def bwrap_path() -> str | None:
    """The bubblewrap binary: :data:`BWRAP_ENV_VAR` when set (``none``: absent), else ``bwrap`` on the ``PATH``."""
    override = os.environ.get(BWRAP_ENV_VAR)
    if override is None:
        return shutil.which("bwrap")
    if override.lower() == "none" or not os.access(override, os.X_OK):
        return None
    return override


def _readonly_binds(python_executable: str) -> list[str]:
    """bubblewrap arguments that show the system libraries and the interpreter's files, read-only."""
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    exe = Path(python_executable)
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots |= {str(exe.parent.parent), str(exe.resolve().parent.parent)}
    paths = sorted(
        path
        for path in {*roots, *(os.path.realpath(r) for r in roots)}
        if not path.startswith("/usr/") and os.path.isdir(path)
    )
    # bubblewrap would create the folders above a bind mount private (0700), which the run's own uid could
    # not cross; they are created open to all, and hold nothing but the way down.
    parents = sorted({str(p) for path in paths for p in Path(path).parents if str(p) != "/"})
    for parent in parents:
        args += ["--perms", "0755", "--dir", parent]
    for path in paths:
        args += ["--ro-bind", path, path]
    return args


def run_env(run_dir: str) -> dict[str, str]:
    """The whole environment of a run: nothing of the caller's."""
    return {"PATH": "/usr/bin:/bin", "HOME": run_dir, "TMPDIR": run_dir, "LANG": "C.UTF-8"}


def bwrap_argv(bwrap: str, run_dir: str, python_executable: str, as_root: bool) -> list[str]:
    """The bubblewrap command line up to its program."""
    argv = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net"]
    argv += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if as_root:
        # No user namespace: the launcher inside drops to the run's own uid, which needs these two
        # capabilities once (bubblewrap drops every other); the uid change then clears them.
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user"]
    argv += _readonly_binds(python_executable)
    argv += ["--proc", "/proc", "--dev", "/dev", "--bind", run_dir, SANDBOX_DIR]
    argv += ["--remount-ro", "/", "--chdir", SANDBOX_DIR, "--clearenv"]
    for key, value in run_env(SANDBOX_DIR).items():
        argv += ["--setenv", key, value]
    return [*argv, "--"]


Probe = Callable[[Isolation, str], bool]
"""Whether a run under an isolation starts the interpreter (the sandbox's own probe)."""


def detect_isolation(
    requested: Literal["auto", "bubblewrap", "rlimits"], python_executable: str, probe: Probe
) -> Isolation:
    """The isolation runs get here: ``auto`` and ``bubblewrap`` get bubblewrap or a :class:`UserError`;
    ``rlimits`` (the weak mode, on purpose only) gets the strongest variant of it this machine allows.

    Found by running ``probe`` once per process, per request, interpreter and bubblewrap binary.
    """
    return _detect(requested, python_executable, bwrap_path(), probe)


@functools.cache
def _detect(
    requested: Literal["auto", "bubblewrap", "rlimits"],
    python_executable: str,
    bwrap: str | None,
    probe: Probe,
) -> Isolation:
    as_root = os.geteuid() == 0
    if requested == "rlimits":
        return _weak_isolation(python_executable, as_root, probe)
    if bwrap is not None:
        candidate = Isolation("bubblewrap", "namespace", run_uid=as_root)
        if probe(candidate, python_executable):
            logger.info("sandbox runs are isolated by %s", candidate.describe())
            return candidate
    why = "is not installed here" if bwrap is None else f"({bwrap}) cannot make namespaces here"
    raise UserError(
        f"sandbox.isolation={requested}: untrusted code runs only under bubblewrap, which {why}: install it "
        "(apt-get install bubblewrap), or set env.<task>.sandbox.isolation: rlimits to run the code under "
        "resource limits only, on purpose (it is then NOT contained: docs/security.md)"
    )


def _weak_isolation(python_executable: str, as_root: bool, probe: Probe) -> Isolation:
    for network in _FALLBACK_NETWORKS:
        for run_uid in (True, False) if as_root else (False,):
            candidate = Isolation("rlimits", network, run_uid=run_uid)
            if probe(candidate, python_executable):
                return candidate
    raise RuntimeError("no sandbox configuration can run Python on this machine; see docs/security.md")


def clear_cache() -> None:
    """Forget what was detected (tests that change the machine's answer)."""
    _detect.cache_clear()
