"""The protocol every metric backend implements, and helpers the backends share."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class LoggerBackend(Protocol):
    """One destination for metrics (console, JSONL file, TensorBoard, W&B, SwanLab, MLflow...)."""

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        """Record scalar ``metrics`` at ``step``, their names prefixed with ``<prefix>/`` when given."""
        ...

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the run's (possibly nested) configuration."""
        ...

    def close(self) -> None:
        """Flush and release everything the backend holds; it is not used afterwards."""
        ...


def prefixed(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    """``metrics`` with every name turned into ``<prefix>/<name>`` (unchanged for an empty prefix)."""
    if not prefix:
        return dict(metrics)
    stem = prefix.rstrip("/")
    return {f"{stem}/{name}": value for name, value in metrics.items()}


def flatten_params(params: Mapping[str, Any], parent: str = "") -> dict[str, Any]:
    """Nested dicts flattened to dotted keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``), for flat stores."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}.{key}" if parent else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_params(value, name))
        else:
            flat[name] = value
    return flat


def require_package(module: str, enabled_flag: str, install_hint: str) -> None:
    """Fail at start-up, naming the install command, when an enabled backend's package is missing."""
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"{enabled_flag}=true needs the '{module}' package, which is not installed. "
            f"Install it with `{install_hint}`, or set {enabled_flag}=false."
        )
