"""Schema of the ``checkpointing`` section: when to save, where, and which checkpoints to keep."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from nemo_rl.config.base import ConfigModel

_DEADLINE_RE = re.compile(r"^\d+:\d+:\d+:\d+$")


class CheckpointingConfig(ConfigModel):
    """Periodic, atomic training checkpoints with top-k retention."""

    enabled: bool = True
    """Save checkpoints during training (and resume from the latest one at start-up)."""

    checkpoint_dir: str = "results/checkpoints"
    """Directory holding one ``step_N`` sub-directory per checkpoint."""

    metric_name: str | None = None
    """Key of ``training_info`` ranking checkpoints for ``keep_top_k`` and the best checkpoint (e.g.
    ``"val_loss"`` or ``"validation/accuracy"``); ``None`` ranks by step, keeping the most recent."""

    higher_is_better: bool = True
    """Whether a larger ``metric_name`` value is a better checkpoint."""

    keep_top_k: int | None = Field(default=None, ge=1)
    """How many checkpoints to keep (the best by ``metric_name``; the latest is always kept on top);
    ``None`` keeps every checkpoint."""

    save_period: int = Field(default=10, ge=1)
    """Save every this many training steps."""

    checkpoint_must_save_by: str | None = None
    """Wall-clock budget ``"DD:HH:MM:SS"`` after which training saves and stops (so a job with a time limit
    ends on a checkpoint); ``None`` means no limit."""

    model_save_format: Literal["safetensors", "torch_save"] | None = "safetensors"
    """Accepted, no effect here: policy checkpoints are always written with ``torch.distributed.checkpoint``
    (``save_consolidated`` adds a Hugging Face safetensors export)."""

    save_consolidated: bool = False
    """Also write a consolidated Hugging Face checkpoint (one set of full weights) next to the sharded one."""

    save_optimizer: bool = True
    """Accepted, no effect here: the optimizer state is always saved with the weights, so a run resumes
    exactly."""

    allow_incompatible_resume: bool = False
    """Resume even when the run changes the model, tokenizer or parallel layout its latest checkpoint was
    saved with (refused otherwise: the checkpoint's weights and shards may not fit)."""

    @field_validator("checkpoint_must_save_by")
    @classmethod
    def _deadline_format(cls, value: str | None) -> str | None:
        if value is not None and not _DEADLINE_RE.match(value):
            raise ValueError(
                f"checkpointing.checkpoint_must_save_by={value!r} is not 'DD:HH:MM:SS' "
                "(e.g. '00:03:45:00' for 3 h 45 min); use null for no limit."
            )
        return value
