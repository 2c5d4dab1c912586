"""No process of a local Ray session outlives its driver: Ray's agents once lived 60 s after a SIGKILLed driver
(see :mod:`nemo_rl.distributed.ray_reaper`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from nemo_rl.distributed.ray_reaper import GRACE_S, POLL_S

ROOT = Path(__file__).resolve().parents[2]

# A driver that starts a local Ray the way the scripts do, prints its session's processes and waits on stdin.
RAY_DRIVER = """
import json, os, sys, psutil, ray
from nemo_rl.distributed.ray_start import init_ray
init_ray(None)
ray.get(ray.remote(lambda: 0).remote(), timeout=120)
print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)]), flush=True)
sys.stdin.readline()
"""

# A stand-in for Ray without Ray: a "raylet" whose child ignores SIGTERM, as Ray's agents do.
FAKE_DRIVER = """
import json, psutil, subprocess, sys, time
from nemo_rl.distributed.ray_reaper import spawn_reaper
agent = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
raylet = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {agent!r}]); time.sleep(600)"])
while not psutil.Process(raylet.pid).children():  # the agent has started
    time.sleep(0.05)
reaper = spawn_reaper([raylet.pid])
print(json.dumps([raylet.pid, reaper.pid]), flush=True)
sys.stdin.readline()
"""


def _start(code: str, ray_dir: Path) -> tuple[subprocess.Popen[str], list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NEMO_RL_RAY_TEMP_DIR": str(ray_dir)}
    driver = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert driver.stdout is not None
    line = driver.stdout.readline()
    assert line, f"the driver exited with status {driver.wait()}"
    return driver, json.loads(line)


def _session(pids: list[int]) -> list[psutil.Process]:
    """The processes and all their descendants, listed now (so that later orphans are still known)."""
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            process = psutil.Process(pid)
            for member in [process, *process.children(recursive=True)]:
                found[member.pid] = member
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def _left_after(processes: list[psutil.Process], timeout_s: float) -> list[str]:
    """Names of ``processes`` still running after ``timeout_s`` (``is_running`` checks the start time too)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for process in processes:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{process.pid} {process.name()}")
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _end(driver: subprocess.Popen[str], how: str) -> None:
    if how == "SIGKILL":
        driver.send_signal(signal.SIGKILL)
    else:
        assert driver.stdin is not None
        driver.stdin.close()
    driver.wait(timeout=120)


@pytest.mark.parametrize("how", ["SIGKILL", "normal exit"])
def test_the_reaper_kills_what_outlives_the_driver(tmp_path: Path, how: str) -> None:
    driver, (raylet, reaper) = _start(FAKE_DRIVER, tmp_path / "ray")
    processes = _session([raylet, reaper])
    assert len(processes) == 3, processes  # the "raylet", its "agent" and the reaper
    _end(driver, how)
    assert not _left_after(processes, GRACE_S + POLL_S + 5)


def test_the_reaper_kills_orphans_once_the_session_is_gone(tmp_path: Path) -> None:
    # ray.shutdown() with the driver still running: the raylet is gone, its agent lingers, the reaper kills it.
    driver, (raylet, reaper) = _start(FAKE_DRIVER, tmp_path / "ray")
    try:
        processes = _session([raylet, reaper])
        psutil.Process(raylet).kill()
        assert not _left_after(processes, GRACE_S + POLL_S + 5)
    finally:
        _end(driver, "SIGKILL")


@pytest.mark.parametrize("how", ["SIGKILL", "normal exit"])
def test_no_process_of_a_local_ray_session_outlives_its_driver(how: str) -> None:
    # A short folder: Ray's socket paths must stay under 108 bytes.
    ray_dir = Path(f"/tmp/ray_reap_{uuid.uuid4().hex[:8]}")
    try:
        driver, pids = _start(RAY_DRIVER, ray_dir)
        processes = _session(pids)
        names = {process.name() for process in processes}
        assert {"raylet", "gcs_server", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
        _end(driver, how)
        # Well within the 60 s the agents lingered before.
        assert not _left_after(processes, 20), f"still running after the driver's {how}"
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
