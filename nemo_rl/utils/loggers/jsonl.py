"""Metrics as JSON lines: ``<log_dir>/metrics.jsonl``, one object per ``log_metrics`` call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nemo_rl.utils.loggers.base import prefixed

METRICS_FILE = "metrics.jsonl"
HYPERPARAMS_FILE = "hyperparams.json"


class JsonlBackend:
    """Appends ``{"step": N, "<prefix>/<name>": value, ...}`` lines; a resumed run keeps appending."""

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / METRICS_FILE
        self._hyperparams_path = log_dir / HYPERPARAMS_FILE
        # Line-buffered so a crashed run still leaves every completed line on disk.
        self._file = self.path.open("a", buffering=1)

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        """Append one line holding ``step`` and the prefixed metric names."""
        record: dict[str, Any] = {"step": step, **prefixed(metrics, prefix)}
        self._file.write(json.dumps(record) + "\n")

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Write the config to ``<log_dir>/hyperparams.json`` (non-JSON values as their ``str``)."""
        self._hyperparams_path.write_text(json.dumps(params, indent=2, default=str))

    def close(self) -> None:
        """Close the metrics file."""
        self._file.close()
