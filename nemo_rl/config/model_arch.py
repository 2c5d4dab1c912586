"""The architecture facts ``--dry-run``'s memory plan needs, without the model hub or ``transformers``.

:func:`resolve_arch` reads them from the model's ``config.json`` when ``policy.model_name`` is a local folder,
or else from :data:`KNOWN_ARCHS`, a table of the models the shipped recipes name, copied from their public
``config.json`` files. For any other hub name it returns ``None`` and the plan is skipped (it says so).
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


def _arch(**kwargs: Any) -> ModelArch:
    return ModelArch.from_config_dict(kwargs)


_QWEN25_15B = _arch(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
_LLAMA32_1B = _arch(
    model_type="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=True,
)
_QWEN3_06B = _arch(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)

KNOWN_ARCHS: dict[str, ModelArch] = {
    "Qwen/Qwen2.5-1.5B": _QWEN25_15B,
    "Qwen/Qwen2.5-1.5B-Instruct": _QWEN25_15B,
    "Qwen/Qwen2.5-Math-1.5B-Instruct": _QWEN25_15B,
    "Qwen/Qwen2.5-7B-Instruct": _arch(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "meta-llama/Llama-3.2-1B": _LLAMA32_1B,
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA32_1B,
    "Qwen/Qwen3-0.6B": _QWEN3_06B,
    "Skywork/Skywork-Reward-V2-Qwen3-0.6B": _QWEN3_06B,
    "Qwen/Qwen3-1.7B-Base": _arch(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3-4B": _arch(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
}
"""Architectures of the models the shipped recipes (and NeMo RL's) name, from their public ``config.json``."""

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
