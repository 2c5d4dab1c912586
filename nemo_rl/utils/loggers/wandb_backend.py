"""Weights & Biases runs; offline by default (written under ``<log_dir>/wandb`` for ``wandb sync``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_rl.config.logger import WandbConfig
from nemo_rl.utils.loggers.base import prefixed, require_package


class WandbBackend:
    """One W&B run per backend; metrics go to its history at the given step."""

    def __init__(self, cfg: WandbConfig, log_dir: Path) -> None:
        require_package("wandb", "logger.wandb_enabled", "uv sync")
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        # W&B nests its own "wandb/" folder under ``dir``: runs land in <log_dir>/wandb/<run>.
        self._run = wandb.init(
            project=cfg.project,
            name=cfg.name,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=str(log_dir),
            # A second Logger in the same process (tests, evaluation after training) gets its own run
            # instead of W&B's default of handing back the active one.
            reinit="create_new",
        )
        self.run_dir = Path(self._run.dir).parent

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        """Add the prefixed metrics to the history row of ``step`` (W&B steps must not decrease)."""
        self._run.log(prefixed(metrics, prefix), step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Store the config as the run's config."""
        self._run.config.update(params, allow_val_change=True)

    def close(self) -> None:
        """Finish the run, which flushes the offline run files."""
        self._run.finish()
