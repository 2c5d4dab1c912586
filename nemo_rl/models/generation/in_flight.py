"""In-flight weight updates: weights that a refit delivers while a generation call runs are staged, then
loaded between two decode steps of that call (asynchronous GRPO's ``in_flight_weight_updates``).

A generation worker that takes refits while it generates runs two calls at once (a threaded Ray actor): the
generation call in one thread, the refit's receive in the other. The refit thread hands the stream to
:meth:`InFlightWeights.receive`, which copies it (the transport reuses its buffers) and either loads it at
once, when no generation call runs, or leaves it for the generation thread, which calls
:meth:`InFlightWeights.apply_pending` before each decode step and loads whatever is still pending when the
call ends, so updates are always loaded in the order they arrived.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


class InFlightWeights:
    """The staging point between a refit thread and the generation thread of one engine.

    Args:
        load: loads a list of Hugging Face-named full tensors into the engine (called with the lock held,
            from whichever thread applies them).
    """

    def __init__(self, load: Callable[[NamedTensors], object]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._generating = False
        self._pending: NamedTensors | None = None
        self.updates_between_steps = 0
        """Updates loaded between two decode steps so far (not those loaded between calls)."""

    def receive(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The refit's load function: load now, or stage for the running generation call."""
        staged = [(name, tensor.detach().clone()) for name, tensor in named_tensors]
        with self._lock:
            if self._generating:
                self._pending = [*(self._pending or []), *staged]
            else:
                self._load(staged)

    @property
    def generating_now(self) -> bool:
        """Whether a generation call runs (a refit that arrives now is staged for it)."""
        return self._generating

    @property
    def has_pending(self) -> bool:
        """Whether an update waits to be applied (a cheap check before each decode step)."""
        return self._pending is not None

    def apply_pending(self) -> bool:
        """Load the staged update, if any (called by the generation thread between decode steps); whether
        there was one."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return False
            self._load(pending)
            self.updates_between_steps += 1
            return True

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Mark a generation call: refits stage their weights until it ends, then the rest is loaded."""
        with self._lock:
            self._generating = True
        try:
            yield
        finally:
            with self._lock:
                pending, self._pending = self._pending, None
                if pending is not None:
                    self._load(pending)
                self._generating = False
