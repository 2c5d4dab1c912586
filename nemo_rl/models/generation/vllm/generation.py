"""The driver side of the vLLM backend: data-parallel vLLM engines behind :class:`GenerationInterface`."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.replicated import ReplicatedGeneration
from nemo_rl.models.generation.vllm.convert import check_vllm_config
from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker
from nemo_rl.models.tokenizer import require_pad_token_id

# Set in every worker before vLLM is imported: vLLM's engine core then runs inside the actor, so refit can
# hand it the live weight stream (see `worker_extension`).
WORKER_ENV_VARS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class VllmGeneration(ReplicatedGeneration):
    """vLLM engines on bundles of ``cluster``: ``len(bundles) / vllm_cfg.tensor_parallel_size`` replicas.

    Every bundle runs one worker actor; the ``tensor_parallel_size`` consecutive workers of a replica are
    the ranks of one tensor-parallel engine, and all of them receive the refitted weights (each loads full
    tensors and keeps its slice). :meth:`finish_generation` puts the engines to sleep (weights to host
    memory, KV cache freed) for colocated training; :meth:`prepare_for_generation` wakes them.

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

    backend_name = "vLLM"
    precision_key = "vllm_cfg"

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
        pad_token_id = require_pad_token_id(tokenizer)
        bundles = list(range(cluster.world_size)) if bundle_indices is None else list(bundle_indices)
        tp_size = cfg.generation.vllm_cfg.tensor_parallel_size
        if not bundles or len(bundles) % tp_size != 0:
            raise UserError(
                f"policy.generation.vllm_cfg.tensor_parallel_size={tp_size} must divide the {len(bundles)} "
                "bundles generation runs on; change it or the number of GPUs (cluster.gpus_per_node, "
                "policy.generation.colocated.resources)"
            )
        super().__init__(
            cluster,
            cfg,
            VllmGenerationWorker,
            bundles=bundles,
            pad_token_id=pad_token_id,
            seed=seed,
            init_kwargs={"cfg": cfg, "tokenizer": tokenizer, "seed": seed, "model_path": model_path},
            name=name,
            dp_size=len(bundles) // tp_size,
            env_vars=WORKER_ENV_VARS,
        )
