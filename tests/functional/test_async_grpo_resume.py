"""Asynchronous GRPO end to end (examples/configs/grpo_math_tiny_async.yaml, the embedded engine on a worker
slot of its own) without in-flight weight updates: two runs with one seed are equal, and a run killed at a
random moment resumes bit for bit. (With in-flight updates, tests/functional/test_grpo_tiny.py checks that a
killed and rerun run trains every prompt exactly once; tests/unit/test_async_rollouts.py the same for a
checkpoint taken at any point of the schedule.)

Three steps of four prompts, a checkpoint after every step, a validation at step 2: a checkpoint always holds
a batch sampled ahead (one-step-off), which the resumed run trains on without sampling it again. A run takes
about a minute here, nearly all of it starting Ray and the workers, so the test makes do with three.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kill_resume import kill_and_resume, run_script, step_metrics
from run_logs import read_records
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_grpo_math.py"
ASYNC_CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny_async.yaml"
NUM_STEPS = 3
PROMPTS_PER_STEP = 4
TIMEOUT_S = 900


def _command(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--config",
        str(ASYNC_CONFIG),
        f"grpo.max_num_steps={NUM_STEPS}",
        f"grpo.num_prompts_per_step={PROMPTS_PER_STEP}",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        "grpo.val_period=2",
        "grpo.val_at_start=false",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "checkpointing.save_period=1",
        "checkpointing.keep_top_k=null",
        f"checkpointing.checkpoint_dir={run_dir / 'ckpt'}",
        f"logger.log_dir={run_dir / 'logs'}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
        *extra,
    ]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted deterministic run (no in-flight updates), its final weights exported."""
    run_dir = tmp_path_factory.mktemp("async_baseline")
    run_script(_command(run_dir, "checkpointing.save_consolidated=true"), timeout_s=TIMEOUT_S)
    return run_dir


def _trajectories(log_dir: Path) -> dict[int, dict[str, Any]]:
    """Each step's last record in ``async_trajectories.jsonl`` (a step repeated after a resume: the rerun's)."""
    records = [json.loads(line) for line in (log_dir / "async_trajectories.jsonl").read_text().splitlines()]
    return {record["step"]: record for record in records}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no safetensors in {folder}"
    return tensors


@pytest.mark.slow
def test_async_grpo_is_seeded_and_a_killed_run_resumes_bit_for_bit(baseline: Path, tmp_path: Path) -> None:
    # A second run with the baseline's seed, SIGKILLed at a random moment after step 2 logged (saving,
    # refitting or in step 3, its generation thread sampling ahead; what is left of the run takes a second), its
    # later checkpoints then lost as a kill while writing them would lose them: the rerun resumes from step
    # 1's, whose buffer holds the batch step 2 trains on, sampled by the initial weights.
    cmd = _command(tmp_path, "checkpointing.save_consolidated=true")
    resumed = kill_and_resume(
        cmd,
        log_dir=tmp_path / "logs",
        ckpt_dir=tmp_path / "ckpt",
        checkpoint_step=1,
        max_delay_s=0.8,
        timeout_s=TIMEOUT_S,
    )
    expected = read_records(baseline / "logs")
    # Every step either run logged equals the baseline's, bit for bit: the killed run's from the start (two
    # seeded runs are equal), the rerun's after the checkpoint (resuming changes nothing).
    for records in (resumed.killed, resumed.rerun):
        steps = sorted({r["step"] for r in records if "train/loss" in r})
        assert steps, records
        for step in steps:
            assert step_metrics(records, step) == step_metrics(expected, step), step
    assert "validation/accuracy" in step_metrics(expected, 2)
    # Which weights sampled each batch: a function of the step alone (one-step-off), in both runs.
    for run_dir in (baseline, tmp_path):
        assert {s: r["version"] for s, r in _trajectories(run_dir / "logs").items()} == {1: 0, 2: 0, 3: 1}
    final = _weights(tmp_path / "ckpt" / f"step_{NUM_STEPS}" / "consolidated")
    for name, tensor in _weights(baseline / "ckpt" / f"step_{NUM_STEPS}" / "consolidated").items():
        assert torch.equal(final[name], tensor), name
