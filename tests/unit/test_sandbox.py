"""The sandbox's limits and clean-up, under every isolation this machine has.

Each test runs under bubblewrap (when it works here) and under the weak ``rlimits`` mode (chosen on purpose
only); an escape that mode cannot contain (docs/security.md says which) is skipped with the reason. The
escape classes the default must contain are checked in tests/unit/test_security.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_rl.config.env import SandboxConfig
from nemo_rl.config.errors import UserError
from nemo_rl.environments.sandbox import Isolation, Sandbox, detect_isolation
from nemo_rl.environments.sandbox_isolation import BWRAP_ENV_VAR

LIMITS = SandboxConfig(
    wall_time_limit_s=2.0,
    cpu_time_limit_s=1,
    memory_limit_mb=256,
    file_size_limit_mb=1,
    max_processes=16,
    max_output_bytes=4096,
)


SYSTEM_PYTHON = "/usr/bin/python3"
"""An interpreter other users can run: as root, the fallback gives each run a uid of its own with it."""


def _isolations() -> list[object]:
    params: list[object] = []
    try:
        bubblewrap = detect_isolation("bubblewrap", sys.executable)
        params.append(pytest.param((bubblewrap, sys.executable), id="bubblewrap"))
    except UserError as err:
        params.append(pytest.param(None, id="bubblewrap", marks=pytest.mark.skip(reason=str(err))))
    params.append(pytest.param((detect_isolation("rlimits", sys.executable), sys.executable), id="rlimits"))
    if os.geteuid() == 0 and os.access(SYSTEM_PYTHON, os.X_OK):
        own_uid = detect_isolation("rlimits", SYSTEM_PYTHON)
        params.append(pytest.param((own_uid, SYSTEM_PYTHON), id="rlimits-system-python"))
    return params


@pytest.fixture(params=_isolations())
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    isolation, python = request.param
    return Sandbox(LIMITS.model_copy(update={"python_executable": python}), isolation=isolation)


def _counts_processes(sandbox: Sandbox) -> bool:
    # RLIMIT_NPROC binds a run with its own uid, a user namespace or a non-root caller; root is exempt.
    return sandbox.isolation.run_uid or sandbox.isolation.backend == "bubblewrap" or os.geteuid() != 0


def _processes_with(token: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_a_normal_program_returns_its_output_and_status(sandbox: Sandbox) -> None:
    result = sandbox.run_python(
        "import sys, helper\nprint(helper.VALUE, sys.stdin.read())\nprint('oops', file=sys.stderr)\nsys.exit(3)",
        stdin="from stdin",
        files={"helper.py": "VALUE = 42"},
    )
    assert (result.stdout, result.stderr, result.exit_code) == ("42 from stdin\n", "oops\n", 3)
    assert result.signal is None and not result.timed_out and not result.output_truncated
    assert not result.ok
    assert sandbox.run_python("print('fine')").ok
    assert result.isolation == sandbox.isolation.describe()


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(sandbox: Sandbox) -> None:
    result = sandbox.with_limits(wall_time_limit_s=10.0).run_python("while True: pass")
    assert result.signal in (signal.SIGXCPU, signal.SIGKILL) and result.exit_code is None
    assert result.wall_s < 10.0


def test_a_sleeping_program_is_stopped_by_the_wall_clock(sandbox: Sandbox) -> None:
    token = f"sleeper-{uuid.uuid4().hex}"
    start = time.monotonic()
    result = sandbox.run_python(
        f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{token}'])"
    )
    assert result.timed_out and result.signal == signal.SIGKILL
    assert time.monotonic() - start < 10.0
    assert _processes_with(token) == []


def test_limits_this_machine_cannot_apply_fail_at_once(sandbox: Sandbox) -> None:
    # Not even root may raise the open-file limit past the kernel's fs.nr_open.
    nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    with pytest.raises(UserError, match="cannot apply its limits"):
        Sandbox(sandbox.cfg.model_copy(update={"max_open_files": nr_open + 1}), isolation=sandbox.isolation)


def test_closing_its_output_neither_ends_nor_escapes_the_run(sandbox: Sandbox) -> None:
    code = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(0.5)\nos._exit(4)"
    result = sandbox.run_python(code)
    assert result.exit_code == 4 and not result.timed_out
    assert sandbox.run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)").timed_out


def test_a_memory_bomb_fails_to_allocate(sandbox: Sandbox) -> None:
    result = sandbox.run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(32 * 2**20))")
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_a_fork_bomb_is_capped_and_killed(sandbox: Sandbox) -> None:
    if not _counts_processes(sandbox):
        pytest.skip("as root without a uid of its own the fallback has no process limit (docs/security.md)")
    token = f"forkbomb-{uuid.uuid4().hex}"
    bomb = (
        f"# {token}\nimport os\ncount = 0\nwhile True:\n    try:\n        os.fork()\n        count += 1\n"
        "    except OSError:\n        pass\n"
    )
    result = sandbox.run_python(bomb)
    assert result.exit_code is None  # stopped at the CPU or the wall-clock limit
    assert _processes_with(token) == []


def test_a_process_that_leaves_the_session_is_killed_at_the_end(sandbox: Sandbox) -> None:
    if sandbox.isolation.backend != "bubblewrap" and not sandbox.isolation.run_uid:
        pytest.skip(
            "without a PID namespace or a uid of its own, a process that calls setsid escapes the kill"
        )
    token = f"daemon-{uuid.uuid4().hex}"
    daemon = (
        "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{token}'])\n"
        "    os._exit(0)\nprint('parent done')\n"
    )
    result = sandbox.run_python(daemon)
    assert result.stdout == "parent done\n"
    time.sleep(0.2)
    assert _processes_with(token) == []


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder every user may write to, under /tmp (whose parents every user can cross)."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="nemo_rl_test_shared_"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


def test_writing_outside_its_directory_fails(sandbox: Sandbox, shared_dir: Path) -> None:
    if sandbox.isolation.backend != "bubblewrap":
        pytest.skip(
            "the fallback writes wherever its uid can: world-writable folders at least (docs/security.md)"
        )
    target = shared_dir / "escaped.txt"
    result = sandbox.run_python(f"open({str(target)!r}, 'w').write('x')\n")
    assert result.exit_code == 1 and not target.exists()
    assert sandbox.run_python("open('inside.txt', 'w').write('fine')\nprint('ok')").stdout == "ok\n"


def test_an_own_uid_cannot_write_the_callers_folders(sandbox: Sandbox, shared_dir: Path) -> None:
    if not sandbox.isolation.run_uid:
        pytest.skip("runs with the caller's uid write wherever the caller can (docs/security.md)")
    shared_dir.chmod(0o755)  # the caller's own folder: readable by all, writable by its owner
    target = shared_dir / "escaped.txt"
    result = sandbox.run_python(f"open({str(target)!r}, 'w').write('x')\n")
    assert result.exit_code == 1 and not target.exists()


def test_writing_past_the_file_size_limit_fails(sandbox: Sandbox) -> None:
    big = sandbox.run_python("open('big', 'wb').write(bytes(2 * 2**20))")
    assert big.exit_code != 0 and "File too large" in big.stderr


def test_a_file_planted_outside_cannot_be_read(sandbox: Sandbox, tmp_path: Path) -> None:
    if sandbox.isolation.backend != "bubblewrap":
        pytest.skip("the fallback cannot hide the filesystem from reads (docs/security.md)")
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    secret.chmod(0o644)
    tmp_path.chmod(0o755)
    result = sandbox.run_python(f"print(open({str(secret)!r}).read())")
    assert "the secret" not in result.stdout and result.exit_code == 1
    assert "FileNotFoundError" in result.stderr


def test_opening_a_socket_gets_nowhere(sandbox: Sandbox) -> None:
    code = (
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    print('connected')\n"
        "except OSError as err:\n    print('refused', err)\n"
    )
    result = sandbox.run_python(code)
    assert result.stdout.startswith("refused"), result


def test_socket_refusal_where_no_network_namespace_can_be_made() -> None:
    weak = Sandbox(LIMITS, isolation=Isolation("rlimits", "socket_refusal", run_uid=False))
    result = weak.run_python("import socket\nsocket.socket()\n")
    assert result.exit_code == 1 and "refuses network access" in result.stderr
    assert weak.run_python("import sys\nprint(sys.argv)").stdout == "['main.py']\n"


def test_output_flooding_is_cut_and_killed(sandbox: Sandbox) -> None:
    result = sandbox.run_python("while True:\n    print('x' * 1000)")
    assert result.output_truncated and result.signal == signal.SIGKILL
    assert len(result.stdout) + len(result.stderr) <= LIMITS.max_output_bytes
    assert result.wall_s < 10.0


def test_a_missing_bubblewrap_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BWRAP_ENV_VAR, "none")
    for requested in ("bubblewrap", "auto"):
        with pytest.raises(UserError, match="which is not installed here: install it"):
            detect_isolation(requested, sys.executable)
    assert detect_isolation("rlimits", sys.executable).backend == "rlimits"


def test_files_must_be_plain_names(sandbox: Sandbox) -> None:
    with pytest.raises(ValueError, match="plain names"):
        sandbox.run_python("", files={"../x.py": ""})
    with pytest.raises(ValueError, match="absolute path"):
        sandbox.run(["python3", "-c", "0"])
