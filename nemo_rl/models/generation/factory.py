"""Choosing the generation backend from ``policy.generation``: the one place that knows the backends apart.

Three backends implement :class:`~nemo_rl.models.generation.interfaces.GenerationInterface`: the embedded
engine in generation workers of its own (``backend: embedded``), the embedded engine hosted in the DTensor
policy's workers (``embedded_cfg.in_policy_workers``) and vLLM (``backend: vllm``). They differ in how they
start next to the policy, and :func:`start_policy_and_generation` is where that is decided:

- vLLM starts first and alone: an engine starts only when its share of each GPU's memory is free, so it
  comes up before the policy loads, and colocated engines then sleep (weights to host memory, caches freed);
- the embedded engine's workers start together with the policy (and the frozen scorers), in one
  :func:`~nemo_rl.distributed.worker_group_facade.start_together` block, and colocated ones then free their memory;
- in-policy engines are built in the started policy's workers.

:func:`create_generation` starts a backend with workers of its own alone (evaluation, tests);
:func:`ray_may_start_in_background` (in the torch-free :mod:`.backends`) tells a driver whether Ray may start
while it imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.single_process import LocalCluster
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_group_facade import start_together
from nemo_rl.models.generation.backends import ray_may_start_in_background
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.generation.replicated import ReplicatedGeneration

if TYPE_CHECKING:
    from nemo_rl.models.policy.lm_policy import Policy

__all__ = [
    "StartPolicies",
    "check_backend_available",
    "create_generation",
    "ray_may_start_in_background",
    "start_policy_and_generation",
]

StartPolicies = Callable[[], "tuple[Policy, list[Policy]]"]
"""Starts the trained policy and the frozen scoring policies (on their bundles); returns them."""


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
    from nemo_rl.models.generation.vllm.engine_setup import check_vllm_runs_here, installed_vllm_build

    check_vllm_runs_here(
        installed_vllm_build(), cluster_has_gpus, key_prefix=key_prefix, cpu_config=cpu_config
    )


def create_generation(
    cluster: RayVirtualCluster | LocalCluster,
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
    if isinstance(cluster, LocalCluster):
        raise ValueError(
            "generation workers of their own need Ray: a run in one process samples in its policy's worker "
            "(policy.generation.embedded_cfg.in_policy_workers=true)"
        )
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


def start_policy_and_generation(
    cluster: RayVirtualCluster | LocalCluster,
    cfg: PolicyConfig,
    tokenizer: PreTrainedTokenizerBase,
    start_policies: StartPolicies,
    *,
    seed: int,
    bundle_indices: Sequence[int],
    concurrent_refit: bool = False,
) -> tuple[Policy, list[Policy], GenerationInterface]:
    """Start the policy and the scorers (``start_policies``) and the generation backend ``cfg.generation``
    selects, in the order the backend needs (the module docstring); returns ``(policy, scorers,
    generation)``. A colocated backend has released the devices when this returns.

    ``bundle_indices`` are the generation workers' bundles of ``cluster``; ``seed`` seeds the sampling;
    ``concurrent_refit`` lets the workers take a refit while they generate (in-flight weight updates).
    """
    colocated = cfg.generation.colocated.enabled

    def start_generation() -> GenerationInterface:
        return create_generation(
            cluster,
            cfg,
            tokenizer,
            seed=seed,
            bundle_indices=bundle_indices,
            concurrent_refit=concurrent_refit,
        )

    if cfg.generation.embedded_cfg.in_policy_workers:
        from nemo_rl.models.generation.embedded.in_policy import InPolicyEmbeddedGeneration

        with start_together():
            policy, scorers = start_policies()
        generation: GenerationInterface = InPolicyEmbeddedGeneration(policy, tokenizer, seed=seed)
    elif cfg.generation.backend == "vllm":
        generation = start_generation()
        if colocated:
            generation.finish_generation()  # asleep while the policy loads into the memory it freed
        policy, scorers = start_policies()
        return policy, scorers, generation
    else:
        with start_together():
            generation = start_generation()
            policy, scorers = start_policies()
    if colocated:
        generation.finish_generation()
    return policy, scorers, generation
