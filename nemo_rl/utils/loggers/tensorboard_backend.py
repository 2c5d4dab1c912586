"""TensorBoard event files under ``<log_dir>/<tensorboard.log_dir>``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nemo_rl.config.logger import TensorboardConfig
from nemo_rl.utils.loggers.base import prefixed, require_package


class TensorboardBackend:
    """Scalars via ``SummaryWriter.add_scalar``; the config as a text summary named ``hyperparams``."""

    def __init__(self, cfg: TensorboardConfig, log_dir: Path) -> None:
        require_package("tensorboard", "logger.tensorboard_enabled", "uv sync")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir / cfg.log_dir
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10)

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        """One scalar event per metric at ``step``."""
        for name, value in prefixed(metrics, prefix).items():
            self._writer.add_scalar(name, value, global_step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """The config as indented JSON in a text summary (TensorBoard's hparams view needs flat scalars)."""
        # Four leading spaces make TensorBoard's markdown renderer show it as a code block.
        text = "\n".join("    " + line for line in json.dumps(params, indent=2, default=str).splitlines())
        self._writer.add_text("hyperparams", text, global_step=0)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
