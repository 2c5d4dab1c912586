"""Routing replay end to end (``policy.router_replay.enabled``): GRPO on the tiny Qwen3-MoE with a bfloat16
embedded engine (in the float32 policy's workers), whose routing the policy's forwards replay. The same first
step without replay samples the same tokens (same seed and weights; recording changes no sample), so its
``train/gen_kl_error`` is the baseline the replayed run must not exceed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600


def _run_grpo(log_dir: Path, steps: int, *overrides: str) -> dict[int, dict[str, Any]]:
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo_math.py"),
        "--config",
        str(ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"),
        "policy.model_name=examples/assets/tiny_qwen3_moe_init",
        "policy.generation.embedded_cfg.precision=bfloat16",
        f"grpo.max_num_steps={steps}",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "checkpointing.enabled=false",
        f"checkpointing.checkpoint_dir={log_dir / 'ckpt'}",
        f"logger.log_dir={log_dir}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
        *overrides,
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    by_step: dict[int, dict[str, Any]] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    return by_step


def test_grpo_with_router_replay_lowers_gen_kl_error(tmp_path: Path) -> None:
    replayed = _run_grpo(tmp_path / "replay", 2, "policy.router_replay.enabled=true")
    baseline = _run_grpo(tmp_path / "plain", 1)
    for step in (1, 2):
        assert 0.0 < replayed[step]["train/gen_kl_error"] <= 1e-4, step
        assert "train/moe_router_entropy" in replayed[step]
    print("gen_kl_error step 1:", baseline[1]["train/gen_kl_error"], "->", replayed[1]["train/gen_kl_error"])
    assert replayed[1]["train/gen_kl_error"] <= baseline[1]["train/gen_kl_error"]
