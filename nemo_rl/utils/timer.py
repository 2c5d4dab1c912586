"""Wall-clock timers for the algorithm loops, and the stop check behind ``checkpoint_must_save_by`` and SIGTERM.

A :class:`Timer` records every measured interval per label; algorithms log them once per step as
``timing/train/<label>`` and then :meth:`Timer.reset`. Labels are free-form and may be hierarchical
(``"train/generation"``); intervals with different labels may overlap or nest.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Literal

logger = logging.getLogger(__name__)

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


_SignalHandler = Callable[[int, FrameType | None], object] | int | None


class TimeoutChecker:
    """Tells the training loop when to save and stop: a wall-clock budget runs out, or a stop signal came.

    With ``fit_last_save_time`` the check also reserves the longest step seen so far, so the final step and
    its checkpoint finish inside the budget instead of being cut off by the scheduler. After
    :meth:`stop_on_signals`, a SIGTERM (what ``ray.sub`` sends the driver before a SLURM time limit, and what
    Kubernetes sends a terminating pod) makes :meth:`check_save` true at the end of the current step.
    """

    def __init__(self, timeout: str | None, fit_last_save_time: bool) -> None:
        self._budget_s = parse_deadline_s(timeout) if timeout is not None else None
        self._fit_last_save_time = fit_last_save_time
        self._start_s = time.monotonic()
        self._last_mark_s = self._start_s
        self._longest_iteration_s = 0.0
        self._signal_received: str | None = None
        self._previous_handlers: dict[int, _SignalHandler] = {}

    def stop_on_signals(self, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        """Until :meth:`close`, any of ``signals`` asks the loop to save and stop after its current step.

        Repeats change nothing (a SLURM step signal reaches both ``uv run`` and the Python it forwards to), so the
        step and its checkpoint always finish; SIGINT (Ctrl-C) or SIGKILL stop at once. Only the main thread can
        handle signals; elsewhere this logs and does nothing.
        """
        if threading.current_thread() is not threading.main_thread():
            logger.info("not in the main thread: %s will not trigger a checkpoint", _names(signals))
            return
        # The handler holds the checker weakly: once the loop that owns it is gone, signals go where they went before.
        this = weakref.ref(self)
        for signum in signals:
            previous = signal.getsignal(signum)
            self._previous_handlers[signum] = previous

            def handler(received: int, frame: FrameType | None, previous: _SignalHandler = previous) -> None:
                checker = this()
                if checker is None:
                    signal.signal(received, previous)
                    _deliver(previous, received, frame)
                    return
                if checker._signal_received is None:
                    checker._signal_received = signal.Signals(received).name
                    print(
                        f"{checker._signal_received} received: stopping after the current step and its checkpoint",
                        file=sys.stderr,
                        flush=True,
                    )

            signal.signal(signum, handler)

    def close(self) -> None:
        """Give the signals of :meth:`stop_on_signals` back to the handlers they had before."""
        for signum, previous in self._previous_handlers.items():
            signal.signal(signum, previous)
        self._previous_handlers.clear()

    @property
    def stop_reason(self) -> str:
        """Why :meth:`check_save` asked to stop, for the loop's message."""
        if self._signal_received is not None:
            return f"{self._signal_received} received"
        return "checkpointing.checkpoint_must_save_by reached"

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
        """Whether a stop signal came or the budget is spent (or would be by one more step): save now and stop."""
        if self._signal_received is not None:
            return True
        if self._budget_s is None:
            return False
        reserve_s = self._longest_iteration_s if self._fit_last_save_time else 0.0
        return time.monotonic() - self._start_s + reserve_s >= self._budget_s


def _names(signals: Sequence[int]) -> str:
    return ", ".join(signal.Signals(s).name for s in signals)


def _deliver(handler: _SignalHandler, signum: int, frame: FrameType | None) -> None:
    """Act on ``signum`` as ``handler`` (restored by the caller) would have."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)
