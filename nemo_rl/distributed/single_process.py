"""A run whose work fits one worker slot, run in the driver's own process: no Ray at all.

A run that needs exactly one worker (one slot, the policy's worker hosting its generation engine, every
environment in the driver) gains nothing from Ray: its daemons, the worker process and its imports only add to
the start, and a laptop's first run pays for all of them. With ``cluster.single_process`` (``auto`` by default on
a machine without CUDA) such a run keeps its one worker in the driver process instead:

- :class:`LocalCluster` stands in for :class:`~nemo_rl.distributed.virtual_cluster.RayVirtualCluster` (one slot,
  nothing to place);
- :class:`LocalWorkerGroup` stands in for :class:`~nemo_rl.distributed.worker_groups.RayWorkerGroup`: it constructs
  the worker class in this process (with the same rank environment a Ray actor gets) and runs each call at once,
  returning a :class:`LocalRef` that :meth:`LocalWorkerGroup.get_all_worker_results` (or :func:`resolve`) reads;
- environments are constructed in the driver (``nemo_rl.environments.registry.InDriverEnvironment``).

Everything else (the algorithms, the facades, checkpoints, refit into the engine the worker hosts) is the same
code as under Ray. :func:`single_process_refusal` says why a config cannot run this way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nemo_rl.distributed.lost_calls import LostCalls

if TYPE_CHECKING:
    from nemo_rl.config.cluster import ClusterConfig
    from nemo_rl.config.policy import PolicyConfig

LOCAL_NODE_ID = "local"
"""The node id of the one slot of a :class:`LocalCluster`."""


def single_process_refusal(
    cluster: ClusterConfig,
    policy: PolicyConfig,
    *,
    samples: bool,
    extra_models: Sequence[str] = (),
    reward_model_env: bool = False,
) -> str | None:
    """Why a run with this config needs Ray (a phrase to end "runs under Ray: ..."); ``None`` when its work fits
    the driver's process.

    ``samples``: the run generates (GRPO, PPO, distillation); ``extra_models``: the names of the policies it runs
    beside the trained one (a critic, a teacher), each a worker of its own; ``reward_model_env``: a reward model
    scores the samples (on workers of its own).
    """
    if cluster.world_size != 1:
        return (
            f"it has {cluster.world_size} worker slots (cluster.num_nodes x cluster.gpus_per_node); "
            "one process holds one"
        )
    if os.environ.get("RAY_ADDRESS"):
        return "RAY_ADDRESS names a Ray cluster to run on"
    if policy.megatron_cfg.enabled:
        return "the Megatron backend runs in Ray workers only"
    if samples:
        generation = policy.generation
        if generation is None or not generation.embedded_cfg.in_policy_workers:
            return (
                "its generation workers are processes of their own (set "
                "policy.generation.embedded_cfg.in_policy_workers=true to sample in the policy's worker)"
            )
    if extra_models:
        return f"it runs {', '.join(extra_models)} beside the policy, each a worker of its own"
    if reward_model_env:
        return "the reward-model environment runs on workers of its own"
    return None


def runs_in_one_process(cluster: ClusterConfig, refusal: str | None, *, cuda: bool) -> bool:
    """Whether the run goes in the driver's process: ``cluster.single_process`` resolved against ``refusal`` (from
    :func:`single_process_refusal`). ``auto`` picks it where nothing refuses and the machine has no CUDA;
    ``true`` where something refuses raises a one-line ``UserError`` naming it."""
    from nemo_rl.config.errors import UserError

    choice = cluster.single_process
    if choice is False:
        return False
    if refusal is not None:
        if choice is True:
            raise UserError(
                f"cluster.single_process=true, but this run needs Ray: {refusal}; set cluster.single_process=auto"
            )
        return False
    return choice is True or not cuda


def cuda_device_nodes() -> bool:
    """Whether this machine shows NVIDIA device files: the check a driver can make before importing torch."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*"))


