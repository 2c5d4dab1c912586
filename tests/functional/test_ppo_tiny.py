"""examples/run_ppo.py end to end on the tiny checkpoint, on one CPU worker slot shared by policy and critic.

Small batches and few steps: the pieces together (the critic's warm-up, GAE, both models' training, refit,
checkpoints and resume of both), not learning; docs/results.md has the learning run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kill_resume import kill_and_resume, step_metrics
from run_logs import read_records
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_ppo.py"
CONFIG = ROOT / "examples" / "configs" / "ppo_math_tiny.yaml"
TINY_SFT = ROOT / "examples" / "assets" / "tiny_math_sft"
TIMEOUT_S = 900


def _command(tmp: Path) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--config",
        str(CONFIG),
        f"policy.model_name={TINY_SFT}",
        "ppo.num_prompts_per_step=4",
        "ppo.num_generations_per_prompt=4",
        "ppo.max_num_steps=4",
        # Two policy passes per batch: the previous policy's log-probs come from a scoring pass of their own.
        "ppo.ppo_epochs=2",
        "ppo.critic_ppo_epochs=2",
        "ppo.policy_training_start_step=2",
        "ppo.val_period=2",
        "ppo.max_val_samples=16",
        "ppo.val_batch_size=16",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "value.train_global_batch_size=8",
        "value.train_micro_batch_size=8",
        "checkpointing.save_period=2",
        "checkpointing.save_consolidated=true",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        f"logger.log_dir={tmp / 'logs'}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
    ]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no safetensors in {folder}"
    return tensors


@pytest.mark.slow
def test_ppo_warms_up_the_critic_alone_and_resumes_both_models_after_kill_9_bit_exact(tmp_path: Path) -> None:
    # Four steps, killed (SIGKILL) at a random moment after step 3 logged, with the step-2 checkpoint the
    # latest: the rerun resumes policy and critic (weights, optimizers, schedules, RNG) and the loader, and
    # repeats every step the killed run logged after it bit for bit, the critic's metrics included.
    resumed = kill_and_resume(
        _command(tmp_path),
        log_dir=tmp_path / "logs",
        ckpt_dir=tmp_path / "ckpt",
        checkpoint_step=2,
        max_delay_s=2.0,
        timeout_s=TIMEOUT_S,
    )
    assert "train/critic/loss" in step_metrics(resumed.killed, 3)
    by_step: dict[int, dict[str, float]] = {}
    for record in read_records(tmp_path / "logs"):
        by_step.setdefault(record["step"], {}).update(record)
    for step in (1, 2, 3, 4):
        metrics = by_step[step]
        warm_up = step <= 2
        assert metrics["train/policy_trained"] == (0.0 if warm_up else 1.0), step
        assert ("train/loss" in metrics) is not warm_up, step
        for name in ("critic/loss", "critic/explained_var", "returns/mean", "advantages/mean"):
            assert f"train/{name}" in metrics, (step, name)
        # The engine samples from exactly the weights the policy scores with (measured when the policy trains).
        if not warm_up:
            assert metrics["train/gen_kl_error"] == pytest.approx(0.0, abs=1e-4), step
    assert by_step[3]["timing/train/logprobs"] > 0
    # The warm-up trained the critic alone: the policy's weights after step 2 are the checkpoint's, bit for
    # bit; the critic's were saved next to them, and the policy moved once it trained.
    start = _weights(TINY_SFT)
    after_warm_up = _weights(tmp_path / "ckpt" / "step_2" / "consolidated")
    assert after_warm_up.keys() == start.keys()
    for name, tensor in start.items():
        assert torch.equal(after_warm_up[name], tensor), f"{name} changed during the critic's warm-up"
    assert (tmp_path / "ckpt" / "step_2" / "value" / "weights").is_dir()
    trained = _weights(tmp_path / "ckpt" / "step_4" / "consolidated")
    assert any(not torch.equal(trained[name], tensor) for name, tensor in start.items())
