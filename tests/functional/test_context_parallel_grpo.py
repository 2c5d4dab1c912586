"""GRPO end to end with context parallelism: examples/run_grpo_math.py on the tiny checkpoint, the policy on two
CPU worker slots with ``policy.dtensor_cfg.context_parallel_size=2`` and its engine in the policy workers.

The engine samples with the unsplit model and the policy scores the samples split over two ranks, so
``train/gen_kl_error`` (their log-probability gap) near 0 says CP=2's log-probs are the unsplit ones through
the whole run: sharding by data-parallel group, refit and training. ``tests/distributed/test_context_parallel.py``
checks the numbers against CP=1 step by step.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from kill_resume import run_script, step_metrics
from run_logs import read_records

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_grpo_with_cp2_keeps_gen_kl_error_at_zero(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo_math.py"),
        "--config",
        str(ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"),
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "grpo.max_num_steps=2",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "cluster.gpus_per_node=2",
        "policy.dtensor_cfg.context_parallel_size=2",
        "policy.make_sequence_length_divisible_by=4",
        # The recipe's replicated DP mode and shared-prompt forward do not combine with CP.
        "policy.dtensor_cfg.data_parallel_mode=fsdp",
        "policy.shared_prefix.enabled=false",
        "checkpointing.enabled=false",
        f"logger.log_dir={tmp_path / 'logs'}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
    ]
    run_script(cmd)
    records = read_records(tmp_path / "logs")
    for step in (1, 2):
        metrics = step_metrics(records, step)
        assert metrics["train/gen_kl_error"] <= 1e-6, (step, metrics["train/gen_kl_error"])
        assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0, metrics
