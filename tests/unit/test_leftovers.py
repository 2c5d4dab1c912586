"""The end-of-session check of tests/leftovers.py: what it counts as left behind, and what it leaves alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import leftovers
import psutil
import pytest


@pytest.fixture
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """Stand-ins for /dev/shm and /tmp, and a short grace period."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(leftovers, "SHM_DIR", shm)
    monkeypatch.setattr(leftovers, "TMP_DIR", tmp)
    monkeypatch.setattr(leftovers, "PROCESS_GRACE_S", 1.0)
    return shm, tmp


def _sleeper(session: str | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != leftovers.SESSION_ENV}
    if session is not None:
        env[leftovers.SESSION_ENV] = session
    # setsid: like a daemon, no longer this process's child once its parent is gone.
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )


def test_a_marked_process_still_running_is_named_and_killed(folders: tuple[Path, Path]) -> None:
    ours, other = _sleeper("session-a"), _sleeper("session-b")
    try:
        deadline = time.monotonic() + 30
        while not leftovers.marked_processes("session-a") and time.monotonic() < deadline:
            time.sleep(0.1)  # the child's environment is readable once it has exec'd
        problems = leftovers.find_leftovers("session-a", leftovers.Snapshot.take(), "processes")
        assert len(problems) == 1 and f"pid {ours.pid}" in problems[0], problems
        assert ours.wait(timeout=30) != 0  # killed
        assert psutil.pid_exists(other.pid) and other.poll() is None  # another session's: left alone
        assert leftovers.find_leftovers("session-a", leftovers.Snapshot.take(), "off") == []
    finally:
        for process in (ours, other):
            process.kill()
            process.wait(timeout=30)


def test_new_segments_and_temporary_entries_count_only_when_checking_all(folders: tuple[Path, Path]) -> None:
    shm, tmp = folders
    (shm / "before").write_bytes(b"")
    (tmp / "before").mkdir()
    snapshot = leftovers.Snapshot.take()
    for name in ("nemo_rl_refit_1", "before_too"):
        (shm / name).write_bytes(b"")
    for name in ("tmpabc123", "pytest-of-root", "ray_nemo_rl_0", "uv-1234.lock"):
        (tmp / name).mkdir()
    (shm / "before_too").unlink()  # appeared and went: fine
    assert leftovers.find_leftovers("no-such-session", snapshot, "processes") == []
    assert leftovers.find_leftovers("no-such-session", snapshot, "all") == [
        "/dev/shm/nemo_rl_refit_1 appeared and is still there",
        "/tmp/tmpabc123 appeared and is still there",
    ]
