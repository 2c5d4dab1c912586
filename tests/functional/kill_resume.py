"""Killing a training script under test with SIGKILL and rerunning it: the one implementation the functional
tests share.

:func:`kill_and_resume` is the bit-exact check. It starts the script, waits until it has logged the step after
its first checkpoint (so the killed run always leaves a step to compare), waits a random delay more, drawn from
a seed it prints, and SIGKILLs the driver: whatever the run was doing then (training, validating, saving,
exporting) is cut short. A checkpoint written after the first is lost as a kill in the middle of writing it
would lose it, so the rerun resumes from the first. The same command is rerun to its end, and every
``train/`` and ``validation/`` metric the killed run logged after the checkpoint must come back bit for bit.
``KILL_RESUME_SEED=<seed>`` repeats a failing draw.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from run_logs import read_records, wait_until_step_logged

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900


def script_env(**extra: str) -> dict[str, str]:
    """The environment a script under test runs in: this one, unbuffered output, plus ``extra``."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


def run_script(
    cmd: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in the repository root to its end; fail the test with its output unless it exits 0."""
    result = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=dict(env or script_env())
    )
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def kill_driver(
    cmd: Sequence[str],
    wait: Callable[[subprocess.Popen[bytes]], None],
    *,
    delay_s: float = 0.0,
    env: Mapping[str, str] | None = None,
) -> bool:
    """Start ``cmd``, block in ``wait(proc)`` (e.g. until a checkpoint exists), sleep ``delay_s``, then SIGKILL
    the driver and reap it; whether the kill ended it (a run that ended by itself during the delay is left as
    it ended)."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(env or script_env())
    )
    try:
        wait(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=delay_s)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        return proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()


def lose_checkpoints_after(ckpt_dir: Path, step: int) -> None:
    """Rename every ``step_N`` with N > ``step`` to ``tmp_step_N``: what a kill while saving it leaves, which
    the next run never reads."""
    for path in ckpt_dir.glob("step_*"):
        if int(path.name.removeprefix("step_")) > step:
            path.rename(path.with_name(f"tmp_{path.name}"))


# Measurements of timing, like the durations: how many batches asynchronous GRPO's generation had sampled
# ahead when the step took its own.
TIMING_METRICS = frozenset({"train/async/buffered_batches"})


def step_metrics(records: Sequence[Mapping[str, Any]], step: int) -> dict[str, Any]:
    """Every ``train/`` and ``validation/`` metric ``records`` hold for ``step`` (the last logged of each), but
    durations and rates (names ending in ``_s``) and the other measurements of timing (``TIMING_METRICS``),
    which no two runs share."""
    merged: dict[str, Any] = {}
    for record in records:
        if record["step"] == step:
            merged.update(
                {
                    key: value
                    for key, value in record.items()
                    if key.startswith(("train/", "validation/"))
                    and not key.endswith("_s")
                    and key not in TIMING_METRICS
                }
            )
    return merged


@dataclass(frozen=True)
class Resumed:
    """What :func:`kill_and_resume` saw."""

    killed: list[dict[str, Any]]
    """The records the killed run logged."""
    rerun: list[dict[str, Any]]
    """The records the rerun logged."""
    result: subprocess.CompletedProcess[str]
    """The rerun (its output)."""


def kill_and_resume(
    cmd: Sequence[str],
    *,
    log_dir: Path,
    ckpt_dir: Path,
    checkpoint_step: int,
    max_delay_s: float,
    rerun_overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = TIMEOUT_S,
) -> Resumed:
    """Kill ``cmd`` at a random moment after its ``step_<checkpoint_step>`` checkpoint, rerun it, and assert
    that the rerun repeats bit for bit every step the killed run logged after that checkpoint (see the module
    docstring). The moment is a seeded random delay of up to ``max_delay_s`` after the step that follows the
    checkpoint logged its training metrics. ``rerun_overrides`` go at the end of the rerun's command (settings
    that change nothing the steps compute, such as the console's)."""
    seed = int(os.environ.get("KILL_RESUME_SEED", random.randrange(2**32)))
    delay_s = random.Random(seed).uniform(0.0, max_delay_s)
    # Captured by pytest and shown with a failure: the draw to repeat.
    print(
        f"kill_and_resume: SIGKILL {delay_s:.2f} s after step {checkpoint_step + 1} logged "
        f"(KILL_RESUME_SEED={seed} repeats it)"
    )
    if not kill_driver(
        cmd,
        lambda proc: wait_until_step_logged(proc, log_dir, checkpoint_step + 1, timeout_s),
        delay_s=delay_s,
        env=env,
    ):
        print("kill_and_resume: the run had ended by itself before the kill")
    # Lines are written whole (one write each), so a kill never leaves half a line.
    killed = read_records(log_dir)
    lose_checkpoints_after(ckpt_dir, checkpoint_step)

    result = run_script([*cmd, *rerun_overrides], env, timeout_s)
    assert f"(step {checkpoint_step})" in result.stdout and "Resuming" in result.stdout, result.stdout[-3000:]
    rerun = read_records(log_dir)[len(killed) :]
    repeated = sorted({r["step"] for r in killed if r["step"] > checkpoint_step})
    assert repeated, f"the killed run logged nothing after step {checkpoint_step}"
    for step in repeated:
        expected, got = step_metrics(killed, step), step_metrics(rerun, step)
        if step == checkpoint_step + 1:
            assert "train/loss" in expected, sorted(expected)
        assert {key: got.get(key) for key in expected} == expected, (step, got, expected)
    return Resumed(killed=killed, rerun=rerun, result=result)
