"""The console: a line per training step and per validation, the end-of-run summary, the full tables, and
metrics reaching the other backends unchanged whatever the console prints."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.config.logger import LoggerConfig
from nemo_rl.utils.logger import Logger
from nemo_rl.utils.loggers.console import Console, format_duration, format_number

NUM_STEPS = 12


def _run_loop(logger: Logger, num_steps: int = NUM_STEPS, val_period: int = 5) -> None:
    """What TrainLoop and a GRPO step log, in their order: refit, validation, train, timings, throughput."""
    progress = logger.progress_bar(total=num_steps, initial=0, desc="grpo")
    logger.log_metrics({"accuracy": 0.25, "num_samples": 256, "time_s": 1.5}, 0, prefix="validation")
    for step in range(1, num_steps + 1):
        logger.log_metrics({"refit/bytes": 3207680.0, "refit/time_s": 0.01}, step)
        if step % val_period == 0:
            accuracy = 0.25 + step / 100
            logger.log_metrics(
                {"accuracy": accuracy, "num_samples": 256, "time_s": 1.25}, step, prefix="validation"
            )
        train = {
            "loss": 0.002 - step / 1e4,
            "reward": 0.2 + step / 100,
            "lr": 3e-4,
            "grad_norm": 0.25,
            "mean_gen_tokens_per_sample": 16.5,
            "probs_ratio_clamped_min": 1.0,
        }
        logger.log_metrics(train, step, prefix="train")
        logger.log_metrics({"generation": 1.0, "total_step_time": 2.0}, step, prefix="timing/train")
        logger.log_metrics({"tokens_per_sec": 3000.0}, step, prefix="performance")
        progress.update(1)
    progress.close()


def _cfg(tmp_path: Path, **overrides: Any) -> LoggerConfig:
    fields: dict[str, Any] = {"log_dir": str(tmp_path / "logs"), "monitor_gpus": False, "progress_bar": False}
    return LoggerConfig(**(fields | overrides))


def test_compact_console_prints_a_line_per_step_and_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = Logger(_cfg(tmp_path))
    _run_loop(logger)
    logger.close()
    lines = capsys.readouterr().out.splitlines()

    step_lines = [line for line in lines if line.startswith("[grpo") and "validation" not in line]
    assert len(step_lines) == NUM_STEPS
    assert step_lines[0] == (
        "[grpo  1/12] reward 0.21 · loss 0.0019 · len 16.5 · lr 3.0e-04 · 3,000 tok/s · 2.00 s"
    )
    validation_lines = [line for line in lines if "] validation:" in line]
    assert validation_lines == [
        "[grpo  0/12] validation: accuracy 0.25 · 256 samples · 1.50 s",
        "[grpo  5/12] validation: accuracy 0.3 (step 0: 0.25, best 0.3) · 256 samples · 1.25 s",
        "[grpo 10/12] validation: accuracy 0.35 (step 0: 0.25, best 0.35) · 256 samples · 1.25 s",
    ]
    # A validation logged inside step 5 is shown after that step's line, not before it.
    assert lines.index(validation_lines[1]) == lines.index(step_lines[4]) + 1
    # Nothing of the refit, the timings' other phases or the loss's diagnostics.
    assert not any("refit" in line or "probs_ratio" in line or "generation" in line for line in lines)
    # Steps, validations, then the summary: nothing else.
    summary = lines[NUM_STEPS + len(validation_lines) :]
    assert summary[0].startswith("── grpo: steps 1-12 of 12 in 24.0 s (median step 2.00 s)")
    assert [line.split()[:3] for line in summary[2:4]] == [
        ["train/reward", "0.215", "0.315"],
        ["train/loss", "0.00185", "0.00085"],
    ]
    assert "validation/accuracy" in summary[6] and "0.35 (step 10)" in summary[6]
    assert summary[-2].endswith("metrics.jsonl") and summary[-1].endswith("training_curves.png")
    assert len(lines) == NUM_STEPS + 3 + 10


def test_every_metric_reaches_the_backends_whatever_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = {}
    for mode in ("compact", "full"):
        logger = Logger(_cfg(tmp_path / mode, console=mode))
        _run_loop(logger)
        logger.close()
        records[mode] = [json.loads(line) for line in (tmp_path / mode / "logs" / "metrics.jsonl").open()]
    assert records["compact"] == records["full"]
    assert len(records["compact"]) == 1 + NUM_STEPS * 4 + 2
    assert records["compact"][2]["train/probs_ratio_clamped_min"] == 1.0
    full = capsys.readouterr().out
    # The full tables show every metric, the summary follows them.
    assert "probs_ratio_clamped_min" in full and "── step 3 · train" in full and "refit/bytes" in full
    assert full.count("── grpo: steps 1-12 of 12") == 2


def test_console_off_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = Logger(_cfg(tmp_path, console_enabled=False))
    _run_loop(logger)
    logger.close()
    assert capsys.readouterr().out == ""


def test_progress_bar_shows_the_key_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logger = Logger(_cfg(tmp_path, progress_bar=True))
    _run_loop(logger)
    logger.close()
    bar = terminal.getvalue()
    assert "12/12" in bar and "reward 0.32 · val accuracy 0.35" in bar


def test_a_loop_without_progress_bar_still_gets_its_lines() -> None:
    console = Console("compact")
    assert console.log_metrics({"loss": 1.0}, 1, "train") == []
    assert console.log_metrics({"total_step_time": 0.5}, 1, "timing/train") == []
    # The next step's metrics complete the previous one; closing completes the last.
    assert console.log_metrics({"loss": 0.5}, 2, "train") == ["[train 1] loss 1 · 0.50 s"]
    assert console.close() == ["[train 2] loss 0.5"]
    assert console.summary()[0].startswith("── train: steps 1-2 in 0.5 s (median step 0.50 s) ───")


def test_sft_and_preference_figures() -> None:
    console = Console("compact")
    console.start_loop("rm", 1000)
    console.log_metrics({"loss": 0.69, "accuracy": 0.5, "lr": 1e-3, "num_valid_tokens": 640.0}, 7, "train")
    console.log_metrics({"total_step_time": 0.5}, 7, "timing/train")
    # Without performance/tokens_per_sec the line shows the trained tokens per second.
    assert console.finish_step() == ["[rm    7/1000] acc 0.5 · loss 0.69 · lr 1.0e-03 · 1,280 tok/s · 0.50 s"]
    lines = console.log_metrics({"loss": 2.5, "num_valid_tokens": 4096.0}, 0, "validation")
    assert lines == ["[rm    0/1000] validation: loss 2.5 · 4,096 tokens"]
    console.log_metrics({"loss": 2.0}, 10, "validation")
    console.log_metrics({"loss": 2.25}, 20, "validation")
    # Lower is better for a loss.
    assert console.summary()[-2].split()[:5] == ["validation/loss", "2.5", "2.25", "2", "(step"]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.26171875, "0.262"),
        (16.8125, "16.8"),
        (3606.4, "3,606"),
        (256.0, "256"),
        (-6.12e-4, "-0.000612"),
        (1.5e-5, "1.5e-05"),
        (float("nan"), "nan"),
    ],
)
def test_format_number(value: float, text: str) -> None:
    assert format_number(value) == text


def test_format_duration() -> None:
    assert [format_duration(s) for s in (42.14, 188.0, 7500.0)] == ["42.1 s", "3m08s", "2h05m"]
