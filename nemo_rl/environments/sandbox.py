"""Running untrusted code (a model's program, a tool call) in a separate process with hard limits.

:class:`Sandbox` runs a program, or Python source with :meth:`Sandbox.run_python`, in a fresh temporary
directory and returns its exit status and capped output as a :class:`SandboxResult`. Each run gets:

- CPU-time, address-space, file-size, open-file and process-count limits (``setrlimit`` in the run's first
  process, inherited by everything it starts), ``no_new_privs`` (a setuid program gains nothing) and a
  wall-clock limit kept by the caller, which then kills everything the run started;
- by default, bubblewrap (:mod:`nemo_rl.environments.sandbox_isolation`): new PID, network, IPC, UTS and mount
  namespaces, a read-only view of only the system libraries, the interpreter's files and its own directory,
  and (as root) a user id of its own without capabilities. Without bubblewrap a sandbox refuses to start,
  unless the config asks for the weak ``rlimits`` mode on purpose (limits and a session only; a warning each
  time a sandbox starts).

What is promised and what is not is written down in docs/security.md; :func:`detect_isolation` says what
this machine allows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nemo_rl.config.env import SandboxConfig
from nemo_rl.config.errors import UserError
from nemo_rl.environments import sandbox_isolation
from nemo_rl.environments.sandbox_isolation import Isolation, bwrap_argv, bwrap_path, run_env

logger = logging.getLogger(__name__)

_LAUNCHER_SOURCE = (Path(__file__).parent / "sandbox_launcher.py").read_text()
_SETUP_FAILED_EXIT_CODE = 125  # sandbox_launcher.SETUP_FAILED_EXIT_CODE (it is never imported)
_RUN_UID_RANGE = (1_000_000, 2_000_000_000)
"""User ids drawn for runs as root: unused by any account, and two concurrent runs almost never share one."""
_REFUSE_SOCKETS_PRELUDE = """\
import socket as _socket, sys as _sys, runpy as _runpy
class _NoNetwork(_socket.socket):
    def __init__(self, *args, **kwargs):
        raise PermissionError("the sandbox refuses network access")
_socket.socket = _NoNetwork
_socket.create_connection = _socket.socketpair = _socket.fromfd = _NoNetwork
del _socket
_sys.argv = _sys.argv[1:]
_runpy.run_path(_sys.argv[0], run_name="__main__")
"""
"""Run before a Python program where no network namespace can be made: sockets cannot be created through
the ``socket`` module. Code that reaches the ``_socket`` C module or ``ctypes`` gets around it."""


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended."""

    stdout: str
    """What the program wrote to stdout (decoded as UTF-8, bad bytes replaced), cut at the output limit."""

    stderr: str
    """What it wrote to stderr, cut the same way."""

    exit_code: int | None
    """Its exit status; ``None`` when it was killed by a signal or at a limit."""

    signal: int | None
    """The signal that ended it (``SIGKILL`` at the wall-clock or output limit, ``SIGXCPU`` at the CPU limit)."""

    timed_out: bool
    """The wall-clock limit ended it."""

    output_truncated: bool
    """It wrote more than the output limit and was killed."""

    wall_s: float
    """Seconds from start to the end of the clean-up."""

    isolation: str
    """What isolated it (:meth:`Isolation.describe`)."""

    @property
    def ok(self) -> bool:
        """It exited with status 0 within every limit."""
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated


def detect_isolation(
    requested: Literal["auto", "bubblewrap", "rlimits"], python_executable: str
) -> Isolation:
    """The isolation runs get here (see :func:`nemo_rl.environments.sandbox_isolation.detect_isolation`).

    Raises:
        UserError: ``requested`` is ``auto`` or ``bubblewrap`` and bubblewrap is missing or cannot run here.
    """
    return sandbox_isolation.detect_isolation(requested, python_executable, _probe)


def check_sandbox(cfg: SandboxConfig) -> Isolation:
    """What runs under ``cfg`` would be isolated by, found now (before any worker starts).

    Raises:
        UserError: nothing this machine offers contains a run, and ``cfg`` did not ask for ``rlimits``.
    """
    return detect_isolation(cfg.isolation, cfg.python_executable or sys.executable)


_PROBE_PROGRAM = "import socket; print(len(socket.if_nameindex()))"


def _probe(isolation: Isolation, python_executable: str) -> bool:
    """Whether a run under ``isolation`` starts Python (and, for a namespace, sees only the loopback)."""
    cfg = SandboxConfig(wall_time_limit_s=30.0, python_executable=python_executable)
    sandbox = Sandbox(cfg, isolation=isolation, check_limits=False)
    result = sandbox.run([python_executable, "-I", "-S", "-c", _PROBE_PROGRAM])
    if not result.ok:
        logger.info("sandbox probe %s failed: %s", isolation.describe(), result.stderr.strip()[-500:])
        return False
    return isolation.network != "namespace" or result.stdout.strip() == "1"


