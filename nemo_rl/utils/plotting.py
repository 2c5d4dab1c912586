"""End-of-run training curves: selected metrics against step, drawn to a PNG with matplotlib (Agg, no display)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def load_metrics_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (one dict per line; blank or truncated last lines skipped)."""
    records = []
    lines = Path(path).read_text().splitlines()
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # Only the last line can be cut short by a crash mid-write; anything else is real corruption.
            if index == len(lines) - 1:
                break
            raise
    return records


def collect_series(
    records: Iterable[Mapping[str, Any]], metric_names: Sequence[str]
) -> dict[str, tuple[list[int], list[float]]]:
    """``{name: (steps, values)}`` for the metrics present in ``records``, sorted by step.

    When a step was logged more than once (a resumed run appending to the same file), the last value wins.
    """
    by_metric: dict[str, dict[int, float]] = {name: {} for name in metric_names}
    for record in records:
        step = record.get("step")
        if step is None:
            continue
        for name in metric_names:
            value = record.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                by_metric[name][int(step)] = float(value)
    series = {}
    for name, points in by_metric.items():
        if points:
            steps = sorted(points)
            series[name] = (steps, [points[s] for s in steps])
    return series


def plot_training_curves(
    records: Iterable[Mapping[str, Any]], metric_names: Sequence[str], out_path: Path | str
) -> Path | None:
    """Draw one panel per metric of ``metric_names`` found in ``records`` into ``out_path``.

    Returns the written path, or ``None`` (writing nothing) when none of the metrics was logged.
    """
    series = collect_series(records, metric_names)
    if not series:
        return None
    # A bare Figure renders through Agg without pyplot, so no display is needed and the process-wide
    # pyplot backend and figure registry stay untouched.
    from matplotlib.figure import Figure

    num_panels = len(series)
    num_cols = min(2, num_panels)
    num_rows = math.ceil(num_panels / num_cols)
    fig = Figure(figsize=(6 * num_cols, 3.5 * num_rows))
    axes = fig.subplots(num_rows, num_cols, squeeze=False)
    for ax, (name, (steps, values)) in zip(axes.flat, series.items(), strict=False):
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[num_panels:]:
        ax.set_visible(False)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    return out_path
