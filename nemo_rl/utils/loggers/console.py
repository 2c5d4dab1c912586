"""Compact per-step metric tables on stdout."""

from __future__ import annotations

import math
import shutil
from typing import Any

from tqdm import tqdm


def _format_value(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


def format_metrics_table(metrics: dict[str, float], step: int, prefix: str, width: int) -> str:
    """A header line naming the step and prefix, then ``name value`` cells packed into columns."""
    title = f" step {step}" + (f" · {prefix.rstrip('/')} " if prefix else " ")
    header = f"──{title}".ljust(min(width, 80), "─")
    if not metrics:
        return header
    names = list(metrics)
    values = [_format_value(metrics[name]) for name in names]
    name_w = max(len(n) for n in names)
    value_w = max(len(v) for v in values)
    cell_w = name_w + 1 + value_w
    num_columns = max(1, (width + 3) // (cell_w + 3))
    cells = [f"{n.ljust(name_w)} {v.rjust(value_w)}" for n, v in zip(names, values, strict=True)]
    rows = [" | ".join(cells[i : i + num_columns]) for i in range(0, len(cells), num_columns)]
    return "\n".join([header, *rows])


class ConsoleBackend:
    """Prints each ``log_metrics`` call as a small table (through tqdm so a progress bar stays intact)."""

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        """Print the table of ``metrics`` at ``step``; names are shown without the prefix."""
        width = shutil.get_terminal_size((110, 24)).columns
        tqdm.write(format_metrics_table(metrics, step, prefix, width))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Nothing: the example scripts already print the resolved config at start-up."""

    def close(self) -> None:
        """Nothing to release."""
