"""What nemo_rl's own decoder implementations read from a Hugging Face checkpoint.

The embedded generation engine and the Megatron policy backend both rebuild Llama / Qwen2 / Qwen3 decoders
from a Hugging Face checkpoint (the embedded engine also the Qwen3-MoE and GLM-4-MoE mixture-of-experts
families, whose expert layout :class:`~nemo_rl.models.hf_moe.MoeArch` holds): :class:`DecoderArch` holds (and checks) the architecture facts of its config,
:func:`resolve_checkpoint_dir` finds its files, :func:`iter_safetensors` streams its weights and
:class:`SafetensorsReader` reads single weights on demand.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nemo_rl.models.hf_moe import DECODER_MOE_MODEL_TYPES, MoeArch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", *DECODER_MOE_MODEL_TYPES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class DecoderArch:
    """The architecture facts the decoder needs, read (and checked) from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    rope_type: str
    rope_parameters: dict[str, Any]
    moe: MoeArch | None = None
    """The mixture-of-experts layers; None for a dense model."""

    @classmethod
    def from_hf_config(cls, config: Any) -> DecoderArch:
        """Read a ``transformers`` ``PretrainedConfig`` of a supported family; raise if it is not supported."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"nemo_rl's own decoder (the embedded engine, the Megatron policy backend) supports model types "
                f"{SUPPORTED_MODEL_TYPES}, got {model_type!r}; for other architectures use "
                "policy.generation.backend=vllm and the DTensor policy backend"
            )
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(
                f"nemo_rl's own decoder implements SiLU-gated MLPs only, the model uses {hidden_act!r}"
            )
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                "nemo_rl's own decoder implements full attention only, but this config has layer types "
                f"{sorted(set(layer_types))} (sliding-window attention); use the vLLM backend"
            )
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rope_type, rope_parameters = _read_rope(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        moe = MoeArch.from_hf_config(config) if model_type in DECODER_MOE_MODEL_TYPES else None
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            # Qwen2 always has q/k/v biases and no o_proj bias; GLM-4-MoE uses `attention_bias` for q/k/v only;
            # Llama and Qwen3 (dense or MoE) use it for all four.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type in ("qwen2", "glm4_moe") else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe") or bool(getattr(config, "use_qk_norm", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_type=rope_type,
            rope_parameters=rope_parameters,
            moe=moe,
        )

    @property
    def q_size(self) -> int:
        """Width of the query projection (N * D)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection (K * D)."""
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse rotary frequencies ``[D / 2]`` (fp32) and the cos/sin scaling factor."""
        theta = float(self.rope_parameters["rope_theta"])
        dim = self.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_type == "linear":
            inv_freq = inv_freq / float(self.rope_parameters["factor"])
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.rope_parameters)
        return inv_freq, 1.0


def _read_rope(config: Any) -> tuple[str, dict[str, Any]]:
    """The rope type and parameters, from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_theta" not in params:
        raise ValueError(
            f"the model config's rope parameters {params} have no `rope_theta` (per-layer-type rope "
            "parameters are not supported by nemo_rl's own decoder)"
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"nemo_rl's own decoder supports rope types {SUPPORTED_ROPE_TYPES}, the model uses {rope_type!r}; "
            "use policy.generation.backend=vllm and the DTensor policy backend for this model"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            "nemo_rl's own decoder does not support partial rotary embeddings (partial_rotary_factor != 1)"
        )
    return rope_type, params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, a smooth ramp in between."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def resolve_checkpoint_dir(model_name: str) -> Path:
    """A local folder holding ``model_name``'s config and safetensors: the path itself, or a hub snapshot."""
    path = Path(model_name).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_name, allow_patterns=["*.json", "*.safetensors"]))


def _safetensors_files(folder: Path) -> dict[str, str]:
    """``{weight name: file name}`` of a checkpoint folder's safetensors (sharded or not)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return weight_map
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {folder}; save the model with save_pretrained(safe_serialization=True)"
        )
    names: dict[str, str] = {}
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def iter_safetensors(folder: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` from a Hugging Face checkpoint folder's safetensors files (sharded or not)."""
    folder = Path(folder)
    files = sorted(set(_safetensors_files(folder).values()))
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                yield name, f.get_tensor(name)


class SafetensorsReader:
    """Random access to single weights of a checkpoint folder: each read maps only that tensor's bytes."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self._file_of = _safetensors_files(self.folder)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        """The tensor stored under ``name``; ``KeyError`` naming the folder when it is absent."""
        if name not in self._file_of:
            raise KeyError(f"the checkpoint in {self.folder} has no weight {name!r}")
        with safe_open(str(self.folder / self._file_of[name]), framework="pt") as f:
            return f.get_tensor(name)
