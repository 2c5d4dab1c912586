"""Asynchronous rollouts: generation runs ahead of training, tagged with the policy version that sampled it.

:class:`AsyncRollouts` owns a thread of the driver that keeps drawing prompt batches, rolling them out on the
(non-colocated) generation workers, scoring them with the environments, and putting the scored groups into a
bounded :class:`TrajectoryBuffer`. The training loop takes one batch per step with :meth:`AsyncRollouts.take`
and, after each optimizer step, refits the generation workers through the run, which publishes the new version.

Versions and ages. The policy version is the number of optimizer steps behind a set of weights. A batch
carries the version of the weights its first generation call ran on (a later turn, or an in-flight update,
only makes its tokens newer). Step ``t`` updates version ``t - 1``, so a batch of version ``v`` trained at
step ``t`` has age ``t - 1 - v``. Batch ``g`` of the run (counted from 0 over the whole run; it feeds step
``g + 1``) is only started once the weights are at least version ``g - max_age``, so generation never runs
more than ``max_age`` steps ahead; the trainer still checks every batch it takes, and drops and counts one
that is older (none, while the rule holds).

Determinism. Without in-flight weight updates the schedule does not depend on timing: the trainer refits
version ``v`` only once batch ``v + max_age - 1`` is sampled (:meth:`AsyncRollouts.wait_before_refit`), so
batch ``g`` is sampled by version ``max(g - max_age, first)`` exactly, every generation call of it included
(``first`` is the version the run started or resumed at). Each generation call of the thread is seeded from
the run's seed, its batch's prompt indices, the policy version and the turn (:func:`sampling_seed`), never
from how many calls came before (a validation between two calls, a retried batch or a resume changes none).
Two runs with one seed then train on the same samples, and a resumed run on those of the uninterrupted one.
With in-flight updates a refit lands between two decode steps wherever generation then is: which tokens
which weights sampled depends on timing, and only the prompts' order and their being trained once hold.

Weight updates. The run owns the generation workers' weights and their refits (a :class:`PolicyWeights`
passed in): each generation call of the thread holds them through ``weights.generating()``, which a refit
without in-flight updates waits for (the "request boundary"); with in-flight updates the refit runs while the
generation workers decode, and they apply the new weights between two decode steps.

Checkpoints. The prompt loader runs ahead of training. A checkpoint saves the batches sampled and not yet
trained on (:meth:`AsyncRollouts.state_dict`, through ``checkpointer.track``) and, as the loader's position,
the position right after the last of them, both fixed at one moment by :meth:`AsyncRollouts.snapshot`. A
resumed run puts the batches back into the buffer before its thread starts, and the thread draws the
prompts that follow them: a batch being sampled when the checkpoint was taken is drawn and sampled again,
by the same weights with the same seeds when the schedule is deterministic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.trajectory_buffer import RolloutBatch, TrajectoryBuffer
from nemo_rl.models.generation.healing import GenerationPoolError
from nemo_rl.models.generation.interfaces import GenerationInterface

__all__ = [
    "AheadBatchesOnResume",
    "AsyncRollouts",
    "PolicyWeights",
    "RollOut",
    "RolloutBatch",
    "SavedLoaderPosition",
    "TrajectoryBuffer",
    "sampling_seed",
]


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


def sampling_seed(run_seed: int, prompt_idx: list[int], version: int, turn: int) -> int:
    """The seed of a rollout thread's generation call: a function of the run's seed, the prompt indices of its
    batch (whose rows are their samples, in order), the policy version sampling it and the rollout turn."""
    key = repr((run_seed, prompt_idx, version, turn)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@dataclasses.dataclass
class _Counters:
    """What the generation thread measured since the trainer last asked (see :meth:`AsyncRollouts.take`)."""

    generation_idle_s: float = 0.0
    generating_s: float = 0.0
    failures: int = 0


class _VersionedGeneration:
    """The generation backend as the rollout thread sees it for one batch: each call holds the run's weights
    (which a refit also waits for unless it goes in flight), records the policy version it started on, and
    is seeded by :func:`sampling_seed`."""

    def __init__(self, owner: AsyncRollouts, generation: GenerationInterface, prompt_idx: list[int]) -> None:
        self._owner = owner
        self._generation = generation
        self._prompt_idx = prompt_idx
        self._turn = 0
        self.first_version: int | None = None

    def generate(
        self, data: BatchedDataDict[Any], greedy: bool = False, seed: int | None = None
    ) -> BatchedDataDict[Any]:
        start = time.perf_counter()
        with self._owner.weights.generating() as version:
            self._owner.count(generation_idle_s=time.perf_counter() - start)
            if self.first_version is None:
                self.first_version = version
            if seed is None:
                seed = sampling_seed(self._owner.seed, self._prompt_idx, version, self._turn)
            self._turn += 1
            return self._generation.generate(data, greedy=greedy, seed=seed)

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
        num_batches: batches the remaining steps train on (restored ones included).
        max_age: ``grpo.async_grpo.max_trajectory_age_steps``.
        max_failures: ``grpo.async_grpo.max_generation_failures``.
        take_timeout_s: the longest the trainer waits for a batch.
        seed: the run's seed, mixed into every generation call's seed (:func:`sampling_seed`).
        deterministic: make the schedule independent of timing (:meth:`wait_before_refit`); off with
            in-flight weight updates, where refits do not wait for generation anyway.
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
        seed: int,
        deterministic: bool,
    ) -> None:
        # At most max_age batches ahead of the one the trainer takes next.
        self.buffer = TrajectoryBuffer(capacity=max_age + 1)
        self._generation = generation
        self.weights = weights
        self._roll_out = roll_out
        self._batches = batches
        self._loader_state = loader_state
        self.start_version = weights.version
        # Batches of the run are counted from 0 (batch g feeds step g + 1); those before start_version are
        # trained already.
        self._end_batch = self.start_version + num_batches
        self.max_age = max_age
        self._max_failures = max_failures
        self._take_timeout_s = take_timeout_s
        self.seed = seed
        self.deterministic = deterministic
        self._counters = _Counters()
        self._counters_lock = threading.Lock()
        self._consumed_state = loader_state()
        self._saved: tuple[list[RolloutBatch], dict[str, Any]] | None = None
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
            for index in range(self.start_version + self.buffer.num_put, self._end_batch):
                # Batch `index` feeds step index + 1: started on weights no older than the age bound.
                min_version = max(self.start_version, index - self.max_age)
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
        prompt_idx = [int(i) for i in batch["idx"]]
        while not self._stop.is_set():
            # A retry replays the same seeds: its prompts, version and turns are the failed attempt's.
            generation = _VersionedGeneration(self, self._generation, prompt_idx)
            start = time.perf_counter()
            try:
                rollout, metrics = self._roll_out(generation, batch)
            except GenerationPoolError:
                raise  # the pool retried what it could already: its one line ends the run as it is
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

    def wait_before_refit(self, version: int) -> float:
        """Before the refit that publishes ``version``: with a deterministic schedule, wait until every batch
        the older weights sample (those up to batch ``version + max_age - 1``) is sampled, so that no batch's
        weights depend on timing; returns the seconds waited (0 with in-flight updates)."""
        if not self.deterministic:
            return 0.0
        needed = min(version + self.max_age, self._end_batch) - self.start_version
        return self.buffer.wait_for_puts(needed, self._take_timeout_s)

    # ------------------------------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def snapshot(self) -> Iterator[SavedLoaderPosition]:
        """Fix, while a checkpoint is written, what it saves: the batches sampled and not yet taken
        (:meth:`state_dict`) and the loader position right after the last of them (the position yielded), as
        they stand at one moment (the generation thread keeps going meanwhile)."""
        self._saved = self._snapshot()
        try:
            yield SavedLoaderPosition(self)
        finally:
            self._saved = None

    def _snapshot(self) -> tuple[list[RolloutBatch], dict[str, Any]]:
        if self._saved is not None:
            return self._saved
        batches = self.buffer.items()
        return batches, batches[-1].loader_state if batches else self._consumed_state

    def state_dict(self) -> dict[str, Any]:
        """The buffered batches of the last :meth:`snapshot`, as plain data, and the loader state after the
        last batch consumed (where a synchronous run resumed from it continues: :class:`AheadBatchesOnResume`)."""
        return {
            "batches": [batch.to_plain() for batch in self._snapshot()[0]],
            "consumed_loader_state": self.consumed_loader_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put a checkpoint's buffered batches back, before :meth:`start` (the loader stands after them)."""
        if self._thread is not None:
            raise RuntimeError("the buffered batches are restored before the generation thread starts")
        self.buffer.restore([RolloutBatch.from_plain(batch) for batch in state["batches"]])
        self._consumed_state = dict(state["consumed_loader_state"])

    def saved_loader_state(self) -> dict[str, Any]:
        """The prompt loader's state right after the last buffered batch of the snapshot (after the last
        batch consumed when none is buffered)."""
        return dict(self._snapshot()[1])

    def consumed_loader_state(self) -> dict[str, Any]:
        """The prompt loader's state after the last batch trained on or dropped."""
        return dict(self._consumed_state)

    def close(self, timeout_s: float = 600.0) -> None:
        """Stop the generation thread after its current call; what it had buffered is discarded."""
        self._stop.set()
        self.weights.wake()
        self.buffer.close()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)


