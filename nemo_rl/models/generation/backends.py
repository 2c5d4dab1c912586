"""What a driver asks about the generation backend before anything heavy is imported (free of torch and Ray).

The backends themselves are chosen in :mod:`nemo_rl.models.generation.factory`; this module answers the one
question a driver needs before it imports them.
"""

from __future__ import annotations

from nemo_rl.config.policy import PolicyConfig


def ray_may_start_in_background(cfg: PolicyConfig) -> bool:
    """Whether a driver may start Ray in the background while it imports and loads data.

    Not for vLLM: its start takes far longer than Ray's anyway, and a machine without a GPU must refuse it
    (:func:`~nemo_rl.models.generation.factory.check_backend_available`) as quickly as possible, without
    starting Ray first.
    """
    return cfg.generation.backend != "vllm"
