"""The architecture record of a Llama-like decoder, read from its Hugging Face config without ``torch``.

:class:`ModelArch` is the one record of a model's architecture: nemo_rl's own decoders (the embedded engine,
the Megatron policy backend) build from it (``nemo_rl.models.hf_decoder.decoder_arch`` reads it from a
``transformers`` config and checks it is a family they implement), and ``--dry-run``'s memory plan counts
parameters and activations with it. :class:`MoeArch` holds the mixture-of-experts layers of the Qwen3-MoE and
GLM-4-MoE families.

For the memory plan, :func:`resolve_arch` reads the model's ``config.json`` when ``policy.model_name`` is a
local folder, or else the table :data:`KNOWN_ARCHS` of the models the shipped recipes name, copied from their
public ``config.json`` files into ``known_archs.json``. For any other hub name it returns ``None`` and the plan
is skipped (it says so). ``policy.hf_config_overrides`` apply to both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DECODER_MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe")
"""Hugging Face ``model_type`` of the mixture-of-experts families nemo_rl's own decoder runs."""

QWEN2_LAYOUT_MODEL_TYPES = ("qwen2", "qwen2_vl_text", "qwen2_5_vl_text")
"""``model_type`` of decoders with Qwen2's layout (q/k/v biases, no output bias): Qwen2, and the language
models of Qwen2-VL and Qwen2.5-VL (their ``text_config``)."""

RouterKind = Literal["softmax", "sigmoid"]

_REQUIRED = object()

_JSON_ALIASES = {"num_experts": "num_local_experts"}
"""Keys ``transformers`` 5 writes to ``config.json`` under another name (``PretrainedConfig.attribute_map``)."""


class _Fields:
    """Reads keys of a Hugging Face config given as a ``config.json`` dict or as a ``PretrainedConfig``."""

    def __init__(self, config: Mapping[str, Any] | object) -> None:
        self._config = config

    def __call__(self, key: str, default: Any = _REQUIRED) -> Any:
        if isinstance(self._config, Mapping):
            value = self._config.get(key, self._config.get(_JSON_ALIASES.get(key, key), default))
        else:
            value = getattr(self._config, key, default)
        if value is _REQUIRED:
            raise ValueError(f"the model config has no `{key}`, which a Llama-like decoder's config holds")
        return value


@dataclass(frozen=True)
class MoeArch:
    """A decoder's mixture-of-experts layers, read (and checked) from its Hugging Face config: the
    ``softmax`` router of ``qwen3_moe`` or the grouped ``sigmoid`` router (with a shared expert) of
    ``glm4_moe``; ``nemo_rl/models/hf_moe.py`` describes both."""

    router: RouterKind
    """How the router scores experts."""
    num_experts: int
    """Routed experts per MoE layer (E)."""
    top_k: int
    """Experts each token is routed to."""
    expert_intermediate_size: int
    """Width of one expert's gated MLP (I)."""
    norm_topk_prob: bool
    """Renormalise the chosen experts' weights to sum to 1."""
    shared_intermediate_size: int
    """Width of the shared-expert MLP added to every token; 0 without one."""
    num_groups: int
    """Expert groups of the sigmoid router (1: no group limit)."""
    topk_groups: int
    """Groups the sigmoid router keeps before choosing experts."""
    routed_scaling_factor: float
    """Factor on the sigmoid router's weights."""
    sparse_layers: tuple[bool, ...]
    """Per decoder layer: whether its MLP is a MoE block (else a dense MLP of ``intermediate_size``)."""
    num_extra_layers: int = 0
    """Multi-token-prediction layers a checkpoint may hold after the last decoder layer (GLM-4.5's
    ``num_nextn_predict_layers``); the causal LM never runs them."""

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | object) -> MoeArch:
        """Read a ``qwen3_moe`` or ``glm4_moe`` config (a ``config.json`` dict or a ``PretrainedConfig``)."""
        get = _Fields(config)
        model_type = get("model_type")
        num_layers = int(get("num_hidden_layers"))
        if model_type == "qwen3_moe":
            skip = set(get("mlp_only_layers", None) or [])
            step = int(get("decoder_sparse_step"))
            num_experts = int(get("num_experts"))
            return cls(
                router="softmax",
                num_experts=num_experts,
                top_k=int(get("num_experts_per_tok")),
                expert_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob")),
                shared_intermediate_size=0,
                num_groups=1,
                topk_groups=1,
                routed_scaling_factor=1.0,
                sparse_layers=tuple(
                    i not in skip and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
                ),
            )
        if model_type == "glm4_moe":
            num_experts, num_groups = int(get("n_routed_experts")), int(get("n_group"))
            if num_experts % num_groups != 0:
                raise ValueError(
                    f"n_routed_experts ({num_experts}) must be a multiple of n_group ({num_groups})"
                )
            first_dense = int(get("first_k_dense_replace"))
            return cls(
                router="sigmoid",
                num_experts=num_experts,
                top_k=int(get("num_experts_per_tok")),
                expert_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob")),
                shared_intermediate_size=int(get("moe_intermediate_size")) * int(get("n_shared_experts")),
                num_groups=num_groups,
                topk_groups=int(get("topk_group")),
                routed_scaling_factor=float(get("routed_scaling_factor")),
                sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
                num_extra_layers=int(get("num_nextn_predict_layers", 0) or 0),
            )
        raise ValueError(
            f"no mixture-of-experts layout for model type {model_type!r} (known: {DECODER_MOE_MODEL_TYPES})"
        )


