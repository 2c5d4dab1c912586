"""Asynchronous GRPO end to end (examples/configs/grpo_math_tiny_async.yaml, the embedded engine on a worker
slot of its own): without in-flight weight updates two runs with one seed are equal, and a run killed at a
random moment resumes bit for bit; with them, a killed and rerun run trains every prompt exactly once.

Three steps of four prompts, a checkpoint after every step, a validation at step 2: a checkpoint always holds
a batch sampled ahead (one-step-off), which the resumed run trains on without sampling it again.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kill_resume import kill_and_resume, kill_driver, run_script, step_metrics
from run_logs import read_records, wait_until_exists
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


def _expected_prompt_order(num_prompts: int) -> list[int]:
    # The recipe's loader: the 4946 training problems shuffled with seed 42 (StatefulDataLoader's epoch 0).
    from nemo_rl.data.dataloader import StatefulDataLoader

    loader = StatefulDataLoader(
        range(4946), batch_size=1, shuffle=True, seed=42, drop_last=True, collate_fn=list
    )
    return loader.epoch_order(0)[:num_prompts]


@pytest.mark.slow
def test_async_grpo_is_seeded_and_a_killed_run_resumes_bit_for_bit(baseline: Path, tmp_path: Path) -> None:
    # A second run with the baseline's seed, SIGKILLed at a random moment after step 2 logged (validating,
    # saving, refitting or in step 3, its generation thread sampling ahead), its step-2 checkpoint then lost
    # as a kill while writing it would lose it: the rerun resumes from step 1's, whose buffer holds the batch
    # step 2 trains on, sampled by the initial weights.
    cmd = _command(tmp_path, "checkpointing.save_consolidated=true")
    resumed = kill_and_resume(
        cmd,
        log_dir=tmp_path / "logs",
        ckpt_dir=tmp_path / "ckpt",
        checkpoint_step=1,
        max_delay_s=3.0,
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


@pytest.mark.slow
def test_async_grpo_with_in_flight_updates_trains_every_prompt_once_across_a_kill(tmp_path: Path) -> None:
    # In-flight refits land wherever generation is, so the samples depend on timing; what holds is the
    # prompts. The driver is SIGKILLed at a random moment once step 1's checkpoint exists (whatever step,
    # save or refit is under way), and the rerun resumes from its latest checkpoint.
    cmd = _command(
        tmp_path,
        "grpo.async_grpo.in_flight_weight_updates=true",
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true",
    )
    delay_s = random.uniform(0.0, 4.0)
    print(f"SIGKILL {delay_s:.2f} s after the step-1 checkpoint")
    kill_driver(
        cmd,
        lambda proc: wait_until_exists(proc, tmp_path / "ckpt" / "step_1" / "training_info.json", TIMEOUT_S),
        delay_s=delay_s,
    )
    rerun = run_script(cmd, timeout_s=TIMEOUT_S)
    assert "Resuming GRPO from" in rerun.stdout, rerun.stdout[-3000:]
    lines = (tmp_path / "logs" / "async_trajectories.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    by_step: dict[int, list[int]] = {}
    for record in records:
        assert not record["dropped"], record
        assert record["age"] <= 1, record
        # A step trained again after the resume takes the prompts the killed run took.
        assert by_step.setdefault(record["step"], record["prompt_idx"]) == record["prompt_idx"], record
    assert sorted(by_step) == list(range(1, NUM_STEPS + 1))
    trained = [i for step in sorted(by_step) for i in by_step[step]]
    assert trained == _expected_prompt_order(NUM_STEPS * PROMPTS_PER_STEP), "a prompt was lost or repeated"
    info = json.loads((tmp_path / "ckpt" / f"step_{NUM_STEPS}" / "training_info.json").read_text())
    assert info["consumed_prompts"] == NUM_STEPS * PROMPTS_PER_STEP
