"""The MLflow backend: metrics and params read back through MLflow's client from the local SQLite store."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl.config.logger import LoggerConfig, MLflowConfig
from nemo_rl.utils.logger import Logger

pytest.importorskip("mlflow", reason="the mlflow extra is not installed (uv sync --extra mlflow)")


def test_mlflow_local_store_holds_metrics_and_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)  # anything MLflow writes outside log_dir would show up here
    cfg = LoggerConfig(
        log_dir=str(tmp_path / "logs"),
        mlflow_enabled=True,
        mlflow=MLflowConfig(experiment_name="unit", run_name="local-check"),
        console_enabled=False,
        jsonl_enabled=False,
        monitor_gpus=False,
        progress_bar=False,
        plot_metrics=[],
    )
    logger = Logger(cfg)
    logger.log_hyperparams({"policy": {"model_name": "tiny", "optimizer": {"lr": 1e-5}}})
    for step, loss in [(1, 1.5), (2, 0.75)]:
        logger.log_metrics({"loss": loss}, step, prefix="train")
    logger.close()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'logs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("unit")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "local-check"
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.5), (2, 0.75)]
    assert run.data.params == {"policy.model_name": "tiny", "policy.optimizer.lr": "1e-05"}
