"""Schema of the ``logger`` section: which metric backends are on, where they write, and what is monitored.

Key names follow NeMo RL's recipes (``logger.wandb_enabled``, ``logger.wandb.project``,
``logger.gpu_monitoring.collection_interval``...). Every backend writes under ``log_dir`` and none of the
defaults needs a network connection or a login.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel


class WandbConfig(ConfigModel):
    """Weights & Biases run settings."""

    project: str = "nemo-rl"
    """W&B project the run belongs to."""

    name: str | None = None
    """Run name; ``None`` lets W&B generate one."""

    entity: str | None = None
    """W&B team or user owning the project (online mode); ``None`` uses the logged-in user's default."""

    mode: Literal["offline", "online"] = "offline"
    """``offline`` writes the run under ``<log_dir>/wandb`` for a later ``wandb sync`` and never waits for a
    login; ``online`` streams to the W&B server and needs ``WANDB_API_KEY`` or a prior ``wandb login``."""

    log_nemo_gym_full_result_tables: bool = False
    """Accepted, no effect here: NeMo-Gym rollouts are not built."""


class TensorboardConfig(ConfigModel):
    """TensorBoard event-file settings."""

    log_dir: str = "tensorboard"
    """Directory of the event files; a relative path is taken under ``logger.log_dir``."""


class MLflowConfig(ConfigModel):
    """MLflow tracking settings."""

    experiment_name: str = "nemo-rl"
    """MLflow experiment the run is filed under (created when missing)."""

    run_name: str | None = None
    """Run name; ``None`` lets MLflow generate one."""

    tracking_uri: str | None = None
    """Tracking server or store URI; ``None`` uses a local SQLite store at ``<log_dir>/mlflow.db``."""


class SwanlabConfig(ConfigModel):
    """SwanLab run settings."""

    project: str = "nemo-rl"
    """SwanLab project the run belongs to."""

    name: str | None = None
    """Experiment name; ``None`` lets SwanLab generate one."""

    mode: Literal["offline", "local", "disabled", "cloud"] = "offline"
    """``offline`` saves the run under ``<log_dir>/swanlab`` for a later ``swanlab sync``; ``local`` also keeps
    it viewable with ``swanlab watch``; ``disabled`` records nothing; ``cloud`` uploads (SwanLab's "online"
    mode) and needs ``SWANLAB_API_KEY``. No mode waits for an interactive login."""


class GPUMonitoringConfig(ConfigModel):
    """Sampling of CPU, memory and GPU use by the background resource monitor."""

    collection_interval: float = Field(default=10.0, gt=0.0)
    """Seconds between two samples."""

    flush_interval: float = Field(default=10.0, gt=0.0)
    """Seconds between two writes of the averaged samples to the logger (``system/...`` metrics)."""

    @model_validator(mode="after")
    def _flush_not_faster_than_collection(self) -> GPUMonitoringConfig:
        if self.flush_interval < self.collection_interval:
            raise ValueError(
                f"logger.gpu_monitoring.flush_interval ({self.flush_interval}) is shorter than "
                f"collection_interval ({self.collection_interval}): every flush needs at least one sample. "
                "Raise flush_interval or lower collection_interval."
            )
        return self


class LoggerConfig(ConfigModel):
    """Metric logging: backends, sample dumps, progress bar, resource monitoring and end-of-run plots."""

    log_dir: str = "logs"
    """Directory every backend writes under (``metrics.jsonl``, event files, offline runs, plots)."""

    wandb_enabled: bool = False
    """Log to Weights & Biases (see ``wandb``)."""

    tensorboard_enabled: bool = False
    """Write TensorBoard event files (see ``tensorboard``)."""

    mlflow_enabled: bool = False
    """Log to MLflow (see ``mlflow``; needs the ``mlflow`` extra)."""

    swanlab_enabled: bool = False
    """Log to SwanLab (see ``swanlab``)."""

    console_enabled: bool = True
    """Print the run's progress to stdout (what, ``console`` says) and a summary table at the end."""

    console: Literal["compact", "full"] = "compact"
    """What the console prints: ``compact``, one line per training step (its reward or loss, the loop's key
    metric, learning rate, tokens/s, step time) and one per validation; ``full``, a table of every metric of
    every ``log_metrics`` call instead. Either way every metric reaches the other backends unchanged."""

    jsonl_enabled: bool = True
    """Append every logged metric dict as one JSON object to ``<log_dir>/metrics.jsonl``."""

    monitor_gpus: bool = True
    """Run the background resource monitor (CPU, RAM, and GPU when NVML sees one) logging ``system/...``."""

    num_val_samples_to_print: int = Field(default=0, ge=0)
    """How many validation samples (prompt + response) to print at each validation."""

    progress_bar: bool = True
    """Show a tqdm progress bar over the training steps (step/total, ETA, key figures) when stderr is a
    terminal."""

    plot_metrics: list[str] = Field(
        default_factory=lambda: ["train/loss", "train/reward", "validation/accuracy", "validation/val_loss"]
    )
    """Metrics drawn into ``<log_dir>/training_curves.png`` when the logger closes (missing ones are
    skipped; an empty list writes no plot)."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases settings, used when ``wandb_enabled``."""

    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    """TensorBoard settings, used when ``tensorboard_enabled``."""

    mlflow: MLflowConfig = Field(default_factory=MLflowConfig)
    """MLflow settings, used when ``mlflow_enabled``."""

    swanlab: SwanlabConfig = Field(default_factory=SwanlabConfig)
    """SwanLab settings, used when ``swanlab_enabled``."""

    gpu_monitoring: GPUMonitoringConfig = Field(default_factory=GPUMonitoringConfig)
    """Resource monitor intervals, used when ``monitor_gpus``."""
