"""Asynchronous GRPO's trajectory buffer: scored prompt batches, tagged with the policy version that sampled
them, between the generation thread and the trainer (:mod:`nemo_rl.experience.async_rollouts`), and as a
checkpoint saves them (plain data that ``torch.load(weights_only=True)`` reads back)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict


@dataclasses.dataclass
class RolloutBatch:
    """One prompt batch, rolled out and scored: every group of it shares the batch's policy version."""

    rollout: BatchedDataDict[Any]
    """The scored rollout, each prompt's responses next to each other."""
    metrics: dict[str, float]
    """The rollout's metrics (rewards, lengths, the environments' own)."""
    version: int
    """Policy version of the weights the batch's first generation call ran on."""
    loader_state: dict[str, Any]
    """The prompt loader's state right after this batch was drawn (a checkpoint's position once it is used)."""
    num_prompts: int
    """Prompts (groups) in the batch."""

    def to_plain(self) -> dict[str, Any]:
        """The batch as plain data (tensors, numbers, strings, lists, dicts), as a checkpoint saves it."""
        rollout = dict(self.rollout)
        _check_plain(rollout, "rollout")
        return {
            "rollout": rollout,
            "metrics": dict(self.metrics),
            "version": self.version,
            "loader_state": dict(self.loader_state),
            "num_prompts": self.num_prompts,
        }

    @classmethod
    def from_plain(cls, state: dict[str, Any]) -> RolloutBatch:
        """The batch :meth:`to_plain` saved."""
        return cls(**{**state, "rollout": BatchedDataDict(state["rollout"])})


_PLAIN_LEAVES = (torch.Tensor, str, int, float, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    """Raise naming the first value a checkpoint cannot load back safely (``torch.load(weights_only=True)``)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN_LEAVES):
        raise TypeError(
            f"asynchronous GRPO cannot checkpoint its buffered trajectories: {where} is a "
            f"{type(value).__name__}; rollouts must hold tensors, numbers, strings, lists and dicts"
        )


class TrajectoryBuffer:
    """A bounded first-in first-out queue of :class:`RolloutBatch` between the generation thread and the
    trainer; a failure of the generation thread is raised in the trainer at its next :meth:`take`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the trajectory buffer needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._items: deque[RolloutBatch] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self.num_put = 0
        """Batches put (or restored) so far."""

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, batch: RolloutBatch) -> float:
        """Append ``batch``, waiting while the buffer is full; returns the seconds waited."""
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._closed or len(self._items) < self.capacity)
            if not self._closed:
                self._items.append(batch)
                self.num_put += 1
                self._cond.notify_all()
        return time.perf_counter() - start

    def restore(self, batches: list[RolloutBatch]) -> None:
        """Put back the batches a checkpoint saved (before the generation thread starts; no capacity wait)."""
        with self._cond:
            self._items.extend(batches)
            self.num_put += len(batches)

    def items(self) -> list[RolloutBatch]:
        """The batches waiting now, oldest first."""
        with self._cond:
            return list(self._items)

    def take(self, min_version: int, timeout_s: float) -> tuple[RolloutBatch, list[RolloutBatch], float]:
        """The oldest batch of version ``>= min_version``, the older ones dropped on the way, and the seconds
        waited. Raises the generation thread's error if it failed, ``TimeoutError`` after ``timeout_s``."""
        dropped: list[RolloutBatch] = []
        start = time.perf_counter()
        with self._cond:
            while True:
                while self._items and self._items[0].version < min_version:
                    dropped.append(self._items.popleft())
                if self._items:
                    batch = self._items.popleft()
                    self._cond.notify_all()
                    return batch, dropped, time.perf_counter() - start
                self._wait(start, timeout_s, "the trainer waited for a batch", lambda: bool(self._items))

    def wait_for_puts(self, count: int, timeout_s: float) -> float:
        """Wait until ``count`` batches were put in all; returns the seconds waited. Raises as :meth:`take`."""
        start = time.perf_counter()
        with self._cond:
            while self.num_put < count:
                self._wait(
                    start,
                    timeout_s,
                    "the trainer waited for generation before a refit",
                    lambda: self.num_put >= count,
                )
        return time.perf_counter() - start

    def _wait(self, start: float, timeout_s: float, what: str, ready: Callable[[], bool]) -> None:
        """One wait (holding the lock) of :meth:`take` or :meth:`wait_for_puts` for ``ready()``: raises the
        generation thread's error, a close, or a ``TimeoutError`` after ``timeout_s`` from ``start``."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError(f"the trajectory buffer was closed while {what}")
        remaining = timeout_s - (time.perf_counter() - start)
        timed_out = remaining <= 0 or not self._cond.wait(timeout=remaining)
        if timed_out and not ready() and self._error is None:
            raise TimeoutError(f"no rollout batch arrived within {timeout_s:.0f} s: is generation stuck?")

    def fail(self, error: BaseException) -> None:
        """Record the generation thread's error for the trainer."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter; later puts are discarded."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()
