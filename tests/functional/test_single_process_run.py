"""The tiny GRPO recipe in the driver's process (``cluster.single_process``, auto on this machine) against the
same run on Ray's workers: the same metrics bit for bit, and no Ray started."""

from __future__ import annotations

import sys
from pathlib import Path

from kill_resume import run_script, script_env, step_metrics
from run_logs import read_records

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_grpo_math.py"
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"


def _run(tmp: Path, mode: str) -> tuple[list[dict[str, object]], str]:
    log_dir = tmp / mode / "logs"
    result = run_script(
        [
            sys.executable,
            str(SCRIPT),
            "--config",
            str(CONFIG),
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "grpo.max_num_steps=2",
            "grpo.max_val_samples=16",
            "grpo.val_batch_size=16",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=8",
            f"cluster.single_process={mode}",
            f"checkpointing.checkpoint_dir={tmp / mode / 'ckpt'}",
            f"logger.log_dir={log_dir}",
            "logger.progress_bar=false",
        ],
        env={k: v for k, v in script_env().items() if k != "RAY_ADDRESS"},
    )
    return read_records(log_dir), result.stdout + result.stderr


def test_one_process_run_equals_the_ray_run_and_starts_no_ray(tmp_path: Path) -> None:
    one, one_output = _run(tmp_path, "auto")
    ray, ray_output = _run(tmp_path, "false")
    assert "Started a local Ray instance" in ray_output
    assert "Ray" not in one_output, one_output[-3000:]
    for step in (0, 1, 2):
        assert step_metrics(one, step) == step_metrics(ray, step), step
    assert "train/loss" in step_metrics(one, 2)
    # Both saved the same checkpoint layout (the worker in the driver writes what a Ray worker writes).
    saved = sorted(p.relative_to(tmp_path / "auto" / "ckpt") for p in (tmp_path / "auto" / "ckpt").rglob("*"))
    assert saved == sorted(
        p.relative_to(tmp_path / "false" / "ckpt") for p in (tmp_path / "false" / "ckpt").rglob("*")
    )
