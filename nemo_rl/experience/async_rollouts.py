"""Asynchronous rollouts: generation runs ahead of training, tagged with the policy version that sampled it.

:class:`AsyncRollouts` owns a thread of the driver that keeps drawing prompt batches, rolling them out on the
(non-colocated) generation workers, scoring them with the environments, and putting the scored groups into a
bounded :class:`TrajectoryBuffer`. The training loop takes one batch per step from :meth:`AsyncRollouts.steps`
and, after each optimizer step, refits the generation workers through the run, which publishes the new version.

Versions and ages. The policy version is the number of optimizer steps behind a set of weights. A batch
carries the version of the weights its first generation call ran on (a later turn, or an in-flight update,
only makes its tokens newer). Step ``t`` updates version ``t - 1``, so a batch of version ``v`` trained at
step ``t`` has age ``t - 1 - v``. Batch ``b`` of this run (counted from 0; it feeds step ``start + b + 1``)
is only started once the weights are recent enough for it to be trained at age ``<= max_age``, so generation
never runs more than ``max_age`` steps ahead; the trainer still checks every batch it takes, and drops and
counts one that is older (none, while the rule holds).

Weight updates. The run owns the generation workers' weights and their refits (a :class:`PolicyWeights`
passed in): each generation call of the thread holds them through ``weights.generating()``, which a refit
without in-flight updates waits for (the "request boundary"); with in-flight updates the refit runs while the
generation workers decode, and they apply the new weights between two decode steps.

Checkpoints. The prompt loader runs ahead of training, so what a checkpoint saves as the loader's position
is :meth:`AsyncRollouts.consumed_loader_state`: the position after the last batch trained on or dropped.
The buffer is not saved; its prompts are drawn and sampled again after a resume.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.interfaces import GenerationInterface


class PolicyWeights(Protocol):
    """The generation workers' weights as the rollout thread needs them; the run owns them and their refits
    (:class:`nemo_rl.algorithms.generation_weights.GenerationWeights`)."""

    @property
    def version(self) -> int:
        """Policy version of the weights the generation workers hold (published once a refit completes)."""

    def generating(self) -> AbstractContextManager[int]:
        """Hold the weights for one generation call (a refit waits for it); gives their version."""

    def wait_for_version(self, min_version: int, stopped: Callable[[], bool]) -> None:
        """Wait until the published version is at least ``min_version`` or ``stopped()``."""

    def wake(self) -> None:
        """Wake :meth:`wait_for_version`'s waiters (to see a stop)."""

    def take_refit_wait_s(self) -> float:
        """Seconds refits waited for a generation call since last asked."""


RollOut = Callable[[Any, BatchedDataDict[Any]], tuple[BatchedDataDict[Any], dict[str, float]]]
"""Samples and scores one prompt batch on the given generation backend: (rollout, metrics)."""


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
                self._cond.notify_all()
        return time.perf_counter() - start

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
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise RuntimeError(
                        "the trajectory buffer was closed while the trainer waited for a batch"
                    )
                remaining = timeout_s - (time.perf_counter() - start)
                timed_out = remaining <= 0 or not self._cond.wait(timeout=remaining)
                if timed_out and not self._items and self._error is None:
                    raise TimeoutError(
                        f"no rollout batch arrived within {timeout_s:.0f} s: is generation stuck?"
                    )

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


@dataclasses.dataclass
class _Counters:
    """What the generation thread measured since the trainer last asked (see :meth:`AsyncRollouts.take`)."""

    generation_idle_s: float = 0.0
    generating_s: float = 0.0
    failures: int = 0


class _VersionedGeneration:
    """The generation backend as the rollout thread sees it: each call holds the run's weights (which a refit
    also waits for unless it goes in flight) and records the policy version it started on."""

    def __init__(self, owner: AsyncRollouts, generation: GenerationInterface) -> None:
        self._owner = owner
        self._generation = generation
        self.first_version: int | None = None

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        start = time.perf_counter()
        with self._owner.weights.generating() as version:
            self._owner.count(generation_idle_s=time.perf_counter() - start)
            if self.first_version is None:
                self.first_version = version
            return self._generation.generate(data, greedy=greedy)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generation, name)


