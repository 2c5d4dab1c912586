"""The architecture facts ``--dry-run``'s memory plan needs, without the model hub or ``transformers``.

:func:`resolve_arch` reads them from the model's ``config.json`` when ``policy.model_name`` is a local folder,
or else from :data:`KNOWN_ARCHS`, a table of the models the shipped recipes name, copied from their public
``config.json`` files into ``known_archs.json``. For any other hub name it returns ``None`` and the plan is
skipped (it says so).
``policy.hf_config_overrides`` of the fields read here (``num_hidden_layers``, ``vocab_size``...) apply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelArch:
    """A Llama-like decoder (Llama, Qwen2, Qwen3): what its parameter shapes and activations depend on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    """Biases on the q, k and v projections (Qwen2)."""
    qk_norm: bool
    """RMSNorms over each head of q and k (Qwen3)."""
    tie_word_embeddings: bool

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> ModelArch:
        """Read a Hugging Face ``config.json`` (as a dict) of a Llama-like model."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        model_type = config.get("model_type", "llama")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def num_parameters(self) -> int:
        """Parameters of the causal LM (a tied output head counted once)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        attention += (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * layer + heads * self.vocab_size * self.hidden_size + self.hidden_size


def _known_archs() -> dict[str, ModelArch]:
    """The table in ``known_archs.json``: each model's fields of its public ``config.json``."""
    table = json.loads((Path(__file__).parent / "known_archs.json").read_text())
    return {name: ModelArch.from_config_dict(config) for name, config in table.items()}


KNOWN_ARCHS: dict[str, ModelArch] = _known_archs()
"""Architectures of the models the shipped recipes (and NeMo RL's) name, from their public ``config.json``
(kept as data in ``known_archs.json`` next to this module)."""

_OVERRIDABLE = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "tie_word_embeddings": "tie_word_embeddings",
}


MOE_MODEL_TYPES = frozenset({"qwen3_moe", "glm4_moe", "deepseek_v3", "qwen2_moe", "mixtral", "olmoe"})
"""Hugging Face model types whose MLPs are mixtures of experts (the memory plan does not count them)."""


def local_model_type(model_name: str) -> str | None:
    """The ``model_type`` of ``model_name``'s ``config.json`` when it is a local folder, else None."""
    config_file = Path(model_name) / "config.json"
    if not config_file.is_file():
        return None
    model_type = json.loads(config_file.read_text()).get("model_type")
    return str(model_type) if model_type is not None else None


def local_hf_config(
    model_name: str, hf_config_overrides: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """``model_name``'s ``config.json`` with ``hf_config_overrides`` applied when it is a local folder, else None."""
    config_file = Path(model_name) / "config.json"
    if not config_file.is_file():
        return None
    raw: dict[str, Any] = json.loads(config_file.read_text())
    return raw | dict(hf_config_overrides or {})


def resolve_arch(
    model_name: str, hf_config_overrides: Mapping[str, Any] | None = None
) -> tuple[ModelArch | None, str]:
    """The architecture of ``model_name`` and where it came from, or ``(None, why not)``."""
    config_file = Path(model_name) / "config.json"
    if config_file.is_file():
        raw = json.loads(config_file.read_text())
        if raw.get("model_type") in MOE_MODEL_TYPES:
            return None, f"{config_file} is a mixture-of-experts model, which the memory plan does not count"
        if "num_hidden_layers" not in raw or "intermediate_size" not in raw:
            return None, f"{config_file} is not a Llama-like decoder's config"
        arch, source = ModelArch.from_config_dict(raw | dict(hf_config_overrides or {})), str(config_file)
        return arch, source
    known = KNOWN_ARCHS.get(model_name)
    if known is None:
        return None, (
            f"{model_name} is neither a local folder with a config.json nor one of the models whose "
            "architecture nemo_rl.config.model_arch.KNOWN_ARCHS lists"
        )
    changes = {_OVERRIDABLE[k]: v for k, v in (hf_config_overrides or {}).items() if k in _OVERRIDABLE}
    return replace(known, **changes), "nemo_rl.config.model_arch.KNOWN_ARCHS"
