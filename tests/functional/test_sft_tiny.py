"""examples/run_sft.py end to end on the tiny model: learning, kill-and-resume, the console, export, bad overrides.

Runs the real script in subprocesses, as a user would, and reads what it logged (metrics.jsonl) and wrote
(checkpoints, the exported Hugging Face folder).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kill_resume import kill_and_resume, script_env
from run_logs import read_records

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
        # One worker slot, as the test was sized (the recipe itself trains on two).
        "cluster.gpus_per_node=1",
        "policy.dtensor_cfg.data_parallel_mode=fsdp",
        "checkpointing.save_period=2",
        f"checkpointing.checkpoint_dir={tmp / name / 'ckpt'}",
        f"logger.log_dir={tmp / name / 'logs'}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
    ]


def _command(tmp: Path, name: str, max_steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--config", str(CONFIG), *_overrides(tmp, name, max_steps), *extra]


@pytest.mark.slow
def test_sft_learns_resumes_after_kill_and_exports(tmp_path: Path) -> None:
    # Four steps, killed (SIGKILL) at a random moment after step 3 logged its metrics: training, validating,
    # saving or exporting step 4, with the step-2 checkpoint the latest complete one. Rerun unchanged but for
    # the console (which only prints), it resumes from step 2 and repeats every step the killed run logged
    # after it bit for bit (RNG state, loader position, optimizer and scheduler all come back).
    cmd = _command(tmp_path, "run", 4, "checkpointing.save_consolidated=true")
    log_dir, ckpt = tmp_path / "run" / "logs", tmp_path / "run" / "ckpt"
    resumed = kill_and_resume(
        cmd,
        log_dir=log_dir,
        ckpt_dir=ckpt,
        checkpoint_step=2,
        max_delay_s=1.0,
        rerun_overrides=["logger.console_enabled=true"],
        timeout_s=TIMEOUT_S,
    )
    # save_consolidated puts a Hugging Face export of the step's weights next to the sharded checkpoint.
    assert (ckpt / "step_2" / "consolidated" / "config.json").is_file()
    _assert_compact_console(resumed.result, log_dir)
    records = read_records(log_dir)
    val_losses = [r["validation/val_loss"] for r in records if "validation/val_loss" in r]
    assert val_losses[-1] < val_losses[0], f"validation loss did not fall: {val_losses}"

    # The final export loads with transformers, with the training tokenizer.
    from transformers import AutoModelForCausalLM

    from nemo_rl.config.policy import PolicyConfig
    from nemo_rl.models.tokenizer import get_policy_tokenizer

    export = ckpt / "hf_final"
    # The exported tokenizer is the training one, not a model-family class that re-tokenizes differently.
    text = "What is 31-20?\n \\boxed{11}"
    trained_tok = get_policy_tokenizer(PolicyConfig(model_name=str(ROOT / "examples/assets/tiny_qwen2_init")))
    exported_tok = get_policy_tokenizer(PolicyConfig(model_name=str(export)))
    assert exported_tok.encode(text) == trained_tok.encode(text)
    assert exported_tok.decode(exported_tok.encode(text, add_special_tokens=False)) == text
    # The export holds the last step's weights (the same as that step's consolidated checkpoint).
    model = AutoModelForCausalLM.from_pretrained(export)
    reference = AutoModelForCausalLM.from_pretrained(ckpt / "step_4" / "consolidated")
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"exported {name} differs from the last checkpoint's"


def test_unknown_key_fails_fast_without_traceback() -> None:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(CONFIG), "policy.no_such_key=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=script_env(),
    )
    assert result.returncode == 2
    assert "policy.no_such_key" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 30


CONSOLE_STEP_LINE = re.compile(r"^\[sft (\d)/4\] loss \S+ · lr \S+ · [\d,]+ tok/s · \d+\.\d\d s$")
CONSOLE_VALIDATION_LINE = re.compile(
    r"^\[sft (\d)/4\] validation: val_loss \S+( \(step 0: \S+, best \S+\))? · [\d,]+ tokens$"
)


def _assert_compact_console(result: subprocess.CompletedProcess[str], log_dir: Path) -> None:
    """What a user sees of the resumed run: the compact console (the default ``logger.console``) prints one
    line per step and per validation and a summary table at the end; Ray's token notices, the workers'
    weight-loading bars and the bytecode warning stay off it."""
    lines = result.stdout.splitlines()
    steps = [int(m.group(1)) for line in lines if (m := CONSOLE_STEP_LINE.match(line))]
    validations = [int(m.group(1)) for line in lines if (m := CONSOLE_VALIDATION_LINE.match(line))]
    assert steps == [3, 4], result.stdout
    assert validations == [4], result.stdout
    summary = lines[lines.index(next(line for line in lines if line.startswith("── sft: steps 3-4 of 4"))) :]
    assert [row.split()[0] for row in summary[2:]][:3] == ["train/loss", "tokens/s", "validation/val_loss"]
    assert summary[-2] == f"  metrics: {log_dir / 'metrics.jsonl'}"
    # "Resuming", the steps, the validation, the export, "finished", then the summary (header, column names,
    # three rows, the note, the two files): nothing else on stdout.
    assert len(lines) == 1 + 2 + 1 + 2 + 8, result.stdout
    for noise in (
        "Token authentication",
        "authentication token",
        "Loading weights",
        "PYTHONDONTWRITEBYTECODE",
    ):
        assert noise not in result.stdout + result.stderr, noise
    # The console left the metrics alone: every one of them is in metrics.jsonl.
    train = [r for r in read_records(log_dir) if "train/loss" in r]
    assert {"train/grad_norm", "train/num_valid_tokens", "train/lr"} <= train[-1].keys()
