"""The driver side of the embedded engine: data-parallel replicas behind :class:`GenerationInterface`."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.embedded.worker import EmbeddedGenerationWorker
from nemo_rl.models.generation.replicated import ReplicatedGeneration
from nemo_rl.models.tokenizer import require_pad_token_id


class EmbeddedGeneration(ReplicatedGeneration):
    """Embedded-engine replicas on bundles of ``cluster``, one whole model per replica.

    :meth:`finish_generation` drops the KV caches (and offloads the weights on CUDA) so colocated training
    gets the memory; :meth:`prepare_for_generation` brings the weights back.

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
        concurrent_refit: workers take a refit while they generate (in-flight weight updates).
    """

    backend_name = "embedded"
    precision_key = "embedded_cfg"

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
        name: str = "embedded_generation",
    ) -> None:
        bundles = list(range(cluster.world_size)) if bundle_indices is None else list(bundle_indices)
        num_replicas = cfg.generation.embedded_cfg.data_parallel_size or len(bundles)
        if num_replicas > len(bundles):
            raise ValueError(
                f"policy.generation.embedded_cfg.data_parallel_size={num_replicas} asks for more replicas than the "
                f"{len(bundles)} bundles generation runs on; lower it or raise cluster.gpus_per_node"
            )
        super().__init__(
            cluster,
            cfg,
            EmbeddedGenerationWorker,
            bundles=bundles[:num_replicas],
            pad_token_id=require_pad_token_id(tokenizer),
            seed=seed,
            init_kwargs={"cfg": cfg, "tokenizer": tokenizer, "model_path": model_path},
            name=name,
            concurrent_refit=concurrent_refit,
        )
