"""The driver side of the embedded engine: data-parallel replicas behind :class:`GenerationInterface`."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import ray
import torch
from ray.actor import ActorHandle
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_groups import RayWorkerGroup
from nemo_rl.models.generation.embedded.worker import EmbeddedGenerationWorker
from nemo_rl.models.generation.interfaces import (
    WeightManifestDict,
    check_generation_input,
    compare_manifests,
)

# How long one call on the generation workers may take before the driver names the workers still running
# (loading a large model or generating a large batch on CPU takes long; a hang should not last forever).
WORKER_CALL_TIMEOUT_S = 6 * 3600.0

# Rows are dealt to the replicas by prompt length so every replica gets a similar amount of work.
LENGTH_KEY = "input_lengths"


class EmbeddedGeneration:
    """Embedded-engine replicas on bundles of ``cluster``, one whole model per replica.

    Args:
        cluster: the cluster whose bundles the workers run on.
        cfg: the ``policy`` section; ``generation.embedded_cfg.data_parallel_size`` replicas (default one per
            bundle) run on the first bundles of ``bundle_indices``.
        tokenizer: pad/EOS ids and stop-string decoding.
        seed: seeds the sampling; call ``k`` of :meth:`generate` uses a seed derived from ``(seed, k)``, so a
            run replays exactly when it makes the same calls with the same data.
        bundle_indices: bundles to run on (default: all of the cluster's); the policy's bundles when colocated.
        model_path: a local checkpoint folder to load instead of ``cfg.model_name``.
        name: the worker group's name.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        cfg: PolicyConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seed: int,
        bundle_indices: Sequence[int] | None = None,
        model_path: str | None = None,
        name: str = "embedded_generation",
    ) -> None:
        bundles = list(range(cluster.world_size)) if bundle_indices is None else list(bundle_indices)
        num_replicas = cfg.generation.embedded_cfg.data_parallel_size or len(bundles)
        if num_replicas > len(bundles):
            raise ValueError(
                f"policy.generation.embedded_cfg.data_parallel_size={num_replicas} asks for more replicas than the "
                f"{len(bundles)} bundles generation runs on; lower it or raise cluster.gpus_per_node"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer has no pad token; load it with nemo_rl.models.tokenizer.get_tokenizer"
            )
        self.cfg = cfg
        self.pad_token_id = int(tokenizer.pad_token_id)
        self._seed = seed
        self._calls = itertools.count()
        self._bundles = bundles[:num_replicas]
        self._node_ids = [cluster.bundle_locations()[b].node_id for b in self._bundles]
        self.worker_group = RayWorkerGroup(
            cluster,
            EmbeddedGenerationWorker,
            name=name,
            init_kwargs={"cfg": cfg, "tokenizer": tokenizer, "model_path": model_path},
            bundle_indices=self._bundles,
        )
        try:
            self.worker_group.wait_until_ready(WORKER_CALL_TIMEOUT_S)
        except BaseException:
            self.worker_group.shutdown()
            raise

    @property
    def dp_size(self) -> int:
        """Number of engine replicas."""
        return self.worker_group.dp_size

    @property
    def workers(self) -> list[ActorHandle]:
        """The replicas in rank order (what ``nemo_rl.weight_sync.refit`` sends to)."""
        return self.worker_group.workers

    @property
    def worker_node_ids(self) -> list[str]:
        """Ray node id of each replica, in rank order."""
        return list(self._node_ids)

    def _on_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        refs = self.worker_group.run_all_workers_single_data(method, *args, **kwargs)
        return self.worker_group.get_all_worker_results(refs, WORKER_CALL_TIMEOUT_S)

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        """Sample a response per row; see :class:`~nemo_rl.models.generation.interfaces.GenerationInterface`."""
        check_generation_input(data)
        seed = self._seed * 1_000_003 + next(self._calls)
        indices = data.shard_indices(self.dp_size, allow_uneven_shards=True, balance_by_length_key=LENGTH_KEY)
        shards = [data.select_indices(rows) for rows in indices]
        refs = self.worker_group.run_all_workers_sharded_data("generate", shards, greedy, seed)
        results = self.worker_group.get_dp_leader_results(refs, WORKER_CALL_TIMEOUT_S)
        return BatchedDataDict.from_shards(results, indices, pad_value_dict={"output_ids": self.pad_token_id})

    def prepare_for_generation(self) -> None:
        """Weights back onto the devices (after :meth:`finish_generation` offloaded them)."""
        self._on_all("prepare_for_generation")

    def finish_generation(self) -> None:
        """Drop the KV caches (and offload the weights on CUDA) so colocated training gets the memory."""
        self._on_all("finish_generation")

    # ------------------------------------------------------------------------------- refit receiver
    def expected_weights_manifest(self) -> WeightManifestDict:
        """``{hf_name: (full shape, dtype name)}`` the replicas expect (all replicas hold the same model)."""
        ref = self.worker_group.run_single_worker("expected_weights_manifest", 0)
        manifest: WeightManifestDict = self.worker_group.get_all_worker_results([ref], WORKER_CALL_TIMEOUT_S)[
            0
        ]
        return manifest

    def prepare_refit_info(self, manifest: WeightManifestDict) -> None:
        """Fail early, with every difference named, when a sender's manifest does not fit the replicas."""
        problems = compare_manifests(self.expected_weights_manifest(), manifest)
        if problems:
            raise ValueError(
                "the policy's weights do not fit the embedded generation model (is policy.model_name the same "
                "architecture, and does the refit cast to policy.generation.embedded_cfg.precision?):\n  "
                + "\n  ".join(problems)
            )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full weights from the driver into every replica (each weight exactly once)."""
        tensors = [(name, tensor.detach().cpu()) for name, tensor in named_tensors]
        ref = ray.put(tensors)
        self._on_all("load_weights_from_stream", ref)

    def shutdown(self) -> None:
        """Stop the replicas and release their bundles."""
        self.worker_group.shutdown()
