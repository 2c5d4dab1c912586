"""A model's Hugging Face config with ``policy.hf_config_overrides`` applied.

Every place that builds the policy's model from its Hugging Face config (the DTensor and Megatron policy
workers, the embedded generation engine, vLLM, checkpoint conversion) reads it through :func:`load_hf_config`,
so training and generation agree on the overridden architecture (e.g. a longer ``max_position_embeddings``
or another ``rope_parameters``).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_rl.config.errors import UserError

OVERRIDES_KEY = "policy.hf_config_overrides"


def load_hf_config(
    model_name: str | Path,
    *,
    trust_remote_code: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """``AutoConfig.from_pretrained(model_name)`` with each attribute named in ``overrides`` replaced by its
    value (a mapping value replaces the attribute whole, as Hugging Face's ``from_pretrained(**kwargs)``).

    Raises:
        UserError: an override names an attribute the model's config does not have (a typo, or a key this
            transformers version spells differently, e.g. ``rope_theta`` inside ``rope_parameters``).
    """
    # Imported here: resolving ``AutoConfig`` makes transformers index every model folder it has (about 0.5 s
    # of CPU), which a driver that imports the policy workers' classes but builds no model never needs.
    from transformers import AutoConfig

    config, unused = AutoConfig.from_pretrained(
        model_name, trust_remote_code=trust_remote_code, return_unused_kwargs=True, **dict(overrides or {})
    )
    if unused:
        known = sorted(config.to_dict())
        hints = []
        for name in sorted(unused):
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{OVERRIDES_KEY}.{name}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise UserError(
            f"{', '.join(hints)}: {type(config).__name__} of {model_name} has no such attribute; override "
            "attributes its config.json has"
        )
    return config
