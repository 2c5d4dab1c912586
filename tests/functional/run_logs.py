"""Reading what a script under test logged: its ``metrics.jsonl``, possibly while the run still writes it, and
the prompts each asynchronous GRPO step trained on; the worker processes of its Ray session; and the overrides
that put a GRPO script's sampler on vLLM's CPU build."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

VLLM_CPU_OWN_SLOT = (
    "cluster.gpus_per_node=2",
    "policy.generation.colocated.enabled=false",
    "policy.generation.colocated.resources.gpus_per_node=1",
    "policy.generation.backend=vllm",
    "policy.generation.embedded_cfg.in_policy_workers=false",
    "policy.generation.vllm_cfg.precision=float32",
    "policy.generation.vllm_cfg.enforce_eager=true",
    "policy.generation.vllm_cfg.cpu_kv_cache_gib=0.25",
)
"""GRPO overrides: vLLM's CPU build samples on a worker slot of its own, float32 like the policy, eager, with a
small KV cache (the tiny models need little)."""


def metrics_by_step(log_dir: Path) -> dict[int, dict[str, Any]]:
    """Every metric ``log_dir/metrics.jsonl`` holds, merged per step."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in read_records(log_dir):
        by_step.setdefault(record["step"], {}).update(record)
    return by_step


def read_records(log_dir: Path, *, while_written: bool = False) -> list[dict[str, Any]]:
    """Every line of ``log_dir/metrics.jsonl``; ``while_written`` skips a last line still being written."""
    lines = [line for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if not (while_written and i == len(lines) - 1):
                raise
    return records


def wait_until_step_logged(proc: subprocess.Popen[bytes], log_dir: Path, step: int, timeout_s: float) -> None:
    """Block until the running script ``proc`` has logged step ``step``'s ``train/loss``; fail the test with its
    output if it ends first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (log_dir / "metrics.jsonl").exists() or not any(
        r["step"] == step and "train/loss" in r for r in read_records(log_dir, while_written=True)
    ):
        if proc.poll() is not None:
            output = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"run ended before its step {step}:\n{output[-6000:]}")
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s:.0f} s"
        time.sleep(0.05)


def wait_until_exists(proc: subprocess.Popen[bytes], path: Path, timeout_s: float) -> None:
    """Block until the running script ``proc`` has written ``path`` (a checkpoint, say); fail the test with its
    output if it ends first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            output = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"run ended before it wrote {path}:\n{output[-6000:]}")
        assert time.monotonic() < deadline, f"no {path} within {timeout_s:.0f} s"
        time.sleep(0.1)


def trained_prompts(log_dir: Path) -> dict[int, list[int]]:
    """Prompt indices each step trained on (a step the killed run trained after its checkpoint is trained
    again by the rerun, on the same prompts)."""
    steps: dict[int, list[int]] = {}
    for line in (log_dir / "async_trajectories.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert not record["dropped"], record
        assert steps.setdefault(record["step"], record["prompt_idx"]) == record["prompt_idx"], record
    return steps


def expected_prompt_order(num_prompts: int) -> list[int]:
    # The recipe's loader: the 4946 training problems shuffled with seed 42 (StatefulDataLoader's epoch 0).
    from nemo_rl.data.dataloader import StatefulDataLoader

    loader = StatefulDataLoader(
        range(4946), batch_size=1, shuffle=True, seed=42, drop_last=True, collate_fn=list
    )
    return loader.epoch_order(0)[:num_prompts]


def ray_worker_pids(ray_dir: Path) -> dict[int, str]:
    """The live worker processes of the Ray session in ``ray_dir``, by pid, with their process titles."""
    pids: dict[int, str] = {}
    for log in (ray_dir / "session_latest" / "logs").glob("python-core-worker-*_*.log"):
        pid = int(log.stem.rpartition("_")[2])
        try:
            pids[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except FileNotFoundError:
            continue
    return pids
