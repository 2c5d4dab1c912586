"""The generation workers' copy of the policy's weights, as a run keeps track of it.

:class:`GenerationWeights` is the one owner of refits in a run: it knows whether the copy is stale (the policy
trained since), which policy version it holds, and it holds the lock that keeps a refit out of the middle of a
generation call. Synchronous loops only ever take that lock uncontended (they refit between two rollouts);
asynchronous GRPO's rollout thread (:mod:`nemo_rl.experience.async_rollouts`) holds it for each generation call
through :meth:`GenerationWeights.generating`, and the trainer's :meth:`GenerationWeights.refit` waits for the
call in progress and goes before the thread's next one (the lock alone is not fair). With in-flight weight
updates a refit takes no lock: the generation workers load the new weights between two decode steps.

The copy itself, with its scope, transport, offloads and staleness flag, is the
:class:`~nemo_rl.weight_sync.refitter.Refitter`'s; this object adds what only a run that generates while it
trains needs around it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol


class WeightCopy(Protocol):
    """Copies the trained policy's current weights into the generation backend (a
    :class:`~nemo_rl.weight_sync.refitter.Refitter`)."""

    @property
    def stale(self) -> bool:
        """Whether the policy trained since the last copy."""

    def refit(self) -> dict[str, float]:
        """Copy the weights now; returns the ``refit/*`` metrics."""

    def mark_stale(self) -> None:
        """Record that the policy trained."""

    def probe(self, gen_kl_error: float) -> None:
        """The refit guard's probe on a synchronous step's ``gen_kl_error`` (``policy.refit.guard``)."""

    def shutdown(self) -> None:
        """Release what the copies use (transport groups, shared-memory segments)."""


class InFlightUpdatable(Protocol):
    """A generation backend that can take a refit while it decodes."""

    def enable_in_flight_weight_updates(self, recompute_kv_cache: bool) -> None:
        """Apply weights that arrive during a generation call between two decode steps; with
        ``recompute_kv_cache`` the running requests' keys and values are recomputed with them."""


class GenerationWeights:
    """The generation workers' weights: stale or not, their policy version, and the refit lock (see the module
    docstring)."""

    def __init__(self, copy: WeightCopy, generation: InFlightUpdatable | None = None) -> None:
        self._copy = copy
        self._generation = generation
        self.version = 0
        """Policy version (optimizer steps) of the weights the generation workers hold, as last published."""
        self.in_flight = False
        """Whether refits run while the generation workers generate (no lock taken)."""
        self._lock = threading.Lock()
        self._version_changed = threading.Condition()
        self._refits_waiting = 0
        self._refit_turn = threading.Condition()
        self._refit_waited_s = 0.0

    def refit(self, version: int | None = None) -> dict[str, float]:
        """Copy the policy's current weights into the generation workers; returns the ``refit/*`` metrics.

        Without in-flight updates it first waits for the generation call in progress. ``version`` is published
        as the workers' policy version once the copy is complete (the rollout thread waits on it)."""
        start = time.perf_counter()
        with self._refit_turn:
            self._refits_waiting += 1
        try:
            with contextlib.nullcontext() if self.in_flight else self._lock:
                self._refit_waited_s += time.perf_counter() - start
                metrics = self._copy.refit()
                if version is not None:
                    self.publish(version)
        finally:
            with self._refit_turn:
                self._refits_waiting -= 1
                self._refit_turn.notify_all()
        return metrics

    @property
    def stale(self) -> bool:
        """Whether the policy trained since the generation workers last received its weights."""
        return self._copy.stale

    def mark_stale(self) -> None:
        """After an optimizer step: the generation workers' weights are behind the policy's."""
        self._copy.mark_stale()

    def probe(self, gen_kl_error: float) -> None:
        """Hand a synchronous step's ``gen_kl_error`` (engine and policy on the same weights) to the refit
        guard's probe, which stops the run past ``policy.refit.guard.max_gen_kl_error``."""
        self._copy.probe(gen_kl_error)

    def publish(self, version: int) -> None:
        """Record ``version`` as the policy version the generation workers hold, waking its waiters."""
        with self._version_changed:
            self.version = version
            self._version_changed.notify_all()

    def enable_in_flight_updates(self, recompute_kv_cache: bool) -> None:
        """From now on refits run while the generation workers generate; with ``recompute_kv_cache`` the running
        requests' keys and values are recomputed with the new weights."""
        if self._generation is None:
            raise RuntimeError(
                "in-flight weight updates need the generation backend (GenerationWeights(...))"
            )
        self._generation.enable_in_flight_weight_updates(recompute_kv_cache)
        self.in_flight = True

    @contextlib.contextmanager
    def generating(self) -> Iterator[int]:
        """Hold the weights for one generation call; yields their version. A refit that waits for the lock
        goes first."""
        with self._refit_turn:
            self._refit_turn.wait_for(lambda: self._refits_waiting == 0 or self.in_flight)
        with self._lock:
            yield self.version

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the generation workers between two generation calls (a validation samples meanwhile)."""
        with self._lock:
            yield

    def wait_for_version(self, min_version: int, stopped: Callable[[], bool]) -> None:
        """Wait until the published version is at least ``min_version`` or ``stopped()`` (see :meth:`wake`)."""
        with self._version_changed:
            self._version_changed.wait_for(lambda: stopped() or self.version >= min_version)

    def wake(self) -> None:
        """Wake the waiters of :meth:`wait_for_version` (to see a stop)."""
        with self._version_changed:
            self._version_changed.notify_all()

    def take_refit_wait_s(self) -> float:
        """Seconds refits waited for a generation call since the last time this was asked."""
        waited, self._refit_waited_s = self._refit_waited_s, 0.0
        return waited

    def shutdown(self) -> None:
        """Release the weight copy's transport."""
        self._copy.shutdown()
