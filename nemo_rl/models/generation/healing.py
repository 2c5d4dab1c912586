"""A generation pool that heals itself: lost generation workers are replaced and their requests sampled again.

:class:`PoolHealer` drives the calls of :class:`~nemo_rl.models.generation.replicated.ReplicatedGeneration` on
its worker group. A worker that dies (its process killed, its node lost) or hangs (alive, but answering no
ping for ``policy.generation.healing.hang_timeout_s``; see :mod:`nemo_rl.distributed.worker_watch`) during a
call does not end the run:

1. its replica (every rank of its data-parallel group: tensor-parallel peers may be stuck in a collective with
   it) is killed and started again on the same bundles, with the same rank environment, so it samples with the
   same seeds as the replica it replaces;
2. the calls that set the workers' state since they started (in-flight weight updates) are made again on it,
   and it is put in the pool's phase (asleep after ``finish_generation``, as a refit finds the others);
3. the run's refill (:meth:`set_refill`; the :class:`~nemo_rl.weight_sync.refitter.Refitter` sends the policy's
   current weights) loads it with a full refit; a pool without one (an evaluation) keeps the weights the new
   worker loaded from the model's checkpoint;
4. the lost part of the call is made again on it, and the results are gathered as if nothing happened.

A replica that cannot start again within ``start_timeout_s`` is dropped: the pool goes on with one replica
fewer and the call is dealt again over the others. Every replacement counts against
``policy.generation.healing.max_replacements``; one more lost worker stops the run with one line naming it
(:class:`GenerationPoolError`). Each event is printed as a warning and counted in :meth:`take_metrics`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import ray

from nemo_rl.config.errors import UserError
from nemo_rl.config.generation import HealingConfig
from nemo_rl.distributed.worker_groups import WorkerDiedError
from nemo_rl.distributed.worker_watch import WatchedWorkerGroup, WorkerFailure, first_line, gather_watching

Refill = Callable[[Sequence[int]], None]
"""Loads the run's current weights into the workers of the given ranks (just replaced)."""


class GenerationPoolError(RuntimeError, UserError):
    """The generation pool lost a worker past ``policy.generation.healing.max_replacements``, or its last
    replica; one line naming the worker (the script exits 2, the last checkpoint intact)."""


