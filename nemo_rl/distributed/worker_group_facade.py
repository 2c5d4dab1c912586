"""The driver side of a worker group (:class:`WorkerGroup`: Ray actors, or one worker in the driver's process):
what the policy and generation facades build on.

:class:`WorkerGroupFacade` waits for a just-started group (shutting it down when it fails to start) and calls
its workers with a timeout; :func:`start_together` lets several facades' groups start at once and waits for
all of them at the end of its block.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from nemo_rl.distributed.single_process import LocalCluster, LocalWorkerGroup
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_groups import RayWorkerGroup

# Facades created inside ``start_together`` blocks: the innermost open block's list, or None outside any.
_STARTING_TOGETHER: contextvars.ContextVar[list[WorkerGroupFacade] | None] = contextvars.ContextVar(
    "nemo_rl_starting_together", default=None
)


class WorkerGroup(Protocol):
    """A started worker group, as the facades drive it: Ray actors (:class:`RayWorkerGroup`) or the one worker of
    a run in the driver's process (:class:`~nemo_rl.distributed.single_process.LocalWorkerGroup`). A call returns
    one ref per worker (Ray object refs, or ``LocalRef`` s) that only the same group's getters read."""

    name: str
    bundle_indices: list[int]
    death_note: str | None
    in_process: bool

    @property
    def cluster(self) -> RayVirtualCluster | LocalCluster:
        """The slots the group runs on."""
        ...

    @property
    def workers(self) -> list[Any]:
        """The workers in rank order (Ray actor handles, or the in-process worker)."""
        ...

    @property
    def world_size(self) -> int:
        """Number of workers."""
        ...

    @property
    def dp_size(self) -> int:
        """Number of data-parallel groups."""
        ...

    @property
    def tp_size(self) -> int:
        """Workers per data-parallel group."""
        ...

    @property
    def dp_leader_ranks(self) -> list[int]:
        """The first rank of each data-parallel group."""
        ...

    def dp_rank(self, rank: int) -> int:
        """Data-parallel group of worker ``rank``."""
        ...

    def run_all_workers_single_data(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` on every worker; one ref per worker."""
        ...

    def run_all_workers_deferred(self, method: str, *args: Any, **kwargs: Any) -> None:
        """``method`` on every worker, waited for with the next wait."""
        ...

    def run_all_workers_sharded_data(
        self, method: str, data_shards: Sequence[Any], *args: Any, **kwargs: Any
    ) -> list[Any]:
        """``method(data_shards[dp_rank], ...)`` on every worker."""
        ...

    def run_single_worker(self, method: str, rank: int, *args: Any, **kwargs: Any) -> Any:
        """``method`` on worker ``rank``; its ref."""
        ...

    def get_all_worker_results(self, refs: Sequence[Any], timeout_s: float) -> list[Any]:
        """The refs' values in order."""
        ...

    def get_dp_leader_results(self, refs: Sequence[Any], timeout_s: float) -> list[Any]:
        """The dp leaders' values."""
        ...

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until every worker is built."""
        ...

    def request_ready(self) -> list[Any]:
        """One ref per worker, ready once it is built."""
        ...

    def shutdown(self, graceful_timeout_s: float = ...) -> None:
        """Stop the workers."""
        ...


def start_worker_group(
    cluster: RayVirtualCluster | LocalCluster, worker_cls: type, **kwargs: Any
) -> WorkerGroup:
    """A :class:`RayWorkerGroup` on ``cluster``'s bundles, or on a
    :class:`~nemo_rl.distributed.single_process.LocalCluster` the worker in this process (same arguments)."""
    if isinstance(cluster, LocalCluster):
        return LocalWorkerGroup(cluster, worker_cls, **kwargs)
    return RayWorkerGroup(cluster, worker_cls, **kwargs)


@contextlib.contextmanager
def start_together(enabled: bool = True) -> Iterator[None]:
    """Start the worker groups of the facades created in this block at once; wait for all of them at its end.

    A worker's start is mostly its process importing torch and loading a model, so groups that start
    together overlap those waits instead of adding them up. Until the block ends, do not call the new
    facades' workers (a call would wait for that group alone). When any group fails to start, every group of
    the block is shut down before the error propagates. ``enabled=False`` makes the block a no-op (each
    facade waits for its own group when it is created), for backends that must start in order.
    """
    if not enabled:
        yield
        return
    started: list[WorkerGroupFacade] = []
    token = _STARTING_TOGETHER.set(started)
    try:
        yield
    except BaseException:
        for facade in started:
            facade.shutdown()
        raise
    finally:
        _STARTING_TOGETHER.reset(token)
    try:
        # Every group's readiness requested before any is waited on; the waits then overlap.
        pending = [(facade, facade.worker_group.request_ready()) for facade in started]
        for facade, refs in pending:
            facade.worker_group.get_all_worker_results(refs, facade.call_timeout_s)
    except BaseException:
        for facade in started:
            facade.shutdown()
        raise


class WorkerGroupFacade:
    """The driver side of a worker group: what the policy and generation facades share.

    Takes a just-started :class:`RayWorkerGroup` and waits until every actor has finished ``__init__`` (inside
    a :func:`start_together` block: when the block ends); when one fails to start or the wait times out, the
    group is shut down (its bundles released) before the error propagates, so a failed start leaves no
    half-started actors holding the cluster. Every later call on the workers waits at most ``call_timeout_s``
    and then names the workers still running.
    """

    def __init__(self, worker_group: WorkerGroup, *, call_timeout_s: float) -> None:
        self.call_timeout_s = call_timeout_s
        self.worker_group = worker_group
        starting_together = _STARTING_TOGETHER.get()
        if starting_together is not None:
            starting_together.append(self)
            return
        try:
            self.worker_group.wait_until_ready(call_timeout_s)
        except BaseException:
            self.worker_group.shutdown()
            raise

    @property
    def dp_size(self) -> int:
        """Number of data-parallel groups (each gets a different shard of every batch)."""
        return self.worker_group.dp_size

    @property
    def workers(self) -> list[Any]:
        """The worker actors in rank order (what ``nemo_rl.weight_sync.refit`` sends from or to)."""
        return self.worker_group.workers

    def _on_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every worker (a collective call); the results in rank order."""
        refs = self.worker_group.run_all_workers_single_data(method, *args, **kwargs)
        return self.worker_group.get_all_worker_results(refs, self.call_timeout_s)

    def _on_all_deferred(self, method: str) -> None:
        """``method()`` on every worker, waited for with the next call that waits (see
        :meth:`RayWorkerGroup.run_all_workers_deferred`)."""
        self.worker_group.run_all_workers_deferred(method)

    def _on_rank_0(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on worker 0 only (a query every worker would answer alike)."""
        ref = self.worker_group.run_single_worker(method, 0, *args)
        return self.worker_group.get_all_worker_results([ref], self.call_timeout_s)[0]

    def shutdown(self) -> None:
        """Stop the workers and release their bundles."""
        self.worker_group.shutdown()
