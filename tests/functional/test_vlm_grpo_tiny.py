"""examples/run_vlm_grpo.py end to end on the tiny recipe: the warmed-up tiny Qwen2.5-VL samples answers to
tiny_clevr pictures with the embedded engine, the counting verifier scores them, and the policy trains on the
images with its responses.

Small batches and few steps: the pieces together (images through rollouts, refit, validation, checkpoints and
a bit-exact resume after SIGKILL), not learning; docs/results.md has the learning run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kill_resume import kill_and_resume, step_metrics

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_vlm_grpo.py"
CONFIG = ROOT / "examples" / "configs" / "vlm_grpo_tiny.yaml"
TIMEOUT_S = 900


def _command(tmp: Path) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--config",
        str(CONFIG),
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_num_steps=3",
        "grpo.val_period=2",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        "data.num_train_samples=64",
        "data.num_val_samples=8",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "checkpointing.save_period=1",
        # Every checkpoint kept: the recipe's keep_top_k would drop step 1 once step 3 is saved before the kill.
        "checkpointing.keep_top_k=null",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        f"logger.log_dir={tmp / 'logs'}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
    ]


@pytest.mark.slow
def test_vlm_grpo_trains_on_images_and_resumes_bit_exact_after_kill(tmp_path: Path) -> None:
    # Three steps, killed at a random moment after step 2 logged with the step-1 checkpoint the latest: the
    # rerun repeats steps 2 and 3 (their images, samples, rewards, losses) bit for bit.
    resumed = kill_and_resume(
        _command(tmp_path),
        log_dir=tmp_path / "logs",
        ckpt_dir=tmp_path / "ckpt",
        checkpoint_step=1,
        max_delay_s=2.0,
        timeout_s=TIMEOUT_S,
    )
    step2 = step_metrics(resumed.killed, 2)
    # The warmed-up model answers in the verifier's format, so the groups carry a learning signal; the
    # engine samples from exactly the weights the policy scores with (refit of the vision tower included).
    assert 0.0 < step2["train/reward"] <= 1.0
    assert step2["train/gen_kl_error"] == pytest.approx(0.0, abs=1e-4)
    assert "train/tiny_clevr/accuracy" in step2