@dataclass(frozen=True)
class ModelArch:
    """A Llama-like decoder (Llama, Qwen2, Qwen3, Qwen3-MoE, GLM-4-MoE): what its parameter shapes, its
    activations and its forward depend on."""

    model_type: str
    """Hugging Face ``model_type`` (``llama``, ``qwen2``...)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Width of a dense layer's gated MLP."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    """Biases on the q, k and v projections (Qwen2; Llama and Qwen3 with ``attention_bias``)."""
    o_bias: bool
    """A bias on the output projection (Llama and Qwen3 with ``attention_bias``)."""
    mlp_bias: bool
    qk_norm: bool
    """RMSNorms over each head of q and k (Qwen3)."""
    tie_word_embeddings: bool
    rope_type: str
    """``default``, ``linear``, ``llama3``... (``rope_parameters["rope_type"]``)."""
    rope_parameters: dict[str, Any]
    """The rotary embedding's parameters, ``rope_theta`` among them (transformers 5's ``rope_parameters``, or
    ``rope_scaling`` plus ``rope_theta``)."""
    moe: MoeArch | None = None
    """The mixture-of-experts layers; None for a dense model."""

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | object) -> ModelArch:
        """Read a Llama-like model's Hugging Face config: a ``config.json`` dict or a ``PretrainedConfig``.

        Keys a ``config.json`` may omit take ``transformers``' Llama defaults. Whether nemo_rl's own decoder
        implements the model is checked by ``nemo_rl.models.hf_decoder.decoder_arch``, not here."""
        get = _Fields(config)
        model_type = str(get("model_type", "llama"))
        num_heads = int(get("num_attention_heads"))
        hidden_size = int(get("hidden_size"))
        attention_bias = bool(get("attention_bias", False))
        rope_type, rope_parameters = _read_rope(get)
        return cls(
            model_type=model_type,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(get("intermediate_size")),
            num_layers=int(get("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(get("num_key_value_heads", None) or num_heads),
            head_dim=int(get("head_dim", None) or hidden_size // num_heads),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            # Qwen2 always has q/k/v biases and no o_proj bias; GLM-4-MoE uses `attention_bias` for q/k/v only;
            # Llama and Qwen3 (dense or MoE) use it for all four.
            qkv_bias=True if model_type in QWEN2_LAYOUT_MODEL_TYPES else attention_bias,
            o_bias=False if model_type in (*QWEN2_LAYOUT_MODEL_TYPES, "glm4_moe") else attention_bias,
            mlp_bias=bool(get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe") or bool(get("use_qk_norm", False)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            rope_type=rope_type,
            rope_parameters=rope_parameters,
            moe=MoeArch.from_hf_config(config) if model_type in DECODER_MOE_MODEL_TYPES else None,
        )

    @property
    def q_size(self) -> int:
        """Width of the query projection (N * D)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection (K * D)."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameters of a dense causal LM (a tied output head counted once)."""
        q, kv, h, i = self.q_size, self.kv_size, self.hidden_size, self.intermediate_size
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        attention += 2 * self.head_dim * self.qk_norm
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        layer = attention + mlp + 2 * h
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_layers * layer + heads * self.vocab_size * self.hidden_size + self.hidden_size


def _read_rope(get: _Fields) -> tuple[str, dict[str, Any]]:
    """The rope type and parameters, from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    params = get("rope_parameters", None)
    if params is None:
        params = dict(get("rope_scaling", None) or {})
        params.setdefault("rope_theta", get("rope_theta", 10000.0))
    params = dict(params)
    return str(params.get("rope_type", params.get("type", "default"))), params


def _known_configs() -> dict[str, dict[str, Any]]:
    """The table in ``known_archs.json``: each model's fields of its public ``config.json``."""
    table: dict[str, dict[str, Any]] = json.loads((Path(__file__).parent / "known_archs.json").read_text())
    return table


_KNOWN_CONFIGS = _known_configs()

KNOWN_ARCHS: dict[str, ModelArch] = {
    name: ModelArch.from_hf_config(config) for name, config in _KNOWN_CONFIGS.items()
}
"""Architectures of the models the shipped recipes (and NeMo RL's) name, from their public ``config.json``
(kept as data in ``known_archs.json`` next to this module)."""

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
        return ModelArch.from_hf_config(raw | dict(hf_config_overrides or {})), str(config_file)
    known = _KNOWN_CONFIGS.get(model_name)
    if known is None:
        return None, (
            f"{model_name} is neither a local folder with a config.json nor one of the models whose "
            "architecture nemo_rl.config.model_arch.KNOWN_ARCHS lists"
        )
    return ModelArch.from_hf_config(
        known | dict(hf_config_overrides or {})
    ), "nemo_rl.config.model_arch.KNOWN_ARCHS"
