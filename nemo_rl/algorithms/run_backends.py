"""The one place under ``algorithms/`` that still knows generation backends: how a run starts its generation
workers next to the policy, and how it copies the policy's weights into them.

Everything backend-dependent of a run's start-up is here (vLLM starts alone and first, an in-policy engine has
no workers of its own, a LoRA policy refits its adapters only), behind two entry points:
:func:`start_policy_and_generation` and :class:`PolicyWeightSync` (a
:class:`~nemo_rl.algorithms.generation_weights.WeightSync`). They belong to ``models/`` and ``weight_sync/``
(one generation factory, one weight-sync object) and move there as those packages offer them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_groups import start_together
from nemo_rl.models.generation.embedded.in_policy import InPolicyEmbeddedGeneration
from nemo_rl.models.generation.factory import (
    create_generation,
    create_policy_refit_transport,
    refit_from_policy,
)
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.weight_sync.interfaces import RefitTransport
from nemo_rl.weight_sync.scope import RefitScopePlanner, worker_identities


def generation_starts_alone(policy_cfg: PolicyConfig) -> bool:
    """Whether the generation workers start first and alone (vLLM: it starts only when its share of each GPU's
    memory is free, and colocated engines then sleep while the policy loads)."""
    return policy_cfg.generation.backend == "vllm"


def start_policy_and_generation(
    cluster: RayVirtualCluster,
    policy_cfg: PolicyConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    policy_bundles: Sequence[int],
    generation_bundles: Sequence[int],
    concurrent_refit: bool,
    start_policies: Callable[[], tuple[Policy, list[Policy]]],
) -> tuple[Policy, list[Policy], GenerationInterface]:
    """Start the generation workers on ``generation_bundles`` and, with ``start_policies``, the policy and the
    scorers: in one :func:`start_together` block, except for vLLM (see :func:`generation_starts_alone`). An
    engine hosted in the policy's workers (``in_policy_workers``) starts no workers of its own."""
    alone = generation_starts_alone(policy_cfg)
    in_policy = policy_cfg.generation.embedded_cfg.in_policy_workers
    generation: GenerationInterface | None = None
    with start_together(enabled=not alone):
        if not in_policy:
            generation = create_generation(
                cluster,
                policy_cfg,
                tokenizer,
                seed=seed,
                bundle_indices=generation_bundles,
                concurrent_refit=concurrent_refit,
            )
            if policy_cfg.generation.colocated.enabled and alone:
                generation.finish_generation()
        policy, scorers = start_policies()
    if generation is None:
        generation = InPolicyEmbeddedGeneration(policy, tokenizer, seed=seed)
    return policy, scorers, generation


@dataclasses.dataclass(eq=False)
class PolicyWeightSync:
    """Copies the trained policy's weights into the generation workers (a
    :class:`~nemo_rl.algorithms.generation_weights.WeightSync`).

    The scope (:mod:`nemo_rl.weight_sync.scope`) is ``"full"`` the first time, after a failed refit and whenever
    the generation workers changed; with LoRA it is ``"adapters"`` otherwise (``refit/adapters_only`` says
    which)."""

    policy: Policy
    generation: GenerationInterface
    transport: RefitTransport | None
    """``None`` when the generation engines live in the policy workers (an in-process copy)."""
    timeout_s: float
    scopes: RefitScopePlanner

    @classmethod
    def start(
        cls,
        cluster: RayVirtualCluster,
        policy_cfg: PolicyConfig,
        policy: Policy,
        generation: GenerationInterface,
        *,
        policy_bundles: Sequence[int],
        generation_bundles: Sequence[int],
    ) -> PolicyWeightSync:
        """The transport between the policy on ``policy_bundles`` and generation on ``generation_bundles``."""
        transport = create_policy_refit_transport(
            cluster,
            policy_cfg,
            policy,
            generation,
            policy_bundles=policy_bundles,
            generation_bundles=generation_bundles,
        )
        lora = policy_cfg.dtensor_cfg.enabled and policy_cfg.dtensor_cfg.lora_cfg.enabled
        return cls(policy, generation, transport, policy_cfg.refit.timeout_s, RefitScopePlanner(lora))

    def refit(self) -> dict[str, float]:
        """Copy the policy's current weights; returns the ``refit/*`` metrics."""
        workers = worker_identities(self.generation.workers)
        scope = self.scopes.scope_for(workers)
        try:
            metrics = refit_from_policy(
                self.policy, self.generation, self.transport, timeout_s=self.timeout_s, scope=scope
            )
        except BaseException:
            self.scopes.failed()
            raise
        self.scopes.succeeded(workers, scope)
        return {**metrics, "refit/adapters_only": float(scope == "adapters")}

    def enable_in_flight_updates(self, recompute_kv_cache: bool) -> None:
        """Let the generation workers apply a refit between two decode steps."""
        cast(Any, self.generation).enable_in_flight_weight_updates(recompute_kv_cache)

    def shutdown(self) -> None:
        """Release the transport."""
        if self.transport is not None:
            self.transport.shutdown()


def sleep_colocated_generation(policy_cfg: PolicyConfig, generation: GenerationInterface) -> None:
    """Once everything started: colocated generation workers started with the policy free their memory until
    the first refit (vLLM's already slept before the policy loaded)."""
    if policy_cfg.generation.colocated.enabled and not generation_starts_alone(policy_cfg):
        generation.finish_generation()
