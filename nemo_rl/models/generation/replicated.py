"""The driver side shared by the generation backends: data-parallel replicas of one model on a worker group.

A backend's facade (:class:`~nemo_rl.models.generation.embedded.generation.EmbeddedGeneration`,
:class:`~nemo_rl.models.generation.vllm.generation.VllmGeneration`) names its worker class and, in
:meth:`ReplicatedGeneration._layout`, checks its own configuration and lays its replicas on the bundles;
:class:`ReplicatedGeneration` takes the constructor's arguments for every backend and implements
:class:`~nemo_rl.models.generation.interfaces.GenerationInterface` on top of them: rows dealt to the
replicas by prompt length and gathered back in input order, the colocation hooks, and the refit receiver.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ray
import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_group_facade import WorkerGroup, WorkerGroupFacade
from nemo_rl.distributed.worker_watch import WatchedWorkerGroup
from nemo_rl.models.generation.healing import PoolHealer, Refill
from nemo_rl.models.generation.interfaces import WeightManifestDict, check_generation_input
from nemo_rl.models.tokenizer import require_pad_token_id
from nemo_rl.weight_sync.guard import EngineChecksums
from nemo_rl.weight_sync.scope import RefitScope

# How long one call on the generation workers may take before the driver names the workers still running
# (loading a large model, starting vLLM (which compiles and captures CUDA graphs) or generating a large batch
# takes long; a hang should not last forever).
WORKER_CALL_TIMEOUT_S = 6 * 3600.0

# Rows are dealt to the replicas by prompt length so every replica gets a similar amount of work.
LENGTH_KEY = "input_lengths"


class SeededReplicas(abc.ABC):
    """What every driver of data-parallel generation replicas shares: the per-call seeds (and their place in
    checkpoints), dealing rows to the replicas and gathering them back in input order. :class:`ReplicatedGeneration` drives replicas in generation workers of their own,
    :class:`~nemo_rl.models.generation.embedded.in_policy.InPolicyEmbeddedGeneration` replicas hosted in the
    policy workers; the same calls on the same replicas sample the same tokens.

    Args:
        pad_token_id: what ``output_ids`` are right-padded with.
        seed: call ``k`` of :meth:`generate` samples with a seed derived from ``(seed, k)``, so a run replays
            when it makes the same calls with the same data.
    """

    backend_name: ClassVar[str]
    """The backend as error messages name it."""

    def __init__(self, *, pad_token_id: int, seed: int) -> None:
        self.pad_token_id = pad_token_id
        self._seed = seed
        self.num_generate_calls = 0
        """Calls of :meth:`generate` so far (saved with checkpoints: see :meth:`state_dict`)."""

    def _generate_on(
        self,
        worker_group: WorkerGroup,
        method: str,
        data: BatchedDataDict[Any],
        greedy: bool,
        timeout_s: float,
        seed: int | None = None,
    ) -> BatchedDataDict[Any]:
        """Deal ``data``'s rows to ``worker_group``'s dp groups by prompt length, call ``method(shard, greedy,
        call_seed)`` on every worker, and gather the dp leaders' outputs in input order. The call seed is
        ``seed`` when given (the per-call count is then left alone), else the next of the per-call seeds."""
        check_generation_input(data)
        seed = self._call_seed(seed)
        indices, shards = _deal(data, worker_group.dp_size)
        # Every rank of a replica gets its shard: model-parallel ranks run the same requests in lockstep.
        refs = worker_group.run_all_workers_sharded_data(method, shards, greedy, seed)
        results = worker_group.get_dp_leader_results(refs, timeout_s)
        return self._gathered(results, indices)

    def _call_seed(self, seed: int | None) -> int:
        """``seed``, or (``None``) the next of the per-call seeds."""
        if seed is not None:
            return seed
        self.num_generate_calls += 1
        return self._seed * 1_000_003 + self.num_generate_calls - 1

    def _gathered(self, results: list[Any], indices: list[list[int]]) -> BatchedDataDict[Any]:
        """The replicas' outputs back in input order (``indices``: each replica's rows)."""
        pads = {"output_ids": self.pad_token_id, "routed_experts": -1}
        return BatchedDataDict.from_shards(results, indices, pad_value_dict=pads)

    def state_dict(self) -> dict[str, int]:
        """The sampling seed's position: a resumed run that loads it samples what the uninterrupted run would."""
        return {"num_generate_calls": self.num_generate_calls}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue the per-call seeds from a :meth:`state_dict`."""
        self.num_generate_calls = int(state["num_generate_calls"])

    @abc.abstractmethod
    def expected_weights_manifest(self, scope: RefitScope = "full") -> WeightManifestDict:
        """``{hf_name: (full shape, dtype name)}`` the replicas expect from a refit of ``scope``."""


def _deal(data: BatchedDataDict[Any], dp_size: int) -> tuple[list[list[int]], list[BatchedDataDict[Any]]]:
    """``data``'s rows dealt to ``dp_size`` replicas by prompt length: each replica's row indices and shard."""
    indices = data.shard_indices(dp_size, allow_uneven_shards=True, balance_by_length_key=LENGTH_KEY)
    return indices, [data.select_indices(rows) for rows in indices]


@dataclass(frozen=True)
class ReplicaLayout:
    """How a backend lays its replicas on the bundles generation was given (see
    :meth:`ReplicatedGeneration._layout`)."""

    bundles: list[int]
    """The bundles the workers run on, in rank order (one worker per bundle)."""

    dp_size: int | None = None
    """The number of replicas, each spanning ``len(bundles) // dp_size`` consecutive workers (the ranks of one
    model-parallel engine); ``None``: one replica per bundle."""

    worker_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """The worker constructor's keyword arguments besides ``cfg``, ``tokenizer`` and ``model_path``."""

    env_vars: Mapping[str, str] | None = None
    """Environment variables set in every worker."""


