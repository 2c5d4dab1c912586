"""The SwanLab backend in offline mode: the run file written under log_dir holds the logged scalars."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl.config.logger import LoggerConfig, SwanlabConfig
from nemo_rl.utils.logger import Logger


def test_swanlab_offline_run_holds_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)  # anything SwanLab writes outside log_dir would show up here
    cfg = LoggerConfig(
        log_dir=str(tmp_path / "logs"),
        swanlab_enabled=True,
        swanlab=SwanlabConfig(project="unit", name="offline-check"),
        console_enabled=False,
        monitor_gpus=False,
        progress_bar=False,
        plot_metrics=[],
    )
    logger = Logger(cfg)
    logger.log_hyperparams({"policy": {"model_name": "tiny"}})
    for step, loss in [(1, 1.5), (2, 0.75)]:
        logger.log_metrics({"loss": loss}, step, prefix="train")
    logger.close()

    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    run_files = list((tmp_path / "logs" / "swanlab").glob("run-*/run-*.swanlab"))
    assert len(run_files) == 1, f"expected one SwanLab run under log_dir, found {run_files}"
    reader = DataStoreReader()
    reader.open(run_files[0])
    scalars = []
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("scalar"):
            scalars.append((record.scalar.key, record.scalar.step, record.scalar.value.number))
    reader.close()
    assert scalars == [("train/loss", 1, 1.5), ("train/loss", 2, 0.75)]
    config_files = list((tmp_path / "logs" / "swanlab").glob("run-*/files/config.yaml"))
    assert config_files and "tiny" in config_files[0].read_text()


def test_swanlab_cloud_mode_without_key_fails_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    cfg = LoggerConfig(
        log_dir=str(tmp_path / "logs"),
        swanlab_enabled=True,
        swanlab=SwanlabConfig(mode="cloud"),
        jsonl_enabled=False,
        monitor_gpus=False,
    )
    with pytest.raises(RuntimeError, match="SWANLAB_API_KEY"):
        Logger(cfg)