def starts_in_one_process(
    cluster: ClusterConfig,
    policy: PolicyConfig,
    *,
    samples: bool,
    extra_models: Sequence[str] = (),
    reward_model_env: bool = False,
) -> bool:
    """A script's early answer (before torch is imported) to whether its run goes in one process, so that it
    starts Ray in the background only when the run will use it; ``cluster.single_process=true`` on a run that
    needs Ray stops here with the reason. The run itself decides again with what only it knows (environments
    the caller brings); where the two differ it starts Ray then."""
    refusal = single_process_refusal(
        cluster, policy, samples=samples, extra_models=extra_models, reward_model_env=reward_model_env
    )
    return runs_in_one_process(cluster, refusal, cuda=cuda_device_nodes())


class LocalRef:
    """The outcome of a call :class:`LocalWorkerGroup` (or an in-driver environment) already made: its value, or
    the exception it raised, raised again when read."""

    __slots__ = ("_error", "_value")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error

    @classmethod
    def of_call(cls, function: Any, *args: Any, **kwargs: Any) -> LocalRef:
        """Call ``function(*args, **kwargs)`` now and keep what came of it."""
        try:
            return cls(function(*args, **kwargs))
        except Exception as error:  # re-raised when read, as a Ray ref's error would be
            return cls(error=error)

    def result(self) -> Any:
        """The call's value, or its exception raised."""
        if self._error is not None:
            raise self._error
        return self._value


def resolve(ref: Any, timeout_s: float) -> Any:
    """The value behind ``ref``: a :class:`LocalRef`'s at once, a Ray object ref's waited for (at most
    ``timeout_s``)."""
    if isinstance(ref, LocalRef):
        return ref.result()
    import ray

    return ray.get(ref, timeout=timeout_s)


@dataclass(frozen=True)
class LocalLocation:
    """Where the one slot of a :class:`LocalCluster` is (the fields of a Ray bundle's location that callers read)."""

    bundle_index: int = 0
    node_id: str = LOCAL_NODE_ID
    node_ip: str = "127.0.0.1"


class LocalCluster:
    """One worker slot in the driver's process: the part of
    :class:`~nemo_rl.distributed.virtual_cluster.RayVirtualCluster` that worker groups and facades use."""

    def __init__(self, cfg: ClusterConfig, name: str = "nemo_rl") -> None:
        self.cfg = cfg
        self.name = name
        from nemo_rl.distributed.device import cuda_available

        self.use_gpus = cuda_available()
        """Whether the worker computes on the GPU (``auto`` picks one process only without CUDA; ``true`` may)."""
        self.lost_calls = LostCalls()
        """Failed calls nobody waited for (none here: every call runs before it returns), for the same API."""

    @property
    def world_size(self) -> int:
        """One slot."""
        return 1

    def bundle_locations(self) -> list[LocalLocation]:
        """The one slot's location."""
        return [LocalLocation()]

    def get_master_address_and_port(self, bundle_index: int = 0) -> tuple[str, int]:
        """The loopback address and a free port, for the worker's one-rank process group."""
        from nemo_rl.distributed.virtual_cluster import free_port

        return "127.0.0.1", free_port()

    def shutdown(self) -> None:
        """Nothing to release."""
        self.lost_calls.raise_reported()


