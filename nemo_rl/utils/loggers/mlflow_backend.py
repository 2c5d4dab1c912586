"""MLflow runs; by default in a SQLite store at ``<log_dir>/mlflow.db`` (the ``mlflow`` extra)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from nemo_rl.config.logger import MLflowConfig
from nemo_rl.utils.loggers.base import flatten_params, prefixed, require_package

# MLflow's limits per log_batch call and per parameter value.
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE_CHARS = 6000


class MlflowBackend:
    """One MLflow run, driven through ``MlflowClient`` so no global "active run" state is touched."""

    def __init__(self, cfg: MLflowConfig, log_dir: Path) -> None:
        require_package("mlflow", "logger.mlflow_enabled", "uv sync --extra mlflow")
        from mlflow.tracking import MlflowClient

        log_dir.mkdir(parents=True, exist_ok=True)
        artifact_location: str | None = None
        if cfg.tracking_uri is None:
            tracking_uri = f"sqlite:///{(log_dir / 'mlflow.db').resolve()}"
            # Without this MLflow puts artifacts under ./mlruns of whatever the working directory is.
            artifact_location = (log_dir / "mlflow_artifacts").resolve().as_uri()
        else:
            tracking_uri = cfg.tracking_uri
        self.tracking_uri = tracking_uri
        self._client = MlflowClient(tracking_uri=tracking_uri)
        experiment = self._client.get_experiment_by_name(cfg.experiment_name)
        if experiment is None:
            experiment_id = self._client.create_experiment(
                cfg.experiment_name, artifact_location=artifact_location
            )
        else:
            experiment_id = experiment.experiment_id
        self.run_id: str = self._client.create_run(experiment_id, run_name=cfg.run_name).info.run_id

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        """Record the prefixed metrics at ``step``."""
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)
        entries = [Metric(k, v, timestamp_ms, step) for k, v in prefixed(metrics, prefix).items()]
        for start in range(0, len(entries), _MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=entries[start : start + _MAX_METRICS_PER_BATCH])

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the config as flat dotted parameters (values cut to MLflow's length limit)."""
        from mlflow.entities import Param

        entries = [Param(k, str(v)[:_MAX_PARAM_VALUE_CHARS]) for k, v in flatten_params(params).items()]
        for start in range(0, len(entries), _MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=entries[start : start + _MAX_PARAMS_PER_BATCH])

    def close(self) -> None:
        """Mark the run finished."""
        self._client.set_terminated(self.run_id)
