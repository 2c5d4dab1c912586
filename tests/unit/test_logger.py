"""Logger fan-out: console, metrics.jsonl, TensorBoard, plots, sample dumps, resource monitor, null logger."""

from __future__ import annotations

import io
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import ValidationError

from nemo_rl.config.logger import GPUMonitoringConfig, LoggerConfig
from nemo_rl.utils.logger import Logger
from nemo_rl.utils.loggers import base as loggers_base
from nemo_rl.utils.plotting import collect_series, load_metrics_jsonl, plot_training_curves
from nemo_rl.utils.resource_monitor import ResourceMonitor


def _cfg(tmp_path: Path, **overrides: Any) -> LoggerConfig:
    """Quiet by default: no monitor thread and no bar unless a test asks for them."""
    fields: dict[str, Any] = {"log_dir": str(tmp_path / "logs"), "monitor_gpus": False, "progress_bar": False}
    fields.update(overrides)
    return LoggerConfig(**fields)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class RecordingBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        self.calls.append(("metrics", (dict(metrics), step, prefix)))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.calls.append(("hyperparams", params))

    def close(self) -> None:
        self.calls.append(("close", None))


def test_jsonl_full_console_and_prefixes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = Logger(_cfg(tmp_path, console="full"))
    logger.log_metrics(
        {"loss": torch.tensor(0.5), "reward": np.float32(0.25), "num_samples": 8}, 1, prefix="train"
    )
    logger.log_metrics({"accuracy": 0.75}, 1, prefix="validation")
    logger.log_metrics({"loss": 0.25}, 2, prefix="train")
    logger.log_hyperparams({"policy": {"lr": 1e-5}})
    logger.close()

    records = _read_jsonl(tmp_path / "logs" / "metrics.jsonl")
    assert records == [
        {"step": 1, "train/loss": 0.5, "train/reward": 0.25, "train/num_samples": 8.0},
        {"step": 1, "validation/accuracy": 0.75},
        {"step": 2, "train/loss": 0.25},
    ]
    assert json.loads((tmp_path / "logs" / "hyperparams.json").read_text()) == {"policy": {"lr": 1e-5}}
    out = capsys.readouterr().out
    assert "step 1 · train" in out and "step 1 · validation" in out
    assert "reward" in out and "0.25" in out and "num_samples" in out


def test_non_scalar_metric_is_rejected(tmp_path: Path) -> None:
    with Logger(_cfg(tmp_path, console_enabled=False)) as logger:
        with pytest.raises(TypeError, match="'rewards' is a list"):
            logger.log_metrics({"rewards": [1.0, 0.0]}, 1)
        with pytest.raises(TypeError, match="'logprobs' is a Tensor"):
            logger.log_metrics({"logprobs": torch.zeros(3)}, 1)


def test_null_logger_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg(tmp_path, console_enabled=False, jsonl_enabled=False, monitor_gpus=True)
    logger = Logger(cfg)
    assert not logger.enabled
    logger.log_metrics({"loss": 1.0}, 1, prefix="train")
    logger.log_hyperparams({"a": 1})
    assert logger.log_batched_dict_as_jsonl({"text": ["x"]}, "samples.jsonl") is None
    progress = logger.progress_bar(total=3)
    progress.update(1)
    progress.close()
    assert logger.close() is None
    assert not (tmp_path / "logs").exists()
    assert capsys.readouterr().out == ""
    disabled = Logger.disabled()
    assert not disabled.enabled
    disabled.close()


