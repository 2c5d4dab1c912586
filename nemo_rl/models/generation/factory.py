"""Choosing the generation backend from ``policy.generation.backend``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.embedded.in_policy import InPolicyEmbeddedGeneration
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.generation.replicated import ReplicatedGeneration
from nemo_rl.weight_sync.factory import create_refit_transport
from nemo_rl.weight_sync.interfaces import RefitTransport
from nemo_rl.weight_sync.refit import refit
from nemo_rl.weight_sync.scope import RefitScope

if TYPE_CHECKING:
    from nemo_rl.models.policy.lm_policy import Policy


def check_backend_available(
    cfg: PolicyConfig,
    cluster_has_gpus: bool,
    *,
    key_prefix: str = "policy.generation",
    cpu_config: str = "examples/configs/grpo_math_tiny.yaml",
) -> None:
    """Raise a :class:`UserError` naming the fix when the configured backend cannot run on this cluster.

    ``key_prefix`` is where the script's config holds the generation section and ``cpu_config`` the recipe
    that runs on a CPU, both named in the message.
    """
    if cfg.generation.backend != "vllm":
        return
    # The vLLM package's checks import no vLLM: the build is read from package metadata.
    from nemo_rl.models.generation.vllm.convert import check_vllm_runs_here, installed_vllm_build

    check_vllm_runs_here(
        installed_vllm_build(), cluster_has_gpus, key_prefix=key_prefix, cpu_config=cpu_config
    )


def create_generation(
    cluster: RayVirtualCluster,
    cfg: PolicyConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    bundle_indices: Sequence[int] | None = None,
    model_path: str | None = None,
    concurrent_refit: bool = False,
) -> GenerationInterface:
    """Start the generation backend ``cfg.generation.backend`` on ``cluster`` (or its ``bundle_indices``).

    ``seed`` seeds the sampling; ``model_path`` loads a local checkpoint folder instead of ``cfg.model_name``;
    ``concurrent_refit`` lets the workers take a refit while they generate (in-flight weight updates).
    """
    check_backend_available(cfg, cluster.use_gpus)
    # Both backends take ReplicatedGeneration's constructor; each is imported only when chosen (vLLM is heavy).
    backend_cls: type[ReplicatedGeneration]
    if cfg.generation.backend == "vllm":
        from nemo_rl.models.generation.vllm.generation import VllmGeneration

        backend_cls = VllmGeneration
    else:
        from nemo_rl.models.generation.embedded.generation import EmbeddedGeneration

        backend_cls = EmbeddedGeneration
    return backend_cls(
        cluster,
        cfg,
        tokenizer,
        seed=seed,
        bundle_indices=bundle_indices,
        model_path=model_path,
        concurrent_refit=concurrent_refit,
    )


def create_policy_refit_transport(
    cluster: RayVirtualCluster,
    cfg: PolicyConfig,
    policy: Policy,
    generation: GenerationInterface,
    *,
    policy_bundles: Sequence[int],
    generation_bundles: Sequence[int],
) -> RefitTransport | None:
    """The transport :func:`refit_from_policy` moves ``policy``'s weights into ``generation`` with.

    None for engines hosted in the policy's own workers (they copy in process); otherwise
    :func:`nemo_rl.weight_sync.factory.create_refit_transport` for the workers on ``policy_bundles`` and
    ``generation_bundles`` of ``cluster``, one stream per pipeline stage of ``policy``.
    """
    if isinstance(generation, InPolicyEmbeddedGeneration):
        return None
    locations = cluster.bundle_locations()
    return create_refit_transport(
        cfg,
        cfg.refit,
        policy_node_ids=[locations[b].node_id for b in policy_bundles],
        generation_node_ids=[locations[b].node_id for b in generation_bundles],
        policy_streams=policy.refit_streams(),
    )


def refit_from_policy(
    policy: Policy,
    generation: GenerationInterface,
    transport: RefitTransport | None,
    *,
    timeout_s: float,
    scope: RefitScope = "full",
) -> dict[str, float]:
    """Copy ``policy``'s current weights of refit ``scope`` into ``generation``; returns ``refit/*`` metrics.

    The policy's optimizer state goes to host memory first (room for the gathers) and its weights after
    (the devices are left to generation). Engines hosted in the policy's own workers
    (``policy.generation.embedded_cfg.in_policy_workers``) copy in process, the offloads around the copy
    included, in one call to the workers and with no ``transport``; separate generation workers receive
    through ``transport`` (:func:`nemo_rl.weight_sync.refit.refit`).
    """
    if isinstance(generation, InPolicyEmbeddedGeneration):
        return generation.refit(scope)
    if transport is None:
        raise ValueError("separate generation workers need a refit transport (create_policy_refit_transport)")
    policy.offload_before_refit()
    metrics = refit(policy.workers, generation.workers, transport, timeout_s=timeout_s, scope=scope)
    policy.offload_after_refit()
    return metrics
