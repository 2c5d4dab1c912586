"""The driver side of the vLLM backend: data-parallel vLLM engines behind :class:`GenerationInterface`."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import ray
import torch
from ray.actor import ActorHandle
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_groups import RayWorkerGroup
from nemo_rl.models.generation.interfaces import (
    WeightManifestDict,
    check_generation_input,
    compare_manifests,
)
from nemo_rl.models.generation.vllm.convert import check_vllm_config
from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker

# How long one call on the generation workers may take before the driver names the workers still running
# (starting vLLM compiles and captures CUDA graphs; a large batch takes long; a hang should not last forever).
WORKER_CALL_TIMEOUT_S = 6 * 3600.0

# Rows are dealt to the replicas by prompt length so every replica gets a similar amount of work.
LENGTH_KEY = "input_lengths"

# Set in every worker before vLLM is imported: vLLM's engine core then runs inside the actor, so refit can
# hand it the live weight stream (see `worker_extension`).
WORKER_ENV_VARS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class VllmGeneration:
    """vLLM engines on bundles of ``cluster``: ``len(bundles) / vllm_cfg.tensor_parallel_size`` replicas.

    Every bundle runs one worker actor; the ``tensor_parallel_size`` consecutive workers of a replica are
    the ranks of one tensor-parallel engine, and all of them receive the refitted weights (each loads full
    tensors and keeps its slice).

    Args:
        cluster: the cluster whose bundles the workers run on (it must have GPUs).
        cfg: the ``policy`` section; ``generation.vllm_cfg`` configures the engines.
        tokenizer: pad/EOS ids.
        seed: the engines' seed; call ``k`` of :meth:`generate` samples with seeds derived from ``(seed, k)``,
            so a run replays when it makes the same calls with the same data.
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
        name: str = "vllm_generation",
    ) -> None:
        check_vllm_config(cfg)
        if not cluster.use_gpus:
            raise UserError(
                "policy.generation.backend=vllm needs CUDA GPUs, and this Ray cluster has none; run with "
                "policy.generation.backend=embedded"
            )
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer has no pad token; load it with nemo_rl.models.tokenizer.get_tokenizer"
            )
        bundles = list(range(cluster.world_size)) if bundle_indices is None else list(bundle_indices)
        tp_size = cfg.generation.vllm_cfg.tensor_parallel_size
        if not bundles or len(bundles) % tp_size != 0:
            raise UserError(
                f"policy.generation.vllm_cfg.tensor_parallel_size={tp_size} must divide the {len(bundles)} "
                "bundles generation runs on; change it or the number of GPUs (cluster.gpus_per_node, "
                "policy.generation.colocated.resources)"
            )
        self.cfg = cfg
        self.pad_token_id = int(tokenizer.pad_token_id)
        self._seed = seed
        self._calls = itertools.count()
        self._node_ids = [cluster.bundle_locations()[b].node_id for b in bundles]
        self.worker_group = RayWorkerGroup(
            cluster,
            VllmGenerationWorker,
            name=name,
            init_kwargs={"cfg": cfg, "tokenizer": tokenizer, "seed": seed, "model_path": model_path},
            bundle_indices=bundles,
            dp_size=len(bundles) // tp_size,
            env_vars=WORKER_ENV_VARS,
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
        """Every vLLM rank, in rank order (what ``nemo_rl.weight_sync.refit`` sends to)."""
        return self.worker_group.workers

    @property
    def worker_node_ids(self) -> list[str]:
        """Ray node id of each worker, in rank order."""
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
        # Every rank of a replica gets its shard: tensor-parallel ranks run the same requests in lockstep.
        refs = self.worker_group.run_all_workers_sharded_data("generate", shards, greedy, seed)
        results = self.worker_group.get_dp_leader_results(refs, WORKER_CALL_TIMEOUT_S)
        return BatchedDataDict.from_shards(results, indices, pad_value_dict={"output_ids": self.pad_token_id})

    def prepare_for_generation(self) -> None:
        """Weights and KV cache back onto the GPUs (colocated mode)."""
        self._on_all("prepare_for_generation")

    def finish_generation(self) -> None:
        """Colocated mode: put the engines to sleep (weights to host memory, KV cache freed)."""
        self._on_all("finish_generation")

    # ------------------------------------------------------------------------------- refit receiver
    def expected_weights_manifest(self) -> WeightManifestDict:
        """``{hf_name: (full shape, dtype name)}`` the engines expect (every rank loads full tensors)."""
        ref = self.worker_group.run_single_worker("expected_weights_manifest", 0)
        manifest: WeightManifestDict = self.worker_group.get_all_worker_results([ref], WORKER_CALL_TIMEOUT_S)[
            0
        ]
        return manifest

    def prepare_refit_info(self, manifest: WeightManifestDict) -> None:
        """Fail early, with every difference named, when a sender's manifest does not fit the engines."""
        problems = compare_manifests(self.expected_weights_manifest(), manifest)
        if problems:
            raise ValueError(
                "the policy's weights do not fit the vLLM generation model (is policy.model_name the same "
                "architecture, and does the refit cast to policy.generation.vllm_cfg.precision?):\n  "
                + "\n  ".join(problems)
            )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full weights from the driver into every rank (each weight exactly once)."""
        tensors = [(name, tensor.detach().cpu()) for name, tensor in named_tensors]
        ref = ray.put(tensors)
        self._on_all("load_weights_from_stream", ref)

    def shutdown(self) -> None:
        """Stop the engines and release their bundles."""
        self.worker_group.shutdown()
