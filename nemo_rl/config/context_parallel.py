"""The checks that refuse ``policy.dtensor_cfg.context_parallel_size`` where it is not built, each in one line.

Context parallelism itself is ``nemo_rl/models/policy/context_parallel.py``; docs/parallelism.md lists what it
combines with and why the rest is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_rl.config.model_arch import MOE_MODEL_TYPES, local_model_type

if TYPE_CHECKING:
    from nemo_rl.config.policy import PolicyConfig


def check_context_parallel(policy: PolicyConfig) -> None:
    """CP's sequence multiple (NeMo RL's meaning of ``make_sequence_length_divisible_by``: every padded length
    is a multiple of it, so with CP one of ``2 x CP``) and what CP does not combine with."""
    cp = policy.dtensor_cfg.context_parallel_size
    if not policy.dtensor_cfg.enabled or cp == 1:
        return
    key = f"policy.dtensor_cfg.context_parallel_size={cp}"
    if policy.make_sequence_length_divisible_by % (2 * cp) != 0:
        raise ValueError(
            f"{key} splits each sequence into 2 x CP = {2 * cp} equal chunks, but "
            f"policy.make_sequence_length_divisible_by={policy.make_sequence_length_divisible_by} is not a "
            f"multiple of {2 * cp}: set it to one"
        )
    refused = [
        (
            policy.dtensor_cfg.tensor_parallel_size > 1,
            "tensor parallelism (TP x CP is not built)",
            "policy.dtensor_cfg.tensor_parallel_size=1",
        ),
        (policy.shared_prefix.enabled, "the shared-prompt forward", "policy.shared_prefix.enabled=false"),
        (
            policy.reward_model_cfg.enabled and policy.reward_model_cfg.reward_model_type == "bradley_terry",
            "a Bradley-Terry reward model (it reads its head at one token per row)",
            "policy.reward_model_cfg.enabled=false",
        ),
        (
            local_model_type(policy.model_name) in MOE_MODEL_TYPES,
            "a mixture-of-experts model (its load-balancing loss and routing replay read every token)",
            "use the Megatron backend",
        ),
    ]
    for blocked, what, fix in refused:
        if blocked:
            raise ValueError(f"{key} does not combine with {what}: set it to 1 or {fix}")