class SavedLoaderPosition:
    """What a checkpoint saves as the prompt loader's state in asynchronous GRPO: the position after the
    batches the checkpoint holds (:meth:`AsyncRollouts.snapshot`), not where the generation thread has read to."""

    def __init__(self, rollouts: AsyncRollouts) -> None:
        self._rollouts = rollouts

    def state_dict(self) -> dict[str, Any]:
        """The loader state a resumed run continues from."""
        return self._rollouts.saved_loader_state()


class _Loader(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class AheadBatchesOnResume:
    """Synchronous GRPO's stand-in for :class:`AsyncRollouts` in checkpoints (tracked under the same name):
    resumed from an asynchronous run's checkpoint, it puts the loader back after the last batch that run
    trained on, so the prompts it had sampled ahead are sampled again rather than skipped. It saves no batch."""

    def __init__(self, loader: _Loader) -> None:
        self._loader = loader

    def state_dict(self) -> dict[str, Any]:
        """No batches sampled ahead; the loader where it stands."""
        return {"batches": [], "consumed_loader_state": self._loader.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Rewind the loader over the batches an asynchronous run had sampled ahead, if any."""
        if state["batches"]:
            self._loader.load_state_dict(dict(state["consumed_loader_state"]))
            print(
                f"Resuming an asynchronous run's checkpoint synchronously: its {len(state['batches'])} "
                "batches sampled ahead are sampled again",
                flush=True,
            )
