"""Wall-clock timers for the algorithm loops, and the deadline check behind ``checkpoint_must_save_by``.

A :class:`Timer` records every measured interval per label; algorithms log them once per step as
``timing/train/<label>`` and then :meth:`Timer.reset`. Labels are free-form and may be hierarchical
(``"train/generation"``); intervals with different labels may overlap or nest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

Reduction = Literal["sum", "mean", "max", "min"]


class Timer:
    """Accumulates elapsed seconds per label.

    Example::

        timer = Timer()
        with timer.time("generation"):
            ...
        logger.log_metrics(timer.get_timing_metrics("sum"), step, prefix="timing/train")
        timer.reset()
    """

    def __init__(self) -> None:
        self._intervals_s: dict[str, list[float]] = {}
        self._started_at: dict[str, float] = {}

    def start(self, label: str) -> None:
        """Start timing ``label``; it must not already be running."""
        if label in self._started_at:
            raise RuntimeError(f"Timer label {label!r} is already running; stop it before starting it again.")
        self._started_at[label] = time.perf_counter()

    def stop(self, label: str) -> float:
        """Stop timing ``label`` and return the interval just measured, in seconds."""
        if label not in self._started_at:
            raise RuntimeError(f"Timer label {label!r} was never started; call start({label!r}) first.")
        elapsed_s = time.perf_counter() - self._started_at.pop(label)
        self._intervals_s.setdefault(label, []).append(elapsed_s)
        return elapsed_s

    @contextmanager
    def time(self, label: str) -> Iterator[None]:
        """Time the body of a ``with`` block under ``label`` (recorded even if the body raises)."""
        self.start(label)
        try:
            yield
        finally:
            self.stop(label)

    def get_elapsed(self, label: str) -> list[float]:
        """Every interval recorded for ``label`` since the last reset, in seconds."""
        if label not in self._intervals_s:
            raise KeyError(f"No interval recorded for timer label {label!r}; known labels: {self.labels()}.")
        return list(self._intervals_s[label])

    def labels(self) -> list[str]:
        """Labels with at least one recorded interval, in first-recorded order."""
        return list(self._intervals_s)

    def get_timing_metrics(self, reduction: Reduction = "sum") -> dict[str, float]:
        """One number per label: the ``sum``, ``mean``, ``max`` or ``min`` of its intervals, in seconds."""
        if reduction not in ("sum", "mean", "max", "min"):
            raise ValueError(f"Unknown timing reduction {reduction!r}; use 'sum', 'mean', 'max' or 'min'.")
        metrics: dict[str, float] = {}
        for label, intervals_s in self._intervals_s.items():
            if reduction == "sum":
                metrics[label] = sum(intervals_s)
            elif reduction == "mean":
                metrics[label] = sum(intervals_s) / len(intervals_s)
            elif reduction == "max":
                metrics[label] = max(intervals_s)
            else:
                metrics[label] = min(intervals_s)
        return metrics

    def reset(self, label: str | None = None) -> None:
        """Forget the intervals of ``label`` (or of every label); running timers keep running."""
        if label is None:
            self._intervals_s.clear()
        else:
            self._intervals_s.pop(label, None)


def parse_deadline_s(deadline: str) -> float:
    """Seconds in a ``"DD:HH:MM:SS"`` duration."""
    parts = deadline.split(":")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ValueError(f"Duration {deadline!r} is not 'DD:HH:MM:SS' (e.g. '00:03:45:00').")
    days, hours, minutes, seconds = (int(p) for p in parts)
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


class TimeoutChecker:
    """Tells the training loop when to save and stop before a wall-clock budget runs out.

    With ``fit_last_save_time`` the check also reserves the longest step seen so far, so the final step and
    its checkpoint finish inside the budget instead of being cut off by the scheduler.
    """

    def __init__(self, timeout: str | None, fit_last_save_time: bool) -> None:
        self._budget_s = parse_deadline_s(timeout) if timeout is not None else None
        self._fit_last_save_time = fit_last_save_time
        self._start_s = time.monotonic()
        self._last_mark_s = self._start_s
        self._longest_iteration_s = 0.0

    def start_iterations(self) -> None:
        """Start the budget clock now (call right before the first training step)."""
        self._start_s = time.monotonic()
        self._last_mark_s = self._start_s
        self._longest_iteration_s = 0.0

    def mark_iteration(self) -> None:
        """Record the end of one training step (its duration feeds the reserve)."""
        now_s = time.monotonic()
        self._longest_iteration_s = max(self._longest_iteration_s, now_s - self._last_mark_s)
        self._last_mark_s = now_s

    def check_save(self) -> bool:
        """Whether the budget is spent (or would be by one more step): save now and stop."""
        if self._budget_s is None:
            return False
        reserve_s = self._longest_iteration_s if self._fit_last_save_time else 0.0
        return time.monotonic() - self._start_s + reserve_s >= self._budget_s
