"""examples/run_sft.py end to end on the tiny model: learning, kill-and-resume, export, bad overrides.

Runs the real script in subprocesses, as a user would, and reads what it logged (metrics.jsonl) and wrote
(checkpoints, the exported Hugging Face folder).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_sft.py"
CONFIG = ROOT / "examples" / "configs" / "sft_tiny_math.yaml"
TIMEOUT_S = 600


def _overrides(tmp: Path, name: str, max_steps: int) -> list[str]:
    return [
        f"sft.max_num_steps={max_steps}",
        "sft.val_period=2",
        "sft.val_batches=1",
        "sft.val_global_batch_size=32",
        "sft.val_micro_batch_size=32",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=16",
        "data.num_train_samples=256",
        "data.num_val_samples=32",
        "checkpointing.save_period=2",
        f"checkpointing.checkpoint_dir={tmp / name / 'ckpt'}",
        f"logger.log_dir={tmp / name / 'logs'}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
    ]


def _command(tmp: Path, name: str, max_steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--config", str(CONFIG), *_overrides(tmp, name, max_steps), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def _metrics(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]


def _step_metrics(records: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """A step's ``train/`` and ``validation/`` metrics (the last logged of each; timings differ per run)."""
    merged: dict[str, Any] = {}
    for record in records:
        if record["step"] == step:
            merged.update({k: v for k, v in record.items() if k.startswith(("train/", "validation/"))})
    return merged


def _kill_after_first_checkpoint(tmp: Path) -> None:
    """Run the test's command and kill it (SIGKILL) as soon as its step-2 checkpoint is complete."""
    cmd = _command(tmp, "killed", 4)
    ckpt = tmp / "killed" / "ckpt" / "step_2"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env())
    deadline = time.monotonic() + TIMEOUT_S
    while not ckpt.exists():
        if proc.poll() is not None:
            output = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"run ended before its first checkpoint:\n{output[-5000:]}")
        assert time.monotonic() < deadline, "no checkpoint within the time limit"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


@pytest.mark.slow
def test_sft_learns_resumes_after_kill_and_exports(tmp_path: Path) -> None:
    # Uninterrupted reference run: 4 steps. It runs alongside the run that gets killed (each is one worker
    # with one thread, mostly waiting on start-up), which halves the test's wall time on two cores.
    reference_log = tmp_path / "full_run.out"
    with reference_log.open("wb") as out:
        full_run = subprocess.Popen(
            _command(tmp_path, "full", 4, "checkpointing.save_consolidated=true"),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
    try:
        _kill_after_first_checkpoint(tmp_path)
        full_run.wait(timeout=TIMEOUT_S)
    finally:
        if full_run.poll() is None:
            full_run.kill()
            full_run.wait(timeout=60)
    assert full_run.returncode == 0, f"the reference run failed:\n{reference_log.read_text()[-5000:]}"

    full = _metrics(tmp_path / "full" / "logs")
    # save_consolidated puts a Hugging Face export of the step's weights next to the sharded checkpoint.
    assert (tmp_path / "full" / "ckpt" / "step_2" / "consolidated" / "config.json").is_file()
    val_losses = [r["validation/val_loss"] for r in full if "validation/val_loss" in r]
    assert val_losses[-1] < val_losses[0], f"validation loss did not fall: {val_losses}"

    # The killed command, rerun unchanged: it resumes from step 2 and every later step's metrics are the
    # uninterrupted run's, bit for bit (RNG state, loader position, optimizer and scheduler all come back).
    resumed = _run(_command(tmp_path, "killed", 4))
    assert "Resuming SFT from" in resumed.stdout and "(step 2)" in resumed.stdout, resumed.stdout[-3000:]
    records = _metrics(tmp_path / "killed" / "logs")
    for step in (3, 4):
        got, expected = _step_metrics(records, step), _step_metrics(full, step)
        assert "train/loss" in expected and got == expected, (step, got, expected)

    # The final export loads with transformers and agrees with the policy's last checkpoint.
    from transformers import AutoModelForCausalLM

    from nemo_rl.config.policy import PolicyConfig
    from nemo_rl.models.tokenizer import get_policy_tokenizer

    export = tmp_path / "killed" / "ckpt" / "hf_final"
    # The exported tokenizer is the training one, not a model-family class that re-tokenizes differently.
    text = "What is 31-20?\n \\boxed{11}"
    trained_tok = get_policy_tokenizer(PolicyConfig(model_name=str(ROOT / "examples/assets/tiny_qwen2_init")))
    exported_tok = get_policy_tokenizer(PolicyConfig(model_name=str(export)))
    assert exported_tok.encode(text) == trained_tok.encode(text)
    assert exported_tok.decode(exported_tok.encode(text, add_special_tokens=False)) == text
    model = AutoModelForCausalLM.from_pretrained(export)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "ckpt" / "hf_final")
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"exported {name} differs after resume")


def test_unknown_key_fails_fast_without_traceback() -> None:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(CONFIG), "policy.no_such_key=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert result.returncode == 2
    assert "policy.no_such_key" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 30
