"""Schema of ``policy.router_replay``: routing replay ("R3") for mixture-of-experts policies, and the checks
that refuse it where it cannot work.

Routing replay records, for every token the sampler ran and every MoE layer, the experts the sampler's router
chose, and makes the policy's forwards (previous and reference log-probs, training) use those experts instead
of their own top-k, the experts' weights recomputed from the policy's own router so the router still trains.
NeMo RL's key (NVIDIA-NeMo/RL PR 2590) is ``policy.router_replay.enabled``; verl's is
``actor_rollout_ref.actor.megatron.router_replay.mode: R3``. See ``docs/algorithms/moe.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.model_arch import local_model_type

if TYPE_CHECKING:
    from nemo_rl.config.policy import PolicyConfig

REPLAY_MODEL_TYPES = ("qwen3_moe", "glm4_moe")
"""MoE families whose routing the embedded engine records and the policy (DTensor or Megatron) replays."""

_KEY = "policy.router_replay.enabled=true"


class RouterReplayConfig(ConfigModel):
    """Replay the sampler's expert choices in the policy's forwards (GRPO with the embedded engine)."""

    enabled: bool = False
    """Record each sampled and prompt token's top-k experts per MoE layer in the generation engine, carry
    them with the rollouts into the training batch (``routed_experts`` ``[B, T, MoE layers, top_k]``) and
    route the policy's log-prob and training forwards to them; a token without a record (the last sampled
    token of a response) keeps the policy's own routing."""


def check_router_replay(policy: PolicyConfig) -> None:
    """Refuse ``policy.router_replay.enabled`` where it cannot work, with one line naming what to change."""
    if not policy.router_replay.enabled:
        return
    model_type = local_model_type(policy.model_name)
    if model_type is not None and model_type not in REPLAY_MODEL_TYPES:
        raise ValueError(
            f"{_KEY} replays mixture-of-experts routing, and {policy.model_name} is a {model_type} model "
            f"(replay is built for {', '.join(REPLAY_MODEL_TYPES)}): set it false"
        )
    if policy.generation.backend != "embedded":
        raise ValueError(
            f"{_KEY} needs a sampler that records its routing; vLLM 0.32's CPU build cannot "
            "(enable_return_routed_experts is wired into its v2 GPU model runner only, not CPUModelRunner): "
            "set policy.generation.backend=embedded or router_replay.enabled=false"
        )
    backend = "dtensor_cfg" if policy.dtensor_cfg.enabled else "megatron_cfg"
    if getattr(policy, backend).activation_checkpointing:
        raise ValueError(
            f"{_KEY} replays routing in the forward only, and activation checkpointing would recompute the "
            f"layers in the backward with the policy's own routing: set policy.{backend}.activation_checkpointing"
            "=false"
        )


def refuse_router_replay(algorithm: str, policy: PolicyConfig, section: str = "policy") -> None:
    """Refuse the key for a loop that does not carry the sampler's routing into its training batch."""
    if policy.router_replay.enabled:
        raise ValueError(
            f"{section}.router_replay.enabled=true replays a sampler's routing in GRPO's training batch, which "
            f"{algorithm} does not build: set {section}.router_replay.enabled=false"
        )