class Sandbox:
    """Runs programs under the limits of ``cfg`` (see the module docstring and docs/security.md).

    Args:
        cfg: The limits (an ``env.<task>.sandbox`` section).
        isolation: How to isolate runs; ``None`` detects the strongest one ``cfg.isolation`` allows.
        check_limits: Run one empty program now, so that limits this machine cannot apply fail here
            (a :class:`UserError`) rather than as a silent failure of every run.
    """

    def __init__(
        self, cfg: SandboxConfig, *, isolation: Isolation | None = None, check_limits: bool = True
    ) -> None:
        self.cfg = cfg
        self.python_executable = cfg.python_executable or sys.executable
        self.isolation = isolation or detect_isolation(cfg.isolation, self.python_executable)
        """What isolates this sandbox's runs."""
        if check_limits:
            if not self.isolation.contains:
                logger.warning(
                    "sandbox.isolation=%s: untrusted code runs under %s, which does NOT contain it (it can read "
                    "the filesystem and reach other processes; docs/security.md); install bubblewrap "
                    "(apt-get install bubblewrap) and set sandbox.isolation: auto",
                    cfg.isolation,
                    self.isolation.describe(),
                )
            self._check_limits()

    def _check_limits(self) -> None:
        """Fail now, not as a silent zero on every run, when these limits cannot be applied here (a limit
        above the hard limit this process was given, say)."""
        result = self.run([self.python_executable, "-I", "-S", "-c", "pass"])
        if result.exit_code == _SETUP_FAILED_EXIT_CODE and result.stderr.startswith("sandbox setup failed"):
            raise UserError(
                f"the sandbox cannot apply its limits here ({result.stderr.strip()}); lower the sandbox "
                "limits or raise this process's hard limits (ulimit -H)"
            )
        if not result.ok:
            raise RuntimeError(f"the sandbox cannot run {self.python_executable}: {result}")

    def run_python(
        self, source: str, *, stdin: str = "", files: Mapping[str, str] | None = None
    ) -> SandboxResult:
        """Run Python ``source`` as the script ``main.py`` in a fresh directory (with ``files``, name ->
        text, beside it; its imports see them)."""
        argv = [self.python_executable, "-E", "-s", "-B"]
        if self.isolation.network == "socket_refusal":
            argv += ["-c", _REFUSE_SOCKETS_PRELUDE]
        return self.run([*argv, "main.py"], stdin=stdin, files={**(files or {}), "main.py": source})

    def run(
        self, argv: Sequence[str], *, stdin: str = "", files: Mapping[str, str] | None = None
    ) -> SandboxResult:
        """Run ``argv`` (its first item an absolute path) in a fresh directory holding ``files`` (name ->
        text), which is removed afterwards."""
        if not os.path.isabs(argv[0]):
            raise ValueError(f"the sandbox runs programs by absolute path, got {argv[0]!r}")
        with tempfile.TemporaryDirectory(prefix="nemo_rl_sandbox_") as run_dir:
            uid = random.randrange(*_RUN_UID_RANGE) if self.isolation.run_uid else None
            for name, text in (files or {}).items():
                if os.path.dirname(name) or name in (".", ".."):
                    raise ValueError(f"sandbox files are plain names in the run directory, got {name!r}")
                Path(run_dir, name).write_text(text)
            if uid is not None:
                os.chmod(run_dir, 0o700)
                for path in [run_dir, *(str(p) for p in Path(run_dir).iterdir())]:
                    os.chown(path, uid, uid)
            try:
                return self._run_in(run_dir, list(argv), uid, stdin)
            finally:
                if uid is not None:
                    self._kill_uid(uid)

    def _launcher_argv(self, uid: int | None) -> list[str]:
        mb = 2**20
        limits = self.cfg
        spec = {
            "rlimits": {
                "RLIMIT_CORE": [0, 0],
                # The soft limit sends SIGXCPU, the hard one a second later SIGKILL.
                "RLIMIT_CPU": [limits.cpu_time_limit_s, limits.cpu_time_limit_s + 1],
                "RLIMIT_AS": [limits.memory_limit_mb * mb] * 2,
                "RLIMIT_FSIZE": [limits.file_size_limit_mb * mb] * 2,
                "RLIMIT_NOFILE": [limits.max_open_files] * 2,
            },
            "nproc": limits.max_processes,
            # Without an own uid (or a user namespace of bubblewrap's) the count includes every process of
            # the caller's user, so the limit is set on top of those.
            "nproc_relative": uid is None and self.isolation.backend == "rlimits",
            "unshare_net": self.isolation.backend == "rlimits" and self.isolation.network == "namespace",
            "uid": uid,
        }
        return [self.python_executable, "-I", "-S", "-c", _LAUNCHER_SOURCE, json.dumps(spec)]

    def _run_in(self, run_dir: str, argv: list[str], uid: int | None, stdin: str) -> SandboxResult:
        command = [*self._launcher_argv(uid), *argv]
        if self.isolation.backend == "bubblewrap":
            bwrap = bwrap_path()
            assert bwrap is not None, "bubblewrap was found when the isolation was detected"
            command = [*bwrap_argv(bwrap, run_dir, self.python_executable, uid is not None), *command]
            # Not the caller's environment: bubblewrap's own process is the namespace's pid 1, whose
            # /proc/1/environ the run could otherwise read.
            env, cwd = {"PATH": "/usr/bin:/bin"}, None
        else:
            env, cwd = run_env(run_dir), run_dir
        start = time.monotonic()
        # An unnamed file, so the program cannot find its input again once it has closed stdin.
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            process = subprocess.Popen(
                command,
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,  # its own process group, killed as a whole at the end
                close_fds=True,
            )
        try:
            out, err, timed_out, truncated = self._collect(process, start + self.cfg.wall_time_limit_s)
        finally:
            _kill_group(process)
        return self._result(process, out, err, timed_out, truncated, start)

    def _collect(self, process: subprocess.Popen[bytes], deadline: float) -> tuple[bytes, bytes, bool, bool]:
        """Read stdout and stderr until both close, the deadline passes or the output limit is crossed;
        returns both outputs, whether the deadline passed and whether the limit was crossed."""
        assert process.stdout is not None and process.stderr is not None
        streams = (process.stdout.fileno(), process.stderr.fileno())
        chunks: dict[int, list[bytes]] = {fd: [] for fd in streams}
        budget = self.cfg.max_output_bytes
        timed_out = truncated = False
        with selectors.DefaultSelector() as selector:
            for fd in streams:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map() and not (timed_out or truncated):
                remaining_s = deadline - time.monotonic()
                timed_out = remaining_s <= 0
                if process.poll() is not None:
                    # The program ended: what it left behind (a daemon holding the pipes) is killed now
                    # rather than waited for; the pipes then close and the rest is read.
                    _kill_group(process)
                for key, _ in selector.select(timeout=max(0.0, min(remaining_s, 0.1))):
                    data = os.read(key.fd, 65536)
                    if not data:
                        selector.unregister(key.fd)
                        continue
                    chunks[key.fd].append(data[: max(budget, 0)])
                    budget -= len(data)
                    truncated = budget < 0
        if not (timed_out or truncated):
            # Both pipes closed; a program that closed them itself still gets the rest of its time.
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        return b"".join(chunks[streams[0]]), b"".join(chunks[streams[1]]), timed_out, truncated

    def _result(
        self,
        process: subprocess.Popen[bytes],
        out: bytes,
        err: bytes,
        timed_out: bool,
        truncated: bool,
        start: float,
    ) -> SandboxResult:
        code = process.wait()
        if process.stdout is not None:
            process.stdout.close()
        if process.stderr is not None:
            process.stderr.close()
        # bubblewrap reports a program killed by signal N as status 128 + N, subprocess as -N.
        sig = (
            -code
            if code < 0
            else code - 128
            if self.isolation.backend == "bubblewrap" and code > 128
            else None
        )
        if timed_out or truncated:
            sig = signal.SIGKILL
        return SandboxResult(
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            exit_code=None if sig is not None else code,
            signal=sig,
            timed_out=timed_out,
            output_truncated=truncated,
            wall_s=time.monotonic() - start,
            isolation=self.isolation.describe(),
        )

    def _kill_uid(self, uid: int) -> None:
        """Kill every process of the run's uid: those that left its process group (a double fork and
        ``setsid``) included. bubblewrap's PID namespace has ended them already; this costs a process."""
        if self.isolation.backend == "bubblewrap":
            return
        subprocess.run(
            [self.python_executable, "-I", "-S", "-c", _LAUNCHER_SOURCE, json.dumps({"kill_uid": uid})],
            check=True,
            timeout=30,
        )

    def with_limits(self, **changes: object) -> Sandbox:
        """A sandbox with the same isolation and some limits changed (``wall_time_limit_s=1.0``...)."""
        cfg = self.cfg.model_copy(update=changes)
        return Sandbox(SandboxConfig.model_validate(cfg.model_dump()), isolation=self.isolation)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """Kill the run: under bubblewrap its PID namespace first, then its process group.

    The namespace's first process (bubblewrap's child) is killed directly and waited for: when it exits
    the kernel kills everything else in the namespace, and it turns into a zombie only once they are gone,
    so nothing of the run is left when this returns. Killing only the outer bubblewrap would end the
    namespace a moment later (``--die-with-parent``), after the caller had moved on, and leave the
    namespace's first process for the machine's init to reap.
    """
    for child in _children(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        _wait_until_exited(child, timeout_s=5.0)
    with contextlib.suppress(ProcessLookupError):  # the whole group has ended
        os.killpg(process.pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (none when it has ended or the kernel does not list them)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _wait_until_exited(pid: int, timeout_s: float) -> None:
    """Wait until ``pid`` is gone or a zombie (``timeout_s`` at most)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.005)
