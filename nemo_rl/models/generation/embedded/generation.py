"""The driver side of the embedded engine: data-parallel replicas behind :class:`GenerationInterface`."""

from __future__ import annotations

from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.embedded.worker import EmbeddedGenerationWorker
from nemo_rl.models.generation.replicated import ReplicaLayout, ReplicatedGeneration


class EmbeddedGeneration(ReplicatedGeneration):
    """Embedded-engine replicas on bundles of ``cluster``, one whole model per replica.

    :meth:`finish_generation` drops the KV caches (and offloads the weights on CUDA) so colocated training
    gets the memory; :meth:`prepare_for_generation` brings the weights back.

    The constructor's arguments are :class:`ReplicatedGeneration`'s;
    ``policy.generation.embedded_cfg.data_parallel_size`` replicas (default one per bundle) run on the first
    of its bundles.
    """

    worker_cls = EmbeddedGenerationWorker
    default_name = "embedded_generation"
    backend_name = "embedded"

    def _layout(self, cluster: RayVirtualCluster, bundles: list[int], seed: int) -> ReplicaLayout:
        num_replicas = self.cfg.generation.embedded_cfg.data_parallel_size or len(bundles)
        if num_replicas > len(bundles):
            raise ValueError(
                f"policy.generation.embedded_cfg.data_parallel_size={num_replicas} asks for more replicas than the "
                f"{len(bundles)} bundles generation runs on; lower it or raise cluster.gpus_per_node"
            )
        return ReplicaLayout(bundles[:num_replicas])