def _quiet_model_loads() -> None:
    """No Hugging Face progress bars (the "Loading weights" bar of every model load), as Ray workers get them
    (``nemo_rl.distributed.ray_start.job_runtime_env``), unless the environment asks for them."""
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1") != "1":
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class LocalWorkerGroup:
    """One worker of ``worker_cls`` in this process, behind :class:`~nemo_rl.distributed.worker_groups.RayWorkerGroup`'s
    interface: calls run at once, in the caller's thread, and return :class:`LocalRef` s.

    The worker gets the rank environment a Ray actor would (``RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR``/
    ``MASTER_PORT`` of a free local port, ``NEMO_RL_*``), set in this process's environment while it is built.
    """

    def __init__(
        self,
        cluster: LocalCluster,
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
        if list(bundle_indices or [0]) != [0] or (dp_size or 1) != 1:
            raise ValueError(f"worker group {name!r}: one process holds one worker (slot 0, dp_size 1)")
        self.name = name
        self.cluster = cluster
        self.bundle_indices = [0]
        self.death_note: str | None = None
        """Kept for the same API; a worker in the driver's process dies with it."""
        self._worker_cls = worker_cls
        self._shut_down = False
        master_addr, master_port = cluster.get_master_address_and_port()
        os.environ.update(
            {
                **dict(env_vars or {}),
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "NEMO_RL_WORKER_GROUP": name,
                "NEMO_RL_DP_RANK": "0",
                "NEMO_RL_DP_SIZE": "1",
                "NEMO_RL_TP_RANK": "0",
                "NEMO_RL_TP_SIZE": "1",
                "NEMO_RL_BUNDLE_INDEX": "0",
            }
        )
        _quiet_model_loads()
        self._worker = worker_cls(*init_args, **dict(init_kwargs or {}))

    in_process = True
    """The worker lives in this process (arguments need no object store)."""

    @property
    def workers(self) -> list[Any]:
        """The worker object itself (what refit and identity checks read)."""
        return [self._worker]

    world_size = 1
    """One worker."""
    dp_size = 1
    """One data-parallel group."""
    tp_size = 1
    """No tensor parallelism."""
    dp_leader_ranks = [0]  # noqa: RUF012  # read-only, as RayWorkerGroup's property
    """Rank 0 leads the one group."""

    def dp_rank(self, rank: int) -> int:
        """Rank 0's group: 0."""
        return 0

    def run_all_workers_single_data(self, method: str, *args: Any, **kwargs: Any) -> list[LocalRef]:
        """Call ``method`` on the worker now; its outcome."""
        return [self._call(method, args, kwargs)]

    def run_all_workers_deferred(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Call ``method`` now; a failure is raised at once (nothing else could observe it later)."""
        self._call(method, args, kwargs).result()

    def run_all_workers_sharded_data(
        self, method: str, data_shards: Sequence[Any], *args: Any, **kwargs: Any
    ) -> list[LocalRef]:
        """Call ``method(data_shards[0], ...)`` now."""
        if len(data_shards) != 1:
            raise ValueError(f"worker group {self.name!r}: got {len(data_shards)} data shards for dp_size=1")
        return [self._call(method, (data_shards[0], *args), kwargs)]

    def run_single_worker(self, method: str, rank: int, *args: Any, **kwargs: Any) -> LocalRef:
        """Call ``method`` on rank ``rank`` (0) now."""
        if rank != 0:
            raise IndexError(f"worker group {self.name!r} has no rank {rank} (world size 1)")
        return self._call(method, args, kwargs)

    def get_all_worker_results(self, refs: Sequence[LocalRef], timeout_s: float) -> list[Any]:
        """The calls' values in order; the first that raised raises, with a note naming the group."""
        results = []
        for ref in refs:
            try:
                results.append(ref.result())
            except Exception as error:
                error.add_note(f"raised in the worker of group {self.name!r} (in the driver's process)")
                raise
        return results

    def get_dp_leader_results(self, refs: Sequence[LocalRef], timeout_s: float) -> list[Any]:
        """The one worker's result."""
        return self.get_all_worker_results(refs, timeout_s)

    def wait_until_ready(self, timeout_s: float) -> None:
        """Nothing to wait for: the worker was built in the constructor."""

    def request_ready(self) -> list[LocalRef]:
        """A ref that is ready (the worker was built in the constructor)."""
        return [LocalRef(None)]

    def shutdown(self, graceful_timeout_s: float = 0.0) -> None:
        """Call the worker's ``shutdown`` if it has one; safe to call twice."""
        if self._shut_down:
            return
        self._shut_down = True
        stop = getattr(self._worker, "shutdown", None)
        if callable(stop):
            stop()

    def __enter__(self) -> LocalWorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _call(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> LocalRef:
        if self._shut_down:
            raise RuntimeError(f"worker group {self.name!r} was shut down")
        function = getattr(self._worker, method, None)
        if not callable(function):
            raise AttributeError(f"worker class {self._worker_cls.__name__} has no method {method!r}")
        return LocalRef.of_call(function, *args, **kwargs)