class AsyncRollouts:
    """Generation running ahead of training (see the module docstring).

    Args:
        generation: the generation backend (its own workers, not the policy's).
        weights: the generation workers' weights, which the run refits (see :class:`PolicyWeights`); their
            version at the start is that of the steps already taken (a resumed run refits before :meth:`start`).
        roll_out: samples and scores one prompt batch (see :data:`RollOut`).
        batches: the prompt batches, one per step, in loader order.
        loader_state: the prompt loader's state now (called right after each draw).
        num_batches: batches to draw at most (the steps left to run).
        max_age: ``grpo.async_grpo.max_trajectory_age_steps``.
        max_failures: ``grpo.async_grpo.max_generation_failures``.
        take_timeout_s: the longest the trainer waits for a batch.
    """

    def __init__(
        self,
        generation: GenerationInterface,
        weights: PolicyWeights,
        roll_out: RollOut,
        *,
        batches: Iterator[BatchedDataDict[Any]],
        loader_state: Callable[[], dict[str, Any]],
        num_batches: int,
        max_age: int,
        max_failures: int,
        take_timeout_s: float,
    ) -> None:
        # At most max_age batches ahead of the one the trainer takes next.
        self.buffer = TrajectoryBuffer(capacity=max_age + 1)
        self._generation = generation
        self.weights = weights
        self._roll_out = roll_out
        self._batches = batches
        self._loader_state = loader_state
        self.start_version = weights.version
        self._num_batches = num_batches
        self.max_age = max_age
        self._max_failures = max_failures
        self._take_timeout_s = take_timeout_s
        self._counters = _Counters()
        self._counters_lock = threading.Lock()
        self._consumed_state = loader_state()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_take_s = time.perf_counter()
        self.dropped_groups_total = 0

    # ------------------------------------------------------------------------------ generation thread
    def start(self) -> None:
        """Start the generation thread."""
        if self._thread is not None:
            raise RuntimeError("AsyncRollouts.start() was called twice")
        self._last_take_s = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="async-rollouts", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for index in range(self._num_batches):
                # Batch `index` feeds step start + index + 1: started on weights no older than the age bound.
                min_version = self.start_version + index - self.max_age
                waited_from = time.perf_counter()
                self.weights.wait_for_version(min_version, self._stop.is_set)
                self.count(generation_idle_s=time.perf_counter() - waited_from)
                if self._stop.is_set():
                    return
                batch = next(self._batches)
                rolled = self._roll_out_with_retries(batch, self._loader_state())
                if rolled is None:
                    return
                self.count(generation_idle_s=self.buffer.put(rolled))
        except BaseException as err:  # the trainer raises it at its next take
            self.buffer.fail(err)

    def _roll_out_with_retries(
        self, batch: BatchedDataDict[Any], loader_state: dict[str, Any]
    ) -> RolloutBatch | None:
        while not self._stop.is_set():
            generation = _VersionedGeneration(self, self._generation)
            start = time.perf_counter()
            try:
                rollout, metrics = self._roll_out(generation, batch)
            except Exception as err:
                with self._counters_lock:
                    self._counters.failures += 1
                    failures = self._counters.failures
                if failures > self._max_failures:
                    raise RuntimeError(
                        f"generation or scoring failed {failures} times, more than "
                        f"grpo.async_grpo.max_generation_failures={self._max_failures}: {err}"
                    ) from err
                continue
            self.count(generating_s=time.perf_counter() - start)
            first = generation.first_version
            return RolloutBatch(
                rollout=rollout,
                metrics=metrics,
                version=self.weights.version if first is None else first,
                loader_state=loader_state,
                num_prompts=len(batch["message_log"]),
            )
        return None

    def count(self, *, generation_idle_s: float = 0.0, generating_s: float = 0.0) -> None:
        """Add to the generation thread's idle and generating time (reported at the next :meth:`take`)."""
        with self._counters_lock:
            self._counters.generation_idle_s += generation_idle_s
            self._counters.generating_s += generating_s

    # ---------------------------------------------------------------------------------------- trainer
    def take(self, step: int) -> tuple[RolloutBatch, dict[str, float], list[RolloutBatch]]:
        """The batch step ``step`` (1-based) trains on, its ``async/*`` metrics and the batches dropped as too
        old; the dropped and the taken batches count as consumed."""
        min_version = step - 1 - self.max_age
        batch, dropped, waited_s = self.buffer.take(min_version, self._take_timeout_s)
        self._consumed_state = batch.loader_state
        now = time.perf_counter()
        interval_s, self._last_take_s = now - self._last_take_s, now
        with self._counters_lock:
            counters, self._counters = self._counters, _Counters(failures=self._counters.failures)
        dropped_groups = sum(d.num_prompts for d in dropped)
        self.dropped_groups_total += dropped_groups
        age = step - 1 - batch.version
        samples = int(batch.rollout.size)
        metrics = {
            "async/trajectory_age_mean": float(age),
            "async/trajectory_age_max": float(age),
            "async/dropped_stale_groups": float(dropped_groups),
            "async/dropped_stale_groups_total": float(self.dropped_groups_total),
            # Waiting for a batch, and for the generation call in progress before the last refit.
            "async/training_idle_s": waited_s + self.weights.take_refit_wait_s(),
            "async/generation_idle_s": counters.generation_idle_s,
            "async/generation_s": counters.generating_s,
            "async/buffered_batches": float(len(self.buffer)),
            "async/generation_failures": float(counters.failures),
            "async/samples_per_s": samples / interval_s if interval_s > 0 else 0.0,
        }
        return batch, metrics, dropped

    @property
    def position(self) -> ConsumedLoaderPosition:
        """The consumed position as a checkpoint saves it in place of the loader's state."""
        return ConsumedLoaderPosition(self)

    def consumed_loader_state(self) -> dict[str, Any]:
        """The prompt loader's state after the last batch trained on or dropped (what a checkpoint saves)."""
        return dict(self._consumed_state)

    def close(self, timeout_s: float = 600.0) -> None:
        """Stop the generation thread after its current call; what it had buffered is discarded."""
        self._stop.set()
        self.weights.wake()
        self.buffer.close()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)


class ConsumedLoaderPosition:
    """What a checkpoint saves as the prompt loader's state in asynchronous GRPO: the position after the
    last batch consumed, not where the generation thread has read to."""

    def __init__(self, rollouts: AsyncRollouts) -> None:
        self._rollouts = rollouts

    def state_dict(self) -> dict[str, Any]:
        """The loader state a resumed run continues from."""
        return self._rollouts.consumed_loader_state()
