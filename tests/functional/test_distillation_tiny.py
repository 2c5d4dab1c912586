"""On-policy distillation end to end on the tiny checkpoint.

The teacher is the student's own checkpoint, so before the first update the teacher's top-k distribution
and the student's agree exactly at every sampled position: a KL of zero there checks that the teacher's
top-k indices line up with the student's logits (same positions, same tokens, same temperature).
``run_distillation_math.py`` runs two steps with a checkpoint each and validation at start and end; it is
killed (SIGKILL) at a random moment after step 2 logged, rerun, and repeats step 2 bit for bit, and its last
checkpoint holds the state a resumed run starts from. The learning demo (a stronger teacher) is in
docs/algorithms/distillation.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kill_resume import kill_and_resume, step_metrics

from nemo_rl.algorithms.distillation import (
    DistillationState,
    MasterConfig,
    setup,
)
from nemo_rl.algorithms.loop import find_resume
from nemo_rl.config import load_and_validate
from nemo_rl.config.errors import UserError
from nemo_rl.data.datasets import setup_rl_data
from nemo_rl.models.tokenizer import get_policy_tokenizer
from nemo_rl.utils.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_distillation_math.py"
CONFIG = ROOT / "examples" / "configs" / "distillation_tiny_math.yaml"
TINY_SFT = ROOT / "examples" / "assets" / "tiny_math_sft"


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [
        f"policy.model_name={TINY_SFT}",
        f"teacher.model_name={TINY_SFT}",
        "distillation.num_prompts_per_step=8",
        "distillation.max_num_steps=2",
        "distillation.val_period=0",
        "distillation.val_at_start=true",
        "distillation.val_at_end=true",
        "distillation.max_val_samples=8",
        "distillation.val_batch_size=8",
        "distillation.topk_logits_k=8",
        "loss_fn.kl_type=forward",
        "policy.generation.max_new_tokens=12",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=8",
        "teacher.logprob_batch_size=8",
        "data.num_train_samples=32",
        "data.num_val_samples=8",
        "checkpointing.save_period=1",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"logger.log_dir={tmp_path / 'logs'}",
        "logger.console_enabled=false",
        "logger.progress_bar=false",
        *extra,
    ]


def _config(tmp_path: Path, *extra: str) -> MasterConfig:
    return load_and_validate(CONFIG, MasterConfig, _overrides(tmp_path, *extra))


@pytest.mark.slow
def test_distillation_from_an_identical_teacher_resumes_after_kill_9(tmp_path: Path) -> None:
    config = _config(tmp_path)
    tokenizer = get_policy_tokenizer(config.policy)
    train, val = setup_rl_data(config.data, tokenizer, max_total_sequence_length=64)
    # k larger than the vocabulary fails before any worker starts.
    with pytest.raises(UserError, match="topk_logits_k=1000 exceeds the vocabulary size"):
        setup(_config(tmp_path, "distillation.topk_logits_k=1000"), tokenizer, train, val)

    # run_distillation_math.py killed (SIGKILL) at a random moment after step 2 logged its training metrics
    # (validating or saving), then the same command again: it resumes from the step-1 checkpoint and samples,
    # scores, distils and validates step 2 bit for bit as the killed run did.
    resumed = kill_and_resume(
        [sys.executable, str(SCRIPT), "--config", str(CONFIG), *_overrides(tmp_path)],
        log_dir=tmp_path / "logs",
        ckpt_dir=tmp_path / "ckpt",
        checkpoint_step=1,
        max_delay_s=3.0,
    )
    assert len(step_metrics(resumed.killed, 2)) > 20
    by_step: dict[int, dict[str, float]] = {}
    for record in resumed.killed + resumed.rerun:
        by_step.setdefault(record["step"], {}).update(record)
    first, second = by_step[1], by_step[2]
    # Identical teacher and student before the first update: zero KL on every trained token.
    assert first["train/num_valid_tokens"] > 0
    assert first["train/forward_kl"] == pytest.approx(0.0, abs=1e-5)
    assert first["train/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert first["train/loss"] == pytest.approx(0.0, abs=1e-5)
    # So nothing to learn: a gradient of rounding noise only, and the student stays with the teacher; its
    # generation weights are refitted every step all the same.
    assert first["train/grad_norm"] < 1e-3
    assert second["train/forward_kl"] == pytest.approx(0.0, abs=1e-4)
    assert second["refit/bytes"] > 0
    for name in ("timing/train/teacher_topk_logits", "timing/train/policy_training", "train/reward"):
        assert name in second, sorted(second)
    assert "validation/accuracy" in by_step[0] and "validation/accuracy" in by_step[2]

    # The last checkpoint holds the loop state a resumed run starts from.
    resume = find_resume(CheckpointManager(config.checkpointing), "distillation")
    assert resume.path is not None and resume.path.name == "step_2"
    state = resume.state(DistillationState)
    assert state.step == 2 and state.val_accuracy == by_step[2]["validation/accuracy"]
    assert state.total_valid_tokens == first["train/num_valid_tokens"] + second["train/num_valid_tokens"]
