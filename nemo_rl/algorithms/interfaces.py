"""The loss contract, under the name NeMo RL users import it by.

The contract belongs to the policy layer that calls it: see :mod:`nemo_rl.models.policy.loss_interface`.
"""

from __future__ import annotations

from nemo_rl.models.policy.loss_interface import LossFunction, LossType

__all__ = ["LossFunction", "LossType"]
