"""SwanLab runs; offline by default (written under ``<log_dir>/swanlab`` for ``swanlab sync``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nemo_rl.config.logger import SwanlabConfig
from nemo_rl.utils.loggers.base import prefixed, require_package

# SwanLab calls uploading to its servers "online".
_SWANLAB_MODES = {"offline": "offline", "local": "local", "disabled": "disabled", "cloud": "online"}


class SwanlabBackend:
    """One SwanLab run per backend; SwanLab allows a single active run per process."""

    def __init__(self, cfg: SwanlabConfig, log_dir: Path) -> None:
        require_package("swanlab", "logger.swanlab_enabled", "uv sync")
        import swanlab

        if cfg.mode == "cloud" and not os.environ.get("SWANLAB_API_KEY"):
            raise RuntimeError(
                "logger.swanlab.mode=cloud needs SWANLAB_API_KEY in the environment (no interactive login is "
                "attempted). Export it, or use logger.swanlab.mode=offline and `swanlab sync` later."
            )
        self.log_dir = log_dir / "swanlab"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._run = swanlab.init(
            project=cfg.project,
            name=cfg.name,
            mode=_SWANLAB_MODES[cfg.mode],
            log_dir=str(self.log_dir),
            settings=swanlab.Settings(interactive=False),
        )

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        """Record the prefixed metrics at ``step``."""
        self._run.log(prefixed(metrics, prefix), step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Store the config as the run's config."""
        self._run.config.update(params)

    def close(self) -> None:
        """Finish the run, which flushes its run file."""
        self._run.finish()