def test_extra_backends_receive_every_call(tmp_path: Path) -> None:
    recorder = RecordingBackend()
    logger = Logger(_cfg(tmp_path, console_enabled=False, jsonl_enabled=False), extra_backends=[recorder])
    logger.log_hyperparams({"seed": 1})
    logger.log_metrics({"loss": 2}, 3, prefix="train")
    logger.close()
    assert recorder.calls == [
        ("hyperparams", {"seed": 1}),
        ("metrics", ({"loss": 2.0}, 3, "train")),
        ("close", None),
    ]
    with pytest.raises(RuntimeError, match="after close"):
        logger.log_metrics({"loss": 1.0}, 4)


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = Logger(_cfg(tmp_path, console_enabled=False, tensorboard_enabled=True))
    for step, loss in enumerate([1.0, 0.5, 0.25], start=1):
        logger.log_metrics({"loss": loss}, step, prefix="train")
    logger.log_hyperparams({"policy": {"model_name": "tiny"}})
    logger.close()

    accumulator = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    accumulator.Reload()
    scalars = accumulator.Scalars("train/loss")
    assert [(e.step, e.value) for e in scalars] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    assert "hyperparams/text_summary" in accumulator.Tags()["tensors"]


def test_training_curves_png(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, console_enabled=False, plot_metrics=["train/loss", "validation/accuracy", "absent"])
    logger = Logger(cfg)
    for step in range(1, 6):
        logger.log_metrics({"loss": 1.0 / step, "reward": step}, step, prefix="train")
    logger.log_metrics({"accuracy": 0.5}, 5, prefix="validation")
    plot_path = logger.close()

    assert plot_path == tmp_path / "logs" / "training_curves.png"
    with Image.open(plot_path) as image:
        image.verify()
    with Image.open(plot_path) as image:
        assert image.format == "PNG"
        # Two metrics found ("absent" skipped): two panels side by side at 100 dpi.
        assert image.size == (1200, 350)


def test_plot_without_jsonl_uses_in_memory_history(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, console_enabled=False, jsonl_enabled=False, plot_metrics=["train/loss"])
    recorder = RecordingBackend()
    logger = Logger(cfg, extra_backends=[recorder])
    logger.log_metrics({"loss": 3.0}, 1, prefix="train")
    logger.log_metrics({"loss": 2.0}, 2, prefix="train")
    plot_path = logger.close()
    assert plot_path is not None and plot_path.stat().st_size > 0
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()


def test_no_plot_when_no_metric_was_logged(tmp_path: Path) -> None:
    logger = Logger(_cfg(tmp_path, console_enabled=False))
    logger.log_metrics({"other": 1.0}, 1)
    assert logger.close() is None
    assert not (tmp_path / "logs" / "training_curves.png").exists()
    assert plot_training_curves([], ["train/loss"], tmp_path / "x.png") is None


def test_series_keep_last_value_per_step_and_skip_truncated_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 2, "train/loss": 0.5}\n{"step": 1, "train/loss": 1.0}\n'
        '{"step": 2, "train/loss": 0.4}\n{"step": 3, "train/lo'
    )
    records = load_metrics_jsonl(path)
    assert len(records) == 3
    assert collect_series(records, ["train/loss", "x"]) == {"train/loss": ([1, 2], [1.0, 0.4])}


def test_sample_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = Logger(_cfg(tmp_path, num_val_samples_to_print=1))
    batch = {
        "content": ["1+1=2", "2+2=5"],
        "rewards": torch.tensor([1.0, 0.0]),
        "input_ids": torch.tensor([[1, 2], [3, 4]]),
        "step": 7,
    }
    path = logger.log_batched_dict_as_jsonl(batch, "train_data_step7.jsonl")
    assert path is not None
    assert _read_jsonl(path) == [
        {"content": "1+1=2", "rewards": 1.0, "input_ids": [1, 2], "step": 7},
        {"content": "2+2=5", "rewards": 0.0, "input_ids": [3, 4], "step": 7},
    ]
    with pytest.raises(ValueError, match="different lengths"):
        logger.log_batched_dict_as_jsonl({"a": [1, 2], "b": [1]}, "bad.jsonl")
    strings = logger.log_string_list_as_jsonl(["a", 'b"c'], "strings.jsonl")
    assert strings is not None and _read_jsonl(strings) == ["a", 'b"c']

    logger.print_samples(["first sample", "second sample"], step=7)
    out = capsys.readouterr().out
    assert "first sample" in out and "second sample" not in out and "(1 of 2)" in out
    logger.close()


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_terminal_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = _FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    logger = Logger(_cfg(tmp_path, console_enabled=False, progress_bar=True))
    bar = logger.progress_bar(total=10, initial=4, desc="grpo")
    bar.update(2)
    assert bar.n == 6 and bar.total == 10
    bar.close()
    assert "grpo" in terminal.getvalue() and "6/10" in terminal.getvalue()

    # Batch jobs (stderr not a terminal) and progress_bar=false get no bar.
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert logger.progress_bar(total=3).disable
    quiet = Logger(_cfg(tmp_path, console_enabled=False, progress_bar=False))
    monkeypatch.setattr(sys, "stderr", terminal)
    silent = quiet.progress_bar(total=2)
    silent.update(2)
    assert silent.disable and silent.n == 2
    logger.close()
    quiet.close()


