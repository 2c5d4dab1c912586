"""The checks that refuse ``policy.dtensor_cfg.context_parallel_size`` where it is not built, each in one line.

Context parallelism itself is ``nemo_rl/models/policy/context_parallel.py``; docs/parallelism.md lists what it
combines with and why the rest is refused.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nemo_rl.config.policy import PolicyConfig


def check_context_parallel(policy: PolicyConfig) -> None:
    """CP's sequence multiple (NeMo RL's meaning of ``make_sequence_length_divisible_by``: every padded length
    is a multiple of it, so with CP one of ``2 x CP``, and with sequence parallelism one of ``CP x TP`` too)
    and what CP does not combine with."""
    dtensor = policy.dtensor_cfg
    cp = dtensor.context_parallel_size
    if not dtensor.enabled or cp == 1:
        return
    key = f"policy.dtensor_cfg.context_parallel_size={cp}"
    multiple, why = 2 * cp, f"splits each sequence into 2 x CP = {2 * cp} equal chunks"
    tp = dtensor.tensor_parallel_size
    if dtensor.sequence_parallel and math.lcm(multiple, cp * tp) != multiple:
        # Each CP rank's T / CP tokens are split over the TP ranks between the tensor-parallel regions.
        multiple = math.lcm(multiple, cp * tp)
        why += f" and sequence parallelism splits each CP rank's tokens over tensor_parallel_size={tp}"
    divisible_by = policy.make_sequence_length_divisible_by
    if divisible_by % multiple != 0:
        raise ValueError(
            f"{key} {why}, but policy.make_sequence_length_divisible_by={divisible_by} is not a multiple of "
            f"{multiple}: set it to one"
        )
    refused = [
        (policy.shared_prefix.enabled, "the shared-prompt forward", "policy.shared_prefix.enabled=false"),
        (
            policy.reward_model_cfg.enabled and policy.reward_model_cfg.reward_model_type == "bradley_terry",
            "a Bradley-Terry reward model (it reads its head at one token per row)",
            "policy.reward_model_cfg.enabled=false",
        ),
    ]
    for blocked, what, fix in refused:
        if blocked:
            raise ValueError(f"{key} does not combine with {what}: set it to 1 or {fix}")