class ReplicatedGeneration(SeededReplicas, WorkerGroupFacade):
    """Replicas of one generation model on bundles of ``cluster``; one :attr:`worker_cls` actor per bundle.

    Each backend sets :attr:`worker_cls`, :attr:`default_name` and :attr:`backend_name` (named in
    errors), and :meth:`_layout` checks its configuration and lays the
    replicas on the bundles; the replicas all receive every replica's rows and refitted weights.

    Args:
        cluster: the cluster whose bundles the workers run on.
        cfg: the ``policy`` section; ``generation.<backend>_cfg`` configures the backend.
        tokenizer: pad/EOS ids and stop-string decoding.
        seed: seeds the sampling; call ``k`` of :meth:`generate` uses a seed derived from ``(seed, k)``, so a
            run replays exactly when it makes the same calls with the same data.
        bundle_indices: bundles to run on (default: all of the cluster's); the policy's bundles when colocated.
        model_path: a local checkpoint folder to load instead of ``cfg.model_name``.
        concurrent_refit: workers take a refit while they generate (threaded actors; asynchronous GRPO's
            in-flight weight updates, see :meth:`enable_in_flight_weight_updates`).
        name: the worker group's name (default :attr:`default_name`).
    """

    worker_cls: ClassVar[type]
    """The backend's worker class (one replica rank as a Ray actor)."""
    default_name: ClassVar[str]
    """The worker group's name unless the caller gives one."""

    def __init__(
        self,
        cluster: RayVirtualCluster,
        cfg: PolicyConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int,
        bundle_indices: Sequence[int] | None = None,
        model_path: str | None = None,
        concurrent_refit: bool = False,
        name: str | None = None,
    ) -> None:
        self.cfg = cfg
        bundles = list(range(cluster.world_size)) if bundle_indices is None else list(bundle_indices)
        layout = self._layout(cluster, bundles, seed)
        SeededReplicas.__init__(self, pad_token_id=require_pad_token_id(tokenizer), seed=seed)
        workers = WatchedWorkerGroup(
            cluster,
            self.worker_cls,
            name=self.default_name if name is None else name,
            init_kwargs={
                "cfg": cfg,
                "tokenizer": tokenizer,
                "model_path": model_path,
                **layout.worker_kwargs,
            },
            bundle_indices=layout.bundles,
            dp_size=layout.dp_size,
            env_vars=layout.env_vars,
            max_concurrency=2 if concurrent_refit else 1,
        )
        self.healer = PoolHealer(workers, cfg.generation.healing, self.backend_name)
        """Replaces the workers lost during a call (:mod:`~nemo_rl.models.generation.healing`)."""
        WorkerGroupFacade.__init__(self, workers, call_timeout_s=WORKER_CALL_TIMEOUT_S)
        self.concurrent_refit = concurrent_refit

    @abc.abstractmethod
    def _layout(self, cluster: RayVirtualCluster, bundles: list[int], seed: int) -> ReplicaLayout:
        """Check the backend's configuration (``self.cfg``) against the ``bundles`` of ``cluster`` generation
        runs on (raise naming the key to change) and lay the replicas on them; ``seed`` is the run's."""

    @property
    def worker_node_ids(self) -> list[str]:
        """Ray node id of each worker, in rank order."""
        return self.watched_group.node_ids

    @property
    def watched_group(self) -> WatchedWorkerGroup:
        """The workers (the healer's group)."""
        return self.healer.group

    def generate(
        self, data: BatchedDataDict[Any], greedy: bool = False, seed: int | None = None
    ) -> BatchedDataDict[Any]:
        """Sample a response per row; see :class:`~nemo_rl.models.generation.interfaces.GenerationInterface`.

        A worker lost during the call is replaced and its rows sampled again, with the same seeds
        (:mod:`~nemo_rl.models.generation.healing`)."""
        check_generation_input(data)
        seed = self._call_seed(seed)
        while True:
            indices, shards = _deal(data, self.worker_group.dp_size)
            results = self.healer.run_sharded("generate", shards, greedy, seed, timeout_s=self.call_timeout_s)
            if results is not None:
                return self._gathered(results, indices)

    def _on_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args)`` on every worker, replacing the workers lost meanwhile."""
        if kwargs:
            raise TypeError("generation worker calls take positional arguments only")
        return self.healer.run_all(method, *args, timeout_s=self.call_timeout_s)

    def prepare_for_generation(self) -> None:
        """Weights (and whatever cache memory the backend freed) back onto the devices."""
        self.healer.set_phase(None)
        self._on_all("prepare_for_generation")

    def finish_generation(self) -> None:
        """Free the devices for colocated training (KV caches dropped, weights offloaded as the backend does)."""
        self._on_all("finish_generation")
        self.healer.set_phase("finish_generation")  # a replacement sleeps too, until the next prepare

    # ------------------------------------------------------------------------------- healing
    def set_refill(self, refill: Refill | None) -> None:
        """The run's function that loads its current weights into replaced workers (a refit of them)."""
        self.healer.set_refill(refill)

    def replace_lost_workers(self) -> bool:
        """Replace the workers that died or hang (found by pinging each); whether any was."""
        return self.healer.replace_lost_workers()

    def take_metrics(self) -> dict[str, float]:
        """``generation/replaced_workers`` since the last call, when any was."""
        return self.healer.take_metrics()

    def enable_in_flight_weight_updates(self, recompute_kv_cache: bool) -> None:
        """From now on a refit that arrives while the workers generate is applied between two decode steps of
        the running requests, their KV cache recomputed with the new weights when ``recompute_kv_cache``."""
        if not self.concurrent_refit:
            raise ValueError(
                f"the {self.backend_name} generation workers were started without concurrent_refit=True, so a "
                "refit cannot reach them while they generate"
            )
        self._on_all("enable_in_flight_weight_updates", recompute_kv_cache)
        self.healer.remember("enable_in_flight_weight_updates", recompute_kv_cache)

    # ------------------------------------------------------------------------------- refit receiver
    @property
    def hosted_in_policy(self) -> bool:
        """False: these workers are processes of their own and receive refits through a transport."""
        return False

    def refit_in_process(self, scope: RefitScope) -> dict[str, float]:
        """Not for these workers: they run in processes of their own and receive through a transport."""
        raise ValueError(
            f"the {self.backend_name} generation workers run in processes of their own: refit them through "
            "nemo_rl.weight_sync.Refitter, which sends the weights over a transport"
        )

    def expected_weights_manifest(self, scope: RefitScope = "full") -> WeightManifestDict:
        """``{hf_name: (full shape, dtype name)}`` the workers expect from a refit of ``scope`` (every worker
        loads full tensors)."""
        manifest: WeightManifestDict = self._on_rank_0("expected_weights_manifest", scope)
        return manifest

    def held_weight_checksums(self) -> list[EngineChecksums]:
        """Per replica, its ranks' ``weight_checksums()`` (``None`` when one of them cannot report now)."""
        reports = self._on_all("weight_checksums")
        ranks = len(reports) // self.dp_size
        replicas = [reports[i * ranks : (i + 1) * ranks] for i in range(self.dp_size)]
        return [None if any(r is None for r in replica) else replica for replica in replicas]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full weights from the driver into every worker (each weight exactly once)."""
        tensors = [(name, tensor.detach().cpu()) for name, tensor in named_tensors]
        ref = ray.put(tensors)
        self._on_all("load_weights_from_stream", ref)
