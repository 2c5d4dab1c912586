"""Untrusted code is contained by default: each class of escape, under each isolation this machine offers.

The classes (docs/security.md): process count, files outside the run, other processes' memory and environment,
signals to anything outside the run, outliving the call, joining other namespaces, the network (the caller's
loopback listeners included) and the wall clock. Each runs under the default config:

- ``root``: this process is root (the runs drop to a uid of their own; the interpreter may live under a
  private prefix such as ``/root/.pyenv``);
- ``user``: as an ordinary user: this process when it is not root, else a worker started as a fresh uid
  (``setpriv``) with the system interpreter, ``RLIMIT_NPROC`` capping that uid as a second guard.

A mode this machine does not offer is skipped with the reason. Without bubblewrap (or with
``NEMO_RL_SANDBOX_BWRAP=none``, as if it were not installed) the default refuses to start, which the last
tests check. Every harmful program is bounded on its own (a fork bomb runs only after a bounded probe showed
the process cap holds, and inside a pids cgroup where one can be made), so a failing containment fails a
test rather than the shared machine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pydantic
import pytest

import nemo_rl
from nemo_rl.config.env import EnvConfig, SandboxConfig
from nemo_rl.config.errors import UserError
from nemo_rl.environments.registry import check_task_envs
from nemo_rl.environments.sandbox import Sandbox, check_sandbox
from nemo_rl.environments.sandbox_isolation import BWRAP_ENV_VAR
from nemo_rl.environments.tools import build_tool_registry

pytestmark = pytest.mark.timeout(60)  # each test; the whole set takes about 20 s

LIMITS = SandboxConfig(
    wall_time_limit_s=2.0, cpu_time_limit_s=1, memory_limit_mb=256, max_processes=16, max_output_bytes=8192
)
MARGIN_S = 1.0
"""How far past its wall-clock limit a run may end, whatever it started."""

CALLER_SECRET = f"caller-secret-{uuid.uuid4().hex}"
"""Put in this process's environment (and its worker's) for the module: no run may read it."""

SYSTEM_PYTHON = "/usr/bin/python3"
REPO = Path(nemo_rl.__file__).resolve().parents[1]
SITE_PACKAGES = Path(pydantic.__file__).resolve().parents[1]


@dataclass(frozen=True)
class Outcome:
    """What a run returned (a :class:`SandboxResult`'s fields that the tests read)."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    wall_s: float


Runner = Callable[[str], Outcome]

_USER_WORKER = """\
import json, resource, sys
sys.path[:0] = [{repo!r}, {site!r}]
resource.setrlimit(resource.RLIMIT_NPROC, (256, 256))  # the second guard: this fresh uid's processes
from nemo_rl.config.env import SandboxConfig
from nemo_rl.environments.sandbox import Sandbox
sandbox = Sandbox(SandboxConfig.model_validate_json(sys.argv[1]))
print(json.dumps(sandbox.isolation.describe()), flush=True)
for line in sys.stdin:
    r = sandbox.run_python(json.loads(line))
    print(json.dumps([r.stdout, r.stderr, r.exit_code, r.timed_out, r.wall_s]), flush=True)
"""


def _in_process_runner(python: str) -> Runner:
    try:
        check_sandbox(LIMITS)
    except UserError as err:
        pytest.skip(str(err))
    sandbox = Sandbox(LIMITS.model_copy(update={"python_executable": python}))
    assert sandbox.isolation.contains, sandbox.isolation.describe()

    def run(source: str) -> Outcome:
        r = sandbox.run_python(source)
        return Outcome(r.stdout, r.stderr, r.exit_code, r.timed_out, r.wall_s)

    return run


@contextlib.contextmanager
def _ordinary_user_runner() -> Iterator[Runner]:
    """A worker running as a fresh uid with the system interpreter, serving runs one line at a time."""
    if not os.access(SYSTEM_PYTHON, os.X_OK) or shutil.which("setpriv") is None:
        pytest.skip(
            f"no {SYSTEM_PYTHON} that an ordinary user can run, or no setpriv (util-linux) to start it"
        )
    version = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True
    )
    if version.stdout.decode().strip() != str(sys.version_info[:2]):
        pytest.skip(
            f"{SYSTEM_PYTHON} is not Python {sys.version_info[:2]}, so it cannot load this environment"
        )
    uid = 420_000 + os.getpid() % 10_000
    cfg = LIMITS.model_copy(update={"python_executable": SYSTEM_PYTHON}).model_dump_json()
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", SYSTEM_PYTHON]
    source = _USER_WORKER.format(repo=str(REPO), site=str(SITE_PACKAGES))
    worker = subprocess.Popen(
        [*argv, "-I", "-c", source, cfg],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    assert worker.stdin is not None and worker.stdout is not None and worker.stderr is not None
    try:
        first = worker.stdout.readline()
        if not first:
            pytest.skip(f"an ordinary user cannot start the sandbox here: {worker.stderr.read()[-300:]}")
        assert "bubblewrap" in json.loads(first), first

        def run(source: str) -> Outcome:
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write(json.dumps(source) + "\n")
            worker.stdin.flush()
            return Outcome(*json.loads(worker.stdout.readline()))

        yield run
    finally:
        worker.kill()
        worker.wait(timeout=30)


@pytest.fixture(scope="module", params=["root", "user"])
def run(request: pytest.FixtureRequest) -> Iterator[Runner]:
    os.environ["NEMO_RL_TEST_CALLER_SECRET"] = CALLER_SECRET
    try:
        yield from _runner(request.param)
    finally:
        del os.environ["NEMO_RL_TEST_CALLER_SECRET"]


def _runner(mode: str) -> Iterator[Runner]:
    as_root = os.geteuid() == 0
    if mode == "root":
        if not as_root:
            pytest.skip("this process is not root")
        yield _in_process_runner(sys.executable)
    elif as_root:
        try:
            check_sandbox(LIMITS)
        except UserError as err:
            pytest.skip(str(err))
        with _ordinary_user_runner() as runner:
            yield runner
    else:
        yield _in_process_runner(sys.executable)


def _processes_with(token: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
    return pids


@pytest.fixture
def bystander() -> Iterator[tuple[int, str]]:
    """A process of the caller's, with a secret in its environment: it must stay alive and unread."""
    secret = f"secret-{uuid.uuid4().hex}"
    process = subprocess.Popen(["sleep", "60"], env={"NEMO_RL_TEST_SECRET": secret, "PATH": "/usr/bin:/bin"})
    yield process.pid, secret
    process.kill()
    process.wait(timeout=30)


def _sleeper(token: str) -> str:
    """Python that replaces the current process with a 60-second sleep tagged with ``token``."""
    return f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{token}'])"


@contextlib.contextmanager
def _pids_cgroup(max_pids: int) -> Iterator[None]:
    """This process (and what it starts) in a pids cgroup of its own while the block runs, where one can be
    made: a guard for the machine should a fork bomb's containment fail."""
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/pids")):
        group = root / f"nemo_rl_test_{os.getpid()}"
        if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
            continue
        try:
            group.mkdir()
            (group / "pids.max").write_text(str(max_pids))
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            with contextlib.suppress(OSError):
                group.rmdir()
            continue
        try:
            yield
        finally:
            (root / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()
        return
    yield


def test_the_process_count_is_capped_and_a_fork_bomb_ends_on_time(run: Runner) -> None:
    # First a bounded probe (200 forks at most, each child sleeping briefly): the cap must hold...
    probe = (
        "import os, time\ncount = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(1.0)\n            os._exit(0)\n        count += 1\n    except OSError:\n"
        "        break\nprint(count)\n"
    )
    started = run(probe)
    assert started.stdout.strip().isdigit(), started
    assert int(started.stdout) < LIMITS.max_processes
    # ...and only then the real bomb, which would otherwise grow without bound.
    token = f"forkbomb-{uuid.uuid4().hex}"
    bomb = (
        f"# {token}\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    with _pids_cgroup(512):
        result = run(bomb)
    assert result.exit_code is None and result.wall_s < LIMITS.wall_time_limit_s + MARGIN_S
    assert _processes_with(token) == []


def test_files_outside_the_run_are_untouched(run: Runner, tmp_path: Path) -> None:
    open_dir = Path("/tmp") / f"nemo_rl_test_open_{uuid.uuid4().hex}"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)  # writable by every user: only the isolation keeps the run out
    try:
        planted = [open_dir / "planted.txt", tmp_path / "planted.txt"]
        for path in planted:
            path.write_text("original")
            path.chmod(0o666)
        # Only planted files are targets, never the project's own: a failing containment must not damage it.
        targets = [str(p) for p in planted]
        code = (
            "import os\n"
            f"for path in {targets!r}:\n"
            "    for attempt in (lambda: open(path, 'w').write('changed'), lambda: os.remove(path),\n"
            "                    lambda: open(os.path.dirname(path) + '/new.txt', 'w').write('x')):\n"
            "        try:\n            attempt()\n            print('escaped', path)\n"
            "        except OSError:\n            pass\n"
        )
        result = run(code)
        assert "escaped" not in result.stdout, result
        assert [p.read_text() for p in planted] == ["original", "original"]
        assert not (open_dir / "new.txt").exists() and not (tmp_path / "new.txt").exists()
    finally:
        for path in open_dir.iterdir():
            path.unlink()
        open_dir.rmdir()


def test_secrets_and_other_processes_memory_are_unreadable(run: Runner, bystander: tuple[int, str]) -> None:
    pid, secret = bystander
    paths = [
        "/etc/shadow",
        str(REPO / "pyproject.toml"),
        f"/proc/{pid}/environ",
        f"/proc/{os.getpid()}/environ",
    ]
    paths += [f"/proc/{pid}/mem", f"/proc/{os.getpid()}/cmdline", "/proc/1/environ"]
    code = (
        f"for path in {paths!r}:\n"
        "    try:\n        print(path, open(path, 'rb').read(4096))\n"
        "    except OSError as err:\n        print(path, 'refused', type(err).__name__)\n"
    )
    result = run(code)
    lines = result.stdout.splitlines()
    assert len(lines) == len(paths), result
    assert secret not in result.stdout and CALLER_SECRET not in result.stdout
    # /proc/1 is the run's own namespace's first process (bubblewrap's), started without the caller's
    # environment; nothing outside the namespace is there.
    for path, line in zip(paths, lines, strict=True):
        if path != "/proc/1/environ":
            assert "refused" in line, line


def test_signals_reach_nothing_outside_the_run(run: Runner, bystander: tuple[int, str]) -> None:
    pid, _ = bystander
    code = (
        "import os, signal\n"
        f"for target, sig in (({os.getpid()}, 0), ({pid}, signal.SIGKILL), ({os.getppid()}, 0)):\n"
        "    try:\n        os.kill(target, sig)\n        print('signalled', target)\n"
        "    except OSError as err:\n        print('refused', type(err).__name__)\n"
    )
    result = run(code)
    assert result.stdout.count("refused") == 3, result
    assert Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_nothing_outlives_the_call(run: Runner) -> None:
    token = f"daemon-{uuid.uuid4().hex}"
    code = (
        "import os, sys, signal\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        {_sleeper(token)}\n    os._exit(0)\nprint('parent done')\n"
    )
    result = run(code)
    assert result.stdout == "parent done\n" and result.exit_code == 0
    assert _processes_with(token) == []


def test_the_wall_clock_holds_whatever_the_run_started(run: Runner) -> None:
    token = f"stubborn-{uuid.uuid4().hex}"
    code = (
        "import os, sys, signal\nfor _ in range(5):\n    if os.fork() == 0:\n"
        "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n        os.setsid()\n"
        f"        {_sleeper(token)}\nimport time\ntime.sleep(60)\n"
    )
    start = time.monotonic()
    result = run(code)
    assert result.timed_out and result.wall_s < LIMITS.wall_time_limit_s + MARGIN_S
    assert time.monotonic() - start < LIMITS.wall_time_limit_s + MARGIN_S + 0.5  # + the worker's line
    assert _processes_with(token) == []


def test_no_capabilities_and_no_other_namespaces(run: Runner) -> None:
    code = (
        "import ctypes, os\nstatus = open('/proc/self/status').read()\n"
        "print([l.split()[1] for l in status.splitlines() if l.split(':')[0] in ('CapEff', 'CapPrm', 'NoNewPrivs')])\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"for path in ('/proc/{os.getpid()}/ns/net', '/proc/{os.getpid()}/ns/mnt', '/proc/1/ns/net'):\n"
        "    try:\n        fd = os.open(path, os.O_RDONLY)\n"
        "    except OSError as err:\n        print('refused', type(err).__name__)\n        continue\n"
        "    print('joined' if libc.setns(fd, 0) == 0 else 'refused setns')\n"
    )
    result = run(code)
    first, *rest = result.stdout.splitlines()
    assert first == "['0000000000000000', '0000000000000000', '1']", result
    assert len(rest) == 3 and all(line.startswith("refused") for line in rest), result


def test_the_network_is_unreachable_including_the_callers_loopback(run: Runner) -> None:
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener,
        socket.socket(socket.AF_UNIX) as abstract,
    ):
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        name = f"\0nemo_rl_test_{uuid.uuid4().hex}"
        abstract.bind(name)
        abstract.listen(8)
        abstract.setblocking(False)
        port = listener.getsockname()[1]
        code = (
            "import socket\n"
            f"attempts = [(socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_INET, ('1.1.1.1', 53)),\n"
            f"            (socket.AF_UNIX, {name!r})]\n"
            "for family, address in attempts:\n"
            "    try:\n        s = socket.socket(family)\n        s.settimeout(1)\n        s.connect(address)\n"
            "        print('connected', address)\n"
            "    except OSError as err:\n        print('refused', type(err).__name__)\n"
        )
        result = run(code)
        assert result.stdout.count("refused") == 3, result
        for server in (listener, abstract):
            with pytest.raises(BlockingIOError):
                server.accept()


def test_default_refuses_without_bubblewrap_and_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BWRAP_ENV_VAR, "none")
    for start in (
        lambda: Sandbox(SandboxConfig()),
        lambda: check_task_envs(["code"], EnvConfig()),
        lambda: build_tool_registry(["python"], SandboxConfig(isolation="bubblewrap")),
    ):
        with pytest.raises(UserError) as caught:
            start()
        message = str(caught.value)
        assert "\n" not in message and "apt-get install bubblewrap" in message
        assert "isolation: rlimits" in message


def test_the_weak_mode_only_on_purpose_and_warned_at_every_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(BWRAP_ENV_VAR, "none")
    weak = SandboxConfig(isolation="rlimits", wall_time_limit_s=2.0)
    with caplog.at_level(logging.WARNING, logger="nemo_rl.environments.sandbox"):
        first, second = Sandbox(weak), Sandbox(weak)
    warnings = [r for r in caplog.records if "does NOT contain" in r.getMessage()]
    assert len(warnings) == 2
    assert not first.isolation.contains and first.run_python("print(1)").stdout == "1\n"
    assert second.isolation.backend == "rlimits"


def test_a_bubblewrap_binary_that_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BWRAP_ENV_VAR, "/bin/false")
    with pytest.raises(UserError, match="cannot make namespaces here"):
        Sandbox(SandboxConfig())


def test_the_default_is_contained_where_bubblewrap_runs() -> None:
    try:
        isolation = check_sandbox(SandboxConfig())
    except UserError as err:
        pytest.skip(str(err))
    assert isolation.contains and isolation.backend == "bubblewrap"
    assert isolation.run_uid == (os.geteuid() == 0)
