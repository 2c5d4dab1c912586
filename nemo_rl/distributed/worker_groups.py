"""A group of Ray actors, one per bundle of a :class:`RayVirtualCluster`, driven as one SPMD program.

Ranks follow the order of ``bundle_indices``. The ranks form a (dp, tp) mesh laid out row-major: rank ``r`` is
in data-parallel group ``r // tp_size`` with tensor-parallel rank ``r % tp_size``, where
``tp_size = world_size // dp_size``. Every actor gets, through its runtime environment:

- ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
  (so :func:`nemo_rl.distributed.device.init_process_group_from_env` works as is);
- ``NEMO_RL_WORKER_GROUP`` (the group name), ``NEMO_RL_DP_RANK``, ``NEMO_RL_DP_SIZE``, ``NEMO_RL_TP_RANK``,
  ``NEMO_RL_TP_SIZE`` and ``NEMO_RL_BUNDLE_INDEX``.

``CUDA_VISIBLE_DEVICES`` is left to Ray, which assigns each actor the GPU of its bundle.

The driver side the policy and generation facades build on (waiting for a group, starting several together,
calls with a timeout) is :mod:`nemo_rl.distributed.worker_group_facade`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.actor import ActorClass, ActorHandle
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_rl.distributed.virtual_cluster import RayVirtualCluster

logger = logging.getLogger(__name__)

# Seconds the graceful ``shutdown`` method of the workers may take before they are killed.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 30.0

# Bound on the remembered (ref -> rank, method) entries of results nobody fetched.
_MAX_TRACKED_REFS = 100_000

# Ray colours parts of its error messages; they are noise in an exception text.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")

_RESERVED_ENV_VARS = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NEMO_RL_WORKER_GROUP",
        "NEMO_RL_DP_RANK",
        "NEMO_RL_DP_SIZE",
        "NEMO_RL_TP_RANK",
        "NEMO_RL_TP_SIZE",
        "NEMO_RL_BUNDLE_INDEX",
    }
)


def _put_once(value: Any) -> Any:
    """``value`` in the object store (refs are passed as they are: Ray resolves top-level refs in the actor)."""
    return value if isinstance(value, ray.ObjectRef) else ray.put(value)


class WorkerDiedError(RuntimeError):
    """A worker actor of a :class:`RayWorkerGroup` died (crashed, was killed, or failed in ``__init__``)."""

    def __init__(self, group_name: str, rank: int | None, cause: str) -> None:
        self.group_name = group_name
        self.rank = rank
        self.cause = cause
        who = f"rank {rank}" if rank is not None else "a worker"
        super().__init__(f"{who} of worker group {group_name!r} died. Ray reported: {cause}")


class RayWorkerGroup:
    """One actor of ``worker_cls`` per bundle of ``cluster``, run as ranks of one program.

    ``worker_cls`` is a plain class; it is wrapped with ``ray.remote`` and each actor is scheduled onto its
    bundle, taking ``1 / cluster.max_colocated_worker_groups`` of the bundle so that several groups can share
    the bundles (colocated mode). ``bundle_indices`` picks the bundles (global indices of ``cluster``, one
    worker each, ranks in that order; default: all of them), so disjoint lists give non-colocated groups.
    ``dp_size`` (default: ``world_size``, i.e. no tensor parallelism) sets the (dp, tp) mesh.
    ``max_concurrency`` above 1 makes threaded actors that run that many calls at once (a generation worker
    taking a refit while it decodes. (:class:`~nemo_rl.distributed.worker_watch.WatchedWorkerGroup` adds pings
    and replacing lost workers.)

    Construction does not wait for the actors; :meth:`wait_until_ready` does, and any method call surfaces a
    failed ``__init__`` as :class:`WorkerDiedError`.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        worker_cls: type,
        *,
        name: str,
        init_args: Sequence[Any] = (),
        init_kwargs: Mapping[str, Any] | None = None,
        bundle_indices: Sequence[int] | None = None,
        dp_size: int | None = None,
        env_vars: Mapping[str, str] | None = None,
        max_concurrency: int = 1,
    ) -> None:
        if isinstance(worker_cls, ActorClass):
            raise TypeError(
                f"RayWorkerGroup {name!r}: pass the plain worker class, not one decorated with @ray.remote; "
                "the group sets the actor options itself"
            )
        bundles = (
            list(range(cluster.world_size)) if bundle_indices is None else [int(b) for b in bundle_indices]
        )
        if not bundles:
            raise ValueError(f"RayWorkerGroup {name!r}: bundle_indices is empty")
        if len(set(bundles)) != len(bundles):
            raise ValueError(f"RayWorkerGroup {name!r}: bundle_indices {bundles} repeats a bundle")
        world_size = len(bundles)
        dp = world_size if dp_size is None else dp_size
        if dp < 1 or world_size % dp != 0:
            raise ValueError(
                f"RayWorkerGroup {name!r}: dp_size={dp_size} must be >= 1 and divide the {world_size} workers"
            )
        reserved = sorted(_RESERVED_ENV_VARS.intersection(env_vars or {}))
        if reserved:
            raise ValueError(
                f"RayWorkerGroup {name!r}: env_vars may not set {reserved}; the group sets them per rank"
            )

        self.name = name
        self.cluster = cluster
        self.bundle_indices = bundles
        self._worker_cls = worker_cls
        self._max_concurrency = max_concurrency
        self._world_size = world_size
        self._dp_size = dp
        self._tp_size = world_size // dp
        self._ref_owners: dict[str, tuple[int, str]] = {}
        # Calls made by run_all_workers_deferred that no wait has collected yet.
        self._deferred: list[ray.ObjectRef] = []
        self._shut_down = False
        self.death_note: str | None = None
        """Added to every :class:`WorkerDiedError` of this group (e.g. the other roles its workers play)."""

        cluster.reserve_bundles(bundles, name)
        try:
            self._workers, self._actor_ranks = self._start_workers(
                init_args, dict(init_kwargs or {}), dict(env_vars or {})
            )
        except BaseException:
            cluster.release_bundles(bundles, name)
            raise

    def _start_workers(
        self, init_args: Sequence[Any], init_kwargs: dict[str, Any], env_vars: dict[str, str]
    ) -> tuple[list[ActorHandle], dict[str, int]]:
        # Stored once and resolved by Ray in each actor, instead of serialised once per actor; kept for the
        # replacements of :meth:`replace_workers`.
        self._init_args = [_put_once(arg) for arg in init_args]
        self._init_kwargs = {key: _put_once(value) for key, value in init_kwargs.items()}
        self._env_vars = env_vars
        self._master = self.cluster.get_master_address_and_port(self.bundle_indices[0])
        self._actor_cls = self._remote_class()
        workers: list[ActorHandle] = []
        actor_ranks: dict[str, int] = {}
        try:
            for rank in range(len(self.bundle_indices)):
                worker = self._start_worker(rank)
                workers.append(worker)
                actor_ranks[worker._actor_id.hex()] = rank
        except BaseException:
            for started in workers:
                ray.kill(started, no_restart=True)
            raise
        return workers, actor_ranks

    def _remote_class(self) -> Any:
        """The worker class as a Ray actor class."""
        return ray.remote(self._worker_cls)

    def _start_worker(self, rank: int) -> ActorHandle:
        """Start the actor of ``rank`` on its bundle, with the rank's environment (see the module docstring)."""
        locations = self.cluster.bundle_locations()
        node_of_rank = [locations[b].node_id for b in self.bundle_indices]
        location = locations[self.bundle_indices[rank]]
        same_node = [r for r, node in enumerate(node_of_rank) if node == location.node_id]
        master_addr, master_port = self._master
        rank_env = {
            **self._env_vars,
            "RANK": str(rank),
            "WORLD_SIZE": str(self._world_size),
            "LOCAL_RANK": str(same_node.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(same_node)),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "NEMO_RL_WORKER_GROUP": self.name,
            "NEMO_RL_DP_RANK": str(rank // self._tp_size),
            "NEMO_RL_DP_SIZE": str(self._dp_size),
            "NEMO_RL_TP_RANK": str(rank % self._tp_size),
            "NEMO_RL_TP_SIZE": str(self._tp_size),
            "NEMO_RL_BUNDLE_INDEX": str(self.bundle_indices[rank]),
        }
        resources = self.cluster.actor_resources()
        worker: ActorHandle = self._actor_cls.options(
            max_concurrency=self._max_concurrency,
            num_cpus=resources["num_cpus"],
            num_gpus=resources["num_gpus"],
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=location.placement_group,
                placement_group_bundle_index=location.pg_bundle_index,
            ),
            runtime_env={"env_vars": rank_env},
        ).remote(*self._init_args, **self._init_kwargs)
        return worker

    in_process = False
    """The workers are Ray actors (arguments too large to copy per call go through the object store)."""

    @property
    def workers(self) -> list[ActorHandle]:
        """The actor handles, in rank order."""
        return list(self._workers)

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return self._world_size

    @property
    def dp_size(self) -> int:
        """Number of data-parallel groups."""
        return self._dp_size

    @property
    def tp_size(self) -> int:
        """Workers per data-parallel group (``world_size // dp_size``)."""
        return self._tp_size

    def dp_rank(self, rank: int) -> int:
        """Data-parallel group of worker ``rank``."""
        return rank // self._tp_size

    @property
    def dp_leader_ranks(self) -> list[int]:
        """The first rank of each data-parallel group, in dp order."""
        return list(range(0, self._world_size, self._tp_size))

    def run_all_workers_single_data(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Call ``method(*args, **kwargs)`` on every worker; one result ref per worker, in rank order."""
        return [self._call(rank, method, args, kwargs) for rank in range(self._world_size)]

    def run_all_workers_deferred(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Call ``method(*args, **kwargs)`` on every worker without waiting for it.

        For state changes a waited call follows (``prepare_for_training`` before ``train``): an actor runs one
        caller's calls in the order they were made, so the workers finish this call before the next one this
        process makes, and the next :meth:`get_all_worker_results` waits for it too and raises its errors.
        That saves the driver one round trip to every worker per state change.
        """
        self._deferred.extend(self.run_all_workers_single_data(method, *args, **kwargs))

    def run_all_workers_sharded_data(
        self, method: str, data_shards: Sequence[Any], *args: Any, **kwargs: Any
    ) -> list[ray.ObjectRef]:
        """Call ``method(data_shards[dp_rank], *args, **kwargs)`` on every worker, in rank order.

        ``data_shards`` holds one entry per data-parallel group; every rank of group ``i`` (its tensor-parallel
        peers) receives ``data_shards[i]``, stored once in the object store.
        """
        if len(data_shards) != self._dp_size:
            raise ValueError(
                f"worker group {self.name!r}: got {len(data_shards)} data shards for dp_size={self._dp_size}; "
                "shard the data with BatchedDataDict.shard_by_batch_size(group.dp_size, ...)"
            )
        shard_refs = [ray.put(shard) for shard in data_shards]
        return [
            self._call(rank, method, (shard_refs[self.dp_rank(rank)], *args), kwargs)
            for rank in range(self._world_size)
        ]

    def run_single_worker(self, method: str, rank: int, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Call ``method(*args, **kwargs)`` on worker ``rank`` only."""
        if not 0 <= rank < self._world_size:
            raise IndexError(f"worker group {self.name!r} has no rank {rank} (world size {self._world_size})")
        return self._call(rank, method, args, kwargs)

    def get_all_worker_results(self, refs: Sequence[ray.ObjectRef], timeout_s: float) -> list[Any]:
        """Results of ``refs`` in order, waiting at most ``timeout_s`` in all.

        The first failure is raised as soon as it arrives: a dead worker as :class:`WorkerDiedError`, an
        exception raised by a method as itself (Ray's ``RayTaskError`` subclassing the original type) with a note
        naming the worker. Raises ``TimeoutError`` naming the workers still running after ``timeout_s``. The
        calls of :meth:`run_all_workers_deferred` made since the last wait are waited for first, in the same time.
        """
        deferred, self._deferred = self._deferred, []
        ref_list = [*deferred, *refs]
        position = {ref.hex(): i for i, ref in enumerate(ref_list)}
        if len(position) != len(ref_list):
            raise ValueError(f"worker group {self.name!r}: get_all_worker_results got the same ref twice")
        results: list[Any] = [None] * len(ref_list)
        pending = ref_list
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"worker group {self.name!r}: {self._describe(pending)} did not finish within {timeout_s:g} s"
                )
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            for ref in ready:
                results[position[ref.hex()]] = self._fetch(ref)
        return results[len(deferred) :]

    def get_dp_leader_results(self, refs: Sequence[ray.ObjectRef], timeout_s: float) -> list[Any]:
        """Wait for every worker's result, then return those of the dp leaders (first rank of each dp group).

        ``refs`` must hold one ref per worker in rank order, as the ``run_all_workers_*`` methods return.
        """
        if len(refs) != self._world_size:
            raise ValueError(
                f"worker group {self.name!r}: get_dp_leader_results needs one ref per worker ({self._world_size}), "
                f"got {len(refs)}"
            )
        results = self.get_all_worker_results(refs, timeout_s)
        return [results[rank] for rank in self.dp_leader_ranks]

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until every actor has finished ``__init__``; a failed one raises :class:`WorkerDiedError`."""
        self.get_all_worker_results(self.request_ready(), timeout_s)

    def request_ready(self) -> list[ray.ObjectRef]:
        """One ref per actor (rank order) that resolves once its ``__init__`` has finished."""
        refs: list[ray.ObjectRef] = [worker.__ray_ready__.remote() for worker in self._workers]
        for rank, ref in enumerate(refs):
            self._remember(ref, rank, "__init__")
        return refs

    def shutdown(self, graceful_timeout_s: float = GRACEFUL_SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the workers: call their ``shutdown`` method if the class defines one, then kill the actors.

        First the calls of :meth:`run_all_workers_deferred` that no wait collected are waited for: each failure
        is reported to the cluster (:mod:`nemo_rl.distributed.lost_calls`), whose ``shutdown`` raises it.
        A worker that fails or hangs in its ``shutdown`` is logged and killed anyway. Everything shares
        ``graceful_timeout_s``. Safe to call twice.
        """
        if self._shut_down:
            return
        self._shut_down = True
        deadline = time.monotonic() + graceful_timeout_s
        self._report_deferred_failures(deadline)
        if callable(getattr(self._worker_cls, "shutdown", None)):
            refs: list[ray.ObjectRef] = [worker.shutdown.remote() for worker in self._workers]
            hung = refs
            while hung and time.monotonic() < deadline:
                done, hung = ray.wait(hung, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
                if any(not self._shut_down_cleanly(refs.index(ref), ref) for ref in done):
                    # A rank is dead: the others may be stuck in a collective with it, so stop waiting.
                    break
            if hung:
                logger.warning(
                    "worker group %r: %d workers did not finish shutdown(); killing them",
                    self.name,
                    len(hung),
                )
        for worker in self._workers:
            ray.kill(worker, no_restart=True)
        self.cluster.release_bundles(self.bundle_indices, self.name)
        self._ref_owners.clear()
        self._deferred.clear()

    def _report_deferred_failures(self, deadline: float) -> None:
        """Wait until ``deadline`` for the deferred calls no wait collected and report each failure to the cluster;
        the ones still running are named in a warning. A dead rank ends the wait: the others may be stuck in a
        collective with it."""
        pending, self._deferred = self._deferred, []
        while pending and time.monotonic() < deadline:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not all([self._report_if_failed(ref) for ref in done]):
                break
        if pending:
            logger.warning(
                "worker group %r: deferred calls still running at shutdown: %s",
                self.name,
                self._describe(pending),
            )

    def _report_if_failed(self, ref: ray.ObjectRef) -> bool:
        """Report the finished deferred call ``ref`` to the cluster if it failed, naming the call, the rank and the
        error's first line; whether its worker is still alive."""
        rank, method = self._ref_owners.get(ref.hex(), (None, "?"))
        try:
            self._fetch(ref)
        except (WorkerDiedError, RayTaskError) as error:
            # A RayTaskError's text holds the remote traceback; its cause is the worker's own exception.
            cause = error.cause if isinstance(error, RayTaskError) and error.cause else error
            first_line = (str(cause).strip().splitlines() or [""])[0]
            self.cluster.lost_calls.report(
                f"worker group {self.name!r}: deferred call {method}() on rank {rank} failed: "
                f"{type(cause).__name__}: {_ANSI_ESCAPE.sub('', first_line)}"
            )
            return not isinstance(error, WorkerDiedError)
        return True

    def _shut_down_cleanly(self, rank: int, ref: ray.ObjectRef) -> bool:
        """Whether rank ``rank``'s ``shutdown`` call returned (False: the worker was dead)."""
        try:
            ray.get(ref)
        except RayActorError:
            logger.info("worker group %r: rank %d was already dead at shutdown", self.name, rank)
            return False
        except RayTaskError as error:
            logger.warning("worker group %r: rank %d failed in shutdown(): %s", self.name, rank, error)
        return True

    def __enter__(self) -> RayWorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _call(self, rank: int, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> ray.ObjectRef:
        if self._shut_down:
            raise RuntimeError(f"worker group {self.name!r} was shut down")
        if not callable(getattr(self._worker_cls, method, None)):
            raise AttributeError(f"worker class {self._worker_cls.__name__} has no method {method!r}")
        ref = getattr(self._workers[rank], method).remote(*args, **kwargs)
        self._remember(ref, rank, method)
        return ref

    def _remember(self, ref: ray.ObjectRef, rank: int, method: str) -> None:
        # Keyed by hex, not by the ref: holding refs would keep their results alive in the object store.
        if len(self._ref_owners) >= _MAX_TRACKED_REFS:
            self._ref_owners.pop(next(iter(self._ref_owners)))
        self._ref_owners[ref.hex()] = (rank, method)

    def _describe(self, refs: Sequence[ray.ObjectRef]) -> str:
        owners = [self._ref_owners.get(ref.hex()) for ref in refs]
        known = [f"rank {owner[0]} ({owner[1]})" for owner in owners if owner is not None]
        unknown = len(owners) - len(known)
        return ", ".join(known + ([f"{unknown} refs not started by this group"] if unknown else []))

    def _fetch(self, ref: ray.ObjectRef) -> Any:
        owner = self._ref_owners.pop(ref.hex(), None)
        try:
            return ray.get(ref)
        except RayActorError as error:
            rank = self._actor_ranks.get(error.actor_id or "", owner[0] if owner else None)
            died = WorkerDiedError(self.name, rank, _ANSI_ESCAPE.sub("", str(error)))
            if self.death_note is not None:
                died.add_note(self.death_note)
            raise died from error
        except RayTaskError as error:
            where = f"rank {owner[0]}, method {owner[1]!r}" if owner else "a worker"
            error.add_note(f"raised in {where} of worker group {self.name!r}")
            raise