def test_missing_backend_package_names_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = loggers_base.importlib.util.find_spec
    monkeypatch.setattr(
        loggers_base.importlib.util,
        "find_spec",
        lambda name: None if name == "mlflow" else real_find_spec(name),
    )
    with pytest.raises(ImportError, match=r"logger.mlflow_enabled=true.*`uv sync --extra mlflow`"):
        Logger(_cfg(tmp_path, mlflow_enabled=True, tensorboard_enabled=True))
    # Checked before any backend starts: no event file or metrics file was created.
    assert not (tmp_path / "logs").exists()


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValidationError, match="flush_interval"):
        GPUMonitoringConfig(collection_interval=10, flush_interval=1)
    with pytest.raises(ValidationError, match="Extra inputs"):
        LoggerConfig.model_validate({"wandb": {"projekt": "x"}})
    with pytest.raises(ValidationError, match="mode"):
        LoggerConfig.model_validate({"swanlab": {"mode": "online-ish"}})


def test_resource_monitor_sample_and_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    fake.NVMLError = NVMLError  # type: ignore[attr-defined]
    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]
    fake.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=40 + 10 * h)  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        used=(h + 1) * 1024**3, total=8 * 1024**3
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)

    flushed: list[dict[str, float]] = []
    monitor = ResourceMonitor(
        GPUMonitoringConfig(collection_interval=0.01, flush_interval=0.02), flushed.append
    )
    monitor.start()
    deadline = time.monotonic() + 20
    while not flushed and time.monotonic() < deadline:
        time.sleep(0.01)
    monitor.stop()
    assert not monitor.running
    assert flushed, "the monitor never flushed"
    sample = flushed[0]
    assert sample["gpu0/utilization_percent"] == 40.0 and sample["gpu1/utilization_percent"] == 50.0
    assert sample["gpu1/memory_used_gb"] == 2.0 and sample["gpu0/memory_percent"] == 12.5
    assert 0.0 < sample["ram_percent"] <= 100.0
    assert sample["process_tree_rss_gb"] > 0.0
    assert sample["ram_used_gb"] > 0.0
    assert "cpu_percent" in sample and "process_tree_cpu_percent" in sample


def test_monitor_logs_system_metrics_through_logger(tmp_path: Path) -> None:
    cfg = _cfg(
        tmp_path,
        console_enabled=False,
        monitor_gpus=True,
        gpu_monitoring=GPUMonitoringConfig(collection_interval=0.02, flush_interval=0.04),
    )
    logger = Logger(cfg)
    logger.log_metrics({"loss": 1.0}, 5, prefix="train")
    metrics_path = tmp_path / "logs" / "metrics.jsonl"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "system/" not in metrics_path.read_text():
        time.sleep(0.02)
    logger.close()
    system = [r for r in _read_jsonl(metrics_path) if "system/ram_percent" in r]
    assert system, "no system metrics were logged"
    assert system[0]["step"] == 5  # attached to the latest training step
    assert "system/process_tree_rss_gb" in system[0]
