"""run_script ends a script's process with the status and output a normal exit has, exit handlers included,
without the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, sys, threading, time
from nemo_rl.config.errors import UserError
from nemo_rl.utils.script_exit import run_script

class TornDown:
    def __del__(self):
        print("teardown ran")

# Only the interpreter's teardown frees a module global.
KEPT = TornDown()

def main():
    atexit.register(lambda: print("exit handler ran"))
    # A non-daemon thread still running when main returns: Python waits for it before the exit handlers.
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
    print("unflushed line", end="")  # no newline, no flush: only an exit that flushes shows it
    outcome = sys.argv[1]
    if outcome == "user_error":
        raise UserError("the config names no model: set policy.model_name")
    if outcome == "exit_3":
        sys.exit(3)
    if outcome == "message":
        sys.exit("stopped early")
    if outcome == "bug":
        raise ValueError("a bug")

run_script(main)
"""


def _run(outcome: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    return subprocess.run(
        [sys.executable, str(script), outcome], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


@pytest.mark.parametrize(
    ("outcome", "status", "stderr_part"),
    [
        ("ok", 0, ""),
        ("user_error", 2, "set policy.model_name"),
        ("exit_3", 3, ""),
        ("message", 1, "stopped early"),
        ("bug", 1, "ValueError: a bug"),
    ],
)
def test_status_output_and_exit_handlers_as_a_normal_exit(
    outcome: str, status: int, stderr_part: str, tmp_path: Path
) -> None:
    done = _run(outcome, tmp_path)
    assert done.returncode == status, done.stderr
    assert stderr_part in done.stderr
    # The thread ran to its end, then the handlers ran, and buffered output reached the pipe.
    assert "unflushed line" in done.stdout
    assert done.stdout.index("thread finished") < done.stdout.index("exit handler ran")
    # The teardown itself is skipped, except where an exception ends the script the ordinary way.
    assert ("teardown ran" in done.stdout) == (outcome == "bug")


def test_a_script_run_in_another_program_leaves_that_program_s_exit_alone(tmp_path: Path) -> None:
    # As the functional tests do: the script runs with runpy inside the test's process, which catches its
    # SystemExit and goes on; that process then exits with its own status, teardown included.
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    host = f"""
import runpy, sys
sys.argv = [{str(script)!r}, "exit_3"]
try:
    runpy.run_path({str(script)!r}, run_name="__main__")
except SystemExit as stop:
    print("caught", stop.code)
"""
    done = subprocess.run([sys.executable, "-c", host], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "caught 3" in done.stdout and "exit handler ran" in done.stdout
    assert "teardown ran" in done.stdout
