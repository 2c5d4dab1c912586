"""Waiting for worker calls while watching the workers: a worker that dies or stops answering is reported, not
waited on.

:func:`gather_watching` is the wait of a pool that replaces its lost workers (the generation workers, see
:mod:`nemo_rl.models.generation.healing`): instead of raising at the first dead worker, it collects every
call's result and every failed worker, telling a hung worker (alive, but silent past ``hang_timeout_s``) from a
busy one by pinging it on a thread of its own (:meth:`WatchedWorkerGroup.ping`). A call that raises in a living
worker is a bug, not a lost worker, and is raised as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from nemo_rl.distributed.worker_groups import RayWorkerGroup, WorkerDiedError

HEALTH_GROUP = "health"
"""The actors' concurrency group that answers pings."""


def _node_id(_worker: Any) -> str:
    """Run inside a worker: the Ray node it runs on."""
    return str(ray.get_runtime_context().get_node_id())


def _answer(_worker: Any) -> bool:
    """What a ping runs inside the worker: nothing, so any answer means the process is alive and scheduling."""
    return True


class WatchedWorkerGroup(RayWorkerGroup):
    """A :class:`RayWorkerGroup` whose workers can be watched and replaced: every actor has a thread of its own
    that answers :meth:`ping` while it runs another call (so a hung worker can be told from a busy one), and
    :meth:`replace_workers` / :meth:`drop_dp_groups` let the group go on after losing workers. Same arguments.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._moved_nodes: dict[int, str] = {}
        super().__init__(*args, **kwargs)

    def _remote_class(self) -> Any:
        return ray.remote(concurrency_groups={HEALTH_GROUP: 1})(self._worker_cls)  # type: ignore[call-overload]  # ray's stubs lack the key

    @property
    def node_ids(self) -> list[str]:
        """Ray node id of each worker, in rank order: its bundle's at the start, then where each replacement
        runs (Ray moves a placement group's bundle off a lost node, and the replacement goes with it)."""
        locations = self.cluster.bundle_locations()
        return [self._moved_nodes.get(b, locations[b].node_id) for b in self.bundle_indices]

    def ping(self, ranks: Sequence[int]) -> dict[int, ray.ObjectRef]:
        """One health ping per rank of ``ranks``: a ref that resolves as soon as the worker's process answers,
        even while it runs another call (the ping has a thread of its own)."""
        return {
            rank: self._workers[rank].__ray_call__.options(concurrency_group=HEALTH_GROUP).remote(_answer)
            for rank in ranks
        }

    def replace_workers(self, ranks: Sequence[int], timeout_s: float) -> None:
        """Kill the workers of ``ranks`` (dead, hung or alive) and start new ones in their places: the same
        bundles, rank environments and constructor arguments; wait until they are ready.

        Raises ``TimeoutError`` when a replacement has not started within ``timeout_s`` (its bundle's node is
        gone, say) and :class:`WorkerDiedError` when one fails in ``__init__``; the failed ones are killed.
        """
        for rank in ranks:
            old = self._workers[rank]
            ray.kill(old, no_restart=True)
            self._actor_ranks.pop(old._actor_id.hex(), None)
            self._workers[rank] = self._start_worker(rank)
            self._actor_ranks[self._workers[rank]._actor_id.hex()] = rank
        refs: list[ray.ObjectRef] = [self._workers[rank].__ray_ready__.remote() for rank in ranks]
        for rank, ref in zip(ranks, refs, strict=True):
            self._remember(ref, rank, "__init__")
        try:
            self.get_all_worker_results(refs, timeout_s)
            nodes: list[str] = ray.get(
                [
                    self._workers[rank].__ray_call__.options(concurrency_group=HEALTH_GROUP).remote(_node_id)
                    for rank in ranks
                ],
                timeout=timeout_s,
            )
        except BaseException:
            for rank in ranks:
                ray.kill(self._workers[rank], no_restart=True)
            raise
        self._moved_nodes.update({self.bundle_indices[r]: node for r, node in zip(ranks, nodes, strict=True)})

    def drop_dp_groups(self, dp_ranks: Sequence[int]) -> None:
        """Kill the workers of the data-parallel groups ``dp_ranks`` and go on without them: the group then has
        fewer dp groups, the later ones renumbered (their processes keep the environment they started with)."""
        dropped = {rank for rank in range(self._world_size) if self.dp_rank(rank) in set(dp_ranks)}
        if len(dropped) == self._world_size:
            raise ValueError(f"worker group {self.name!r}: dropping every dp group leaves no worker")
        for rank in sorted(dropped):
            ray.kill(self._workers[rank], no_restart=True)
        self.cluster.release_bundles([self.bundle_indices[r] for r in sorted(dropped)], self.name)
        kept = [rank for rank in range(self._world_size) if rank not in dropped]
        self._workers = [self._workers[rank] for rank in kept]
        self.bundle_indices = [self.bundle_indices[rank] for rank in kept]
        self._actor_ranks = {worker._actor_id.hex(): rank for rank, worker in enumerate(self._workers)}
        self._world_size = len(kept)
        self._dp_size = self._world_size // self._tp_size


@dataclass(frozen=True)
class WorkerFailure:
    """A worker lost during a call: dead (its process is gone) or hung (alive but silent)."""

    rank: int
    """The worker's rank in its group."""

    hung: bool
    """True: it answered no ping for the hang timeout; False: it died."""

    cause: str
    """What Ray reported (a death), or how long it was silent (a hang); one line."""

    @property
    def verb(self) -> str:
        """``"died"`` or ``"hung"``."""
        return "hung" if self.hung else "died"


def first_line(text: str) -> str:
    """The first line of an error's text (Ray's reports run to many lines), at most 300 characters."""
    return (text.strip().splitlines() or [""])[0][:300]


def gather_watching(
    group: WatchedWorkerGroup,
    refs: Mapping[int, ray.ObjectRef],
    *,
    timeout_s: float,
    hang_timeout_s: float,
) -> tuple[dict[int, Any], dict[int, WorkerFailure]]:
    """Wait for ``refs`` (one call per rank, ``{rank: ref}``) until each has a result or its worker is lost.

    A worker is lost when it dies or when it answers no ping for ``hang_timeout_s``. Once a rank is lost, its
    tensor-parallel peers' calls are not waited for either (they may be stuck in a collective with it): the
    caller replaces whole data-parallel groups.

    Returns ``(results, failures)``: the results by rank of the calls that finished, and the lost workers by
    rank. Raises ``TimeoutError`` naming the calls still running after ``timeout_s``, and a call's own
    exception (from a living worker) as :meth:`RayWorkerGroup.get_all_worker_results` does.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    check_s = max(hang_timeout_s / 4, 0.05)
    pending: dict[ray.ObjectRef, int] = {ref: rank for rank, ref in refs.items()}
    pings: dict[ray.ObjectRef, int] = {}
    pinged_at = dict.fromkeys(refs, start)
    seen_at = dict.fromkeys(refs, start)
    results: dict[int, Any] = {}
    failures: dict[int, WorkerFailure] = {}

    def lose(failure: WorkerFailure) -> None:
        failures[failure.rank] = failure
        peers = {r for r in refs if group.dp_rank(r) == group.dp_rank(failure.rank)}
        for ref, rank in list(pending.items()):
            if rank in peers:
                del pending[ref]

    while pending:
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(
                f"worker group {group.name!r}: {group._describe(list(pending))} did not finish within {timeout_s:g} s"
            )
        waiting = [*pending, *pings]
        ready, _ = ray.wait(waiting, num_returns=1, timeout=min(deadline - now, check_s))
        for ref in ready:
            if ref in pings:
                rank = pings.pop(ref)
                try:
                    ray.get(ref)
                    seen_at[rank] = time.monotonic()
                except RayActorError as error:
                    if rank not in failures:
                        lose(WorkerFailure(rank, False, first_line(str(error))))
            elif ref in pending:
                rank = pending.pop(ref)
                try:
                    results[rank] = group._fetch(ref)
                except WorkerDiedError as error:
                    lose(WorkerFailure(rank, False, first_line(error.cause)))
        _watch(group, pending, pings, pinged_at, seen_at, check_s, hang_timeout_s, lose)
    return results, failures


def _watch(
    group: WatchedWorkerGroup,
    pending: dict[ray.ObjectRef, int],
    pings: dict[ray.ObjectRef, int],
    pinged_at: dict[int, float],
    seen_at: dict[int, float],
    check_s: float,
    hang_timeout_s: float,
    lose: Callable[[WorkerFailure], None],
) -> None:
    """Ping the ranks still running a call (one ping at a time each) and lose those silent too long."""
    now = time.monotonic()
    outstanding = set(pings.values())
    for rank in sorted(set(pending.values())):
        if rank not in pending.values():  # a peer of a rank lost in this pass
            continue
        silent_s = now - seen_at[rank]
        if silent_s > hang_timeout_s:
            lose(WorkerFailure(rank, True, f"answered no ping for {silent_s:.0f} s"))
        elif rank not in outstanding and now - pinged_at[rank] >= check_s:
            pinged_at[rank] = now
            pings.update({ref: r for r, ref in group.ping([rank]).items()})