class PoolHealer:
    """Runs calls on a generation worker group, replacing the workers lost during them (module docstring).

    Args:
        group: the generation workers.
        cfg: ``policy.generation.healing``.
        backend_name: the backend as messages name it.
    """

    def __init__(self, group: WatchedWorkerGroup, cfg: HealingConfig, backend_name: str) -> None:
        self.group = group
        self.cfg = cfg
        self.backend_name = backend_name
        self.replacements = 0
        """Workers replaced (or given up) so far in this run."""
        self._unreported = 0
        self._refill: Refill | None = None
        self._state_calls: list[tuple[str, tuple[Any, ...]]] = []
        self._phase: str | None = None
        # Serialises replacements: the rollout thread and a refit may find the same lost worker at once.
        self._lock = threading.RLock()

    def set_refill(self, refill: Refill | None) -> None:
        """The function that loads the run's current weights into replaced workers (``None``: they keep the
        weights they start with)."""
        self._refill = refill

    def remember(self, method: str, *args: Any) -> None:
        """Record a call that changes the workers' state for good, to make it again on every replacement."""
        self._state_calls.append((method, args))

    def set_phase(self, method: str | None) -> None:
        """The call that put the workers in their present phase (``finish_generation``: asleep, devices handed
        to the policy), made on a replacement after the remembered calls; ``None``: a new worker's phase."""
        self._phase = method

    def take_metrics(self) -> dict[str, float]:
        """``generation/replaced_workers``: replicas replaced or dropped since the last call (empty when none)."""
        with self._lock:
            count, self._unreported = self._unreported, 0
        return {"generation/replaced_workers": float(count)} if count else {}

    # ------------------------------------------------------------------------------------- calls
    def run_sharded(
        self, method: str, shards: Sequence[Any], *args: Any, timeout_s: float
    ) -> list[Any] | None:
        """``method(shards[dp], *args)`` on every worker; the dp leaders' results in dp order, or ``None`` when
        the pool shrank meanwhile (deal the data again over :attr:`group`'s replicas and call again)."""
        group = self.group
        # Stored once per replica: its model-parallel ranks, and a replacement, read the same copy.
        shard_refs = [ray.put(shard) for shard in shards]
        results = self._run(method, lambda rank: (shard_refs[group.dp_rank(rank)], *args), timeout_s)
        return None if results is None else [results[rank] for rank in group.dp_leader_ranks]

    def run_all(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        """``method(*args)`` on every worker; the results in rank order. A lost worker's replica is replaced and
        the call made again on it (calls made this way must be safe to repeat on a new worker); when the pool
        shrank instead, the call is made again on every worker left."""
        while True:
            results = self._run(method, lambda rank: args, timeout_s)
            if results is not None:
                return [results[rank] for rank in range(self.group.world_size)]

    def _run(
        self, method: str, args_of: Callable[[int], tuple[Any, ...]], timeout_s: float
    ) -> dict[int, Any] | None:
        """``method(*args_of(rank))`` on every worker, made again on the replacements of lost replicas; the
        results by rank, or ``None`` when the pool dropped a replica instead."""
        group = self.group
        world_size = group.world_size
        pending = {rank: group.run_single_worker(method, rank, *args_of(rank)) for rank in range(world_size)}
        actors = _actor_ids(group, pending)
        results: dict[int, Any] = {}
        while pending:
            done, failures = gather_watching(
                group, pending, timeout_s=timeout_s, hang_timeout_s=self.cfg.hang_timeout_s
            )
            results.update(done)
            if not failures:
                break
            # The pool dropped a replica (here, or in another thread's call meanwhile): deal the call again.
            if not self.heal(failures, actors, during=method) or group.world_size != world_size:
                return None
            lost = {group.dp_rank(rank) for rank in failures}
            ranks = [r for r in range(group.world_size) if group.dp_rank(r) in lost]
            pending = {r: group.run_single_worker(method, r, *args_of(r)) for r in ranks}
            actors.update(_actor_ids(group, pending))
        return results

    def replace_lost_workers(self) -> bool:
        """Ping every worker and replace those dead or silent for the hang timeout (after a call that failed
        without naming its worker, such as a refit); whether any was replaced or dropped."""
        group = self.group
        pings = group.ping(range(group.world_size))
        actors = _actor_ids(group, pings)
        _, failures = gather_watching(
            group,
            pings,
            timeout_s=self.cfg.hang_timeout_s * 2 + 60.0,
            hang_timeout_s=self.cfg.hang_timeout_s,
        )
        if not failures:
            return False
        self.heal(failures, actors, during="refit")
        return True

    # ------------------------------------------------------------------------------------- healing
    def heal(self, failures: dict[int, WorkerFailure], actors: dict[int, str], *, during: str) -> bool:
        """Replace the replicas of the lost workers ``failures`` (``actors``: the actor id each rank had when
        the call was made; a replica replaced since by another caller is left alone). Returns False when the
        pool dropped a replica instead (its data must be dealt again), True otherwise."""
        with self._lock:
            group = self.group
            by_dp: dict[int, WorkerFailure] = {}
            for rank, failure in sorted(failures.items()):
                by_dp.setdefault(group.dp_rank(rank), failure)
            in_place = True
            # From the last replica down, so that dropping one does not renumber those still to handle.
            for dp, failure in sorted(by_dp.items(), reverse=True):
                ranks = [r for r in range(group.world_size) if group.dp_rank(r) == dp]
                if any(group.workers[r]._actor_id.hex() != actors.get(r) for r in ranks):
                    continue  # replaced already, by a call that found the loss first
                in_place = self._replace(dp, ranks, failure, during) and in_place
            return in_place

    def _replace(self, dp: int, ranks: list[int], failure: WorkerFailure, during: str) -> bool:
        group = self.group
        self.replacements += 1
        self._unreported += 1
        what = (
            f"{self.backend_name} generation worker {failure.rank} (replica {dp}) {failure.verb} during {during} "
            f"({failure.cause})"
        )
        limit = self.cfg.max_replacements
        if self.replacements > limit:
            raise GenerationPoolError(
                f"{what}, and the run has replaced {limit} generation workers already "
                f"(policy.generation.healing.max_replacements={limit}): raise it to go on, or find why the "
                "workers die (their Ray logs); the last checkpoint is intact"
            )
        try:
            group.replace_workers(ranks, self.cfg.start_timeout_s)
        except (TimeoutError, WorkerDiedError) as error:
            why = first_line(str(error)) or type(error).__name__
            if group.dp_size == 1:
                raise GenerationPoolError(
                    f"{what}, and its replacement did not start ({why}); no generation worker "
                    "is left: check the cluster's free slots, or raise "
                    "policy.generation.healing.start_timeout_s; the last checkpoint is intact"
                ) from error
            group.drop_dp_groups([dp])
            print(
                f"WARNING: {what}; its replacement did not start ({why}), so generation goes on "
                f"with {group.dp_size} replicas ({self.replacements} of {limit} replacements used)",
                flush=True,
            )
            return False
        calls = [*self._state_calls, *([(self._phase, ())] if self._phase else [])]
        for method, args in calls:
            group.get_all_worker_results(
                [group.run_single_worker(method, r, *args) for r in ranks], self.cfg.start_timeout_s
            )
        if self._refill is not None:
            self._refill(ranks)
        print(
            f"WARNING: {what}; replaced on its slot{' and refitted' if self._refill else ''}, and its {during} call "
            f"is made again ({self.replacements} of {limit} replacements used)",
            flush=True,
        )
        return True


def _actor_ids(group: WatchedWorkerGroup, refs: dict[int, Any]) -> dict[int, str]:
    """The actor id of each rank of ``refs`` now (to tell later whether it was replaced meanwhile)."""
    return {rank: group.workers[rank]._actor_id.hex() for rank in refs}
