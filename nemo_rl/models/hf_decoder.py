"""What nemo_rl's own decoder implementations read from a Hugging Face checkpoint.

The embedded generation engine and the Megatron policy backend both rebuild Llama / Qwen2 / Qwen3 decoders
from a Hugging Face checkpoint (the embedded engine also the Qwen3-MoE and GLM-4-MoE mixture-of-experts
families): :func:`decoder_arch` reads the architecture record
(:class:`~nemo_rl.config.model_arch.ModelArch`) of its config and checks that these decoders implement it,
:func:`rope_inv_freq` computes its rotary frequencies, :func:`resolve_checkpoint_dir` finds its files,
:func:`iter_safetensors` streams its weights and :class:`SafetensorsReader` reads single weights on demand.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nemo_rl.config.model_arch import DECODER_MOE_MODEL_TYPES, QWEN2_LAYOUT_MODEL_TYPES, ModelArch

SUPPORTED_MODEL_TYPES = ("llama", *QWEN2_LAYOUT_MODEL_TYPES, "qwen3", *DECODER_MOE_MODEL_TYPES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def decoder_arch(config: Any) -> ModelArch:
    """The architecture of a ``transformers`` ``PretrainedConfig``; raise if nemo_rl's own decoder does not
    implement it (model type, activation, attention layout, rotary embedding)."""
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
    arch = ModelArch.from_hf_config(config)
    if arch.num_heads % arch.num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads ({arch.num_heads}) must be a multiple of num_key_value_heads ({arch.num_kv_heads})"
        )
    _check_rope(arch)
    return arch


def _check_rope(arch: ModelArch) -> None:
    params = arch.rope_parameters
    if "rope_theta" not in params:
        raise ValueError(
            f"the model config's rope parameters {params} have no `rope_theta` (per-layer-type rope "
            "parameters are not supported by nemo_rl's own decoder)"
        )
    if arch.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"nemo_rl's own decoder supports rope types {SUPPORTED_ROPE_TYPES}, the model uses {arch.rope_type!r}; "
            "use policy.generation.backend=vllm and the DTensor policy backend for this model"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            "nemo_rl's own decoder does not support partial rotary embeddings (partial_rotary_factor != 1)"
        )


def rope_inv_freq(arch: ModelArch) -> tuple[torch.Tensor, float]:
    """Inverse rotary frequencies ``[D / 2]`` (fp32) of ``arch`` and the cos/sin scaling factor."""
    theta = float(arch.rope_parameters["rope_theta"])
    dim = arch.head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if arch.rope_type == "linear":
        inv_freq = inv_freq / float(arch.rope_parameters["factor"])
    elif arch.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, arch.rope_parameters)
    return inv_freq, 1.0


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
