"""Vision-language models (Qwen2.5-VL, Qwen2-VL) in the DTensor policy worker: what the worker does differently
for a model whose Hugging Face config has a ``vision_config``.

- The model is transformers' own ``*ForConditionalGeneration`` class (``AutoModelForImageTextToText``), so a
  hub checkpoint loads and an export reloads with no conversion.
- Sharding: FSDP2 wraps the language model's decoder layers; the vision tower (patch embedding, blocks and
  the merger that projects into the language model) stays a plain module replicated on every data-parallel
  rank, its gradients summed with one all-reduce after the step's last micro-batch (the worker's replicated
  path). A rank whose micro-batch holds no image then skips the tower without leaving the other ranks
  waiting in a collective inside it, which an FSDP-sharded tower would.
- ``policy.dtensor_cfg.freeze_config`` freezes the vision tower, its projection (the merger) or the language
  model by parameter name (:func:`frozen_submodel_names`), as ``policy.frozen_parameters`` freezes by pattern.
- Forward: each row carries its own ``pixel_values`` / ``image_grid_thw`` (a list entry per row, ``None``
  for a row without images; :mod:`nemo_rl.data.vlm`); a micro-batch's entries are concatenated in row order,
  the order of its image placeholders, and given to the model with its tokens and the placeholders' token
  types (:func:`image_forward_inputs`), from which the model computes its multimodal RoPE positions.

Tensor parallelism shards the language model with the Qwen2 plan (``parallelize``); the vision tower stays
whole on every rank. What is refused for these models, each with its reason (:func:`check_vlm_policy`): the
Megatron backend, sequence parallelism, sequence packing and shared-prompt forwards (both lay several rows end
to end, and the multimodal positions would have to restart per row), and reward / value heads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nemo_rl.config.dtensor import VisionFreezeConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

VLM_MODEL_TYPES = frozenset({"qwen2_5_vl", "qwen2_vl"})
"""Hugging Face ``model_type`` values of the vision-language families built here."""

VISION_TOWER = "model.visual."
"""Name prefix of the vision tower's parameters (Qwen2-VL / Qwen2.5-VL)."""

LANGUAGE_MODEL = "model.language_model"
"""Module path of the language model (a Qwen2 decoder without its head), which tensor parallelism shards."""

VISION_PROJECTION = "model.visual.merger."
"""Name prefix of the projection from the vision tower into the language model (the patch merger)."""


def _config_value(hf_config: Any, key: str) -> Any:
    """``key`` of a Hugging Face config given as a ``PretrainedConfig`` or as its ``config.json`` dict."""
    return hf_config.get(key) if isinstance(hf_config, Mapping) else getattr(hf_config, key, None)


def is_vision_language(hf_config: Any) -> bool:
    """Whether a Hugging Face config (a ``PretrainedConfig`` or its ``config.json`` dict) describes a
    vision-language model: it has a ``vision_config``."""
    return _config_value(hf_config, "vision_config") is not None


def _refused(cfg: PolicyConfig, model_type: str) -> str | None:
    """The first setting a vision-language policy cannot run with, as a one-line reason, or ``None``."""
    if model_type not in VLM_MODEL_TYPES:
        return (
            f"its model type {model_type!r} is not built here (vision-language families: "
            f"{sorted(VLM_MODEL_TYPES)}): use one of those"
        )
    if cfg.megatron_cfg.enabled:
        return (
            "the Megatron backend builds text models only (megatron-core's multimodal models are not wired "
            "here): set policy.dtensor_cfg.enabled=true policy.megatron_cfg.enabled=false"
        )
    if cfg.reward_model_cfg.enabled:
        return (
            "reward and value heads are built for text models only: set policy.reward_model_cfg.enabled=false"
        )
    if cfg.dtensor_cfg.sequence_parallel:
        return (
            "sequence parallelism shards the token embeddings along the sequence, where the image features "
            "are written in: set policy.dtensor_cfg.sequence_parallel=false (tensor parallelism works)"
        )
    if cfg.packs_sequences:
        return (
            "sequence packing lays rows end to end, and the multimodal RoPE positions would have to restart "
            "per row: set policy.sequence_packing.enabled=false (dynamic batching works)"
        )
    if cfg.shared_prefix.enabled:
        return (
            "shared-prompt forwards pack rows as sequence packing does, which image rows cannot use: set "
            "policy.shared_prefix.enabled=false"
        )
    return None


def check_vlm_policy(cfg: PolicyConfig, hf_config: Any) -> None:
    """Raise :class:`UserError` when ``cfg`` asks for what a vision-language model (or, for the freeze keys,
    a text model) cannot do here; see the module docstring."""
    freeze = cfg.dtensor_cfg.freeze_config
    if not is_vision_language(hf_config):
        asked = [name for name, on in freeze if on]
        if asked:
            raise UserError(
                f"policy.dtensor_cfg.freeze_config.{asked[0]}=true needs a vision-language model, and "
                f"{cfg.model_name} is a text model: set it false"
            )
        return
    reason = _refused(cfg, str(_config_value(hf_config, "model_type")))
    if reason is not None:
        raise UserError(f"{cfg.model_name} is a vision-language model: {reason}")


def frozen_submodel_names(names: Sequence[str], freeze: VisionFreezeConfig) -> list[str]:
    """The parameter ``names`` of the sub-models ``freeze`` freezes: the vision tower without its projection,
    the projection (the merger), the language model (everything outside the vision tower)."""
    frozen = []
    for name in names:
        in_projection = name.startswith(VISION_PROJECTION)
        in_tower = name.startswith(VISION_TOWER) and not in_projection
        in_language_model = not name.startswith(VISION_TOWER)
        if (
            (freeze.freeze_vision_model and in_tower)
            or (freeze.freeze_vision_projection and in_projection)
            or (freeze.freeze_language_model and in_language_model)
        ):
            frozen.append(name)
    return frozen


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision tower of a vision-language model (replicated, not FSDP-sharded), ``None`` for a text model."""
    if not is_vision_language(getattr(model, "config", None)):
        return None
    return model.get_submodule(VISION_TOWER.rstrip("."))


def image_forward_inputs(
    mb: BatchedDataDict[Any], device: torch.device, image_token_id: int | None
) -> dict[str, torch.Tensor]:
    """The model's image keywords for a micro-batch: its rows' ``pixel_values`` [N, D] and ``image_grid_thw``
    [I, 3] concatenated in row order, and ``mm_token_type_ids`` [B, T] (1 at the image placeholders, as the
    processor returns it: without it transformers gives the tokens plain 1-D positions instead of the
    multimodal RoPE ones). Empty when no row holds an image."""
    pixels = [p for p in mb.get("pixel_values") or () if p is not None]
    if not pixels:
        return {}
    assert image_token_id is not None, "a batch with images needs the model's image_token_id"
    grids = [g for g in mb["image_grid_thw"] if g is not None]
    return {
        "pixel_values": torch.cat(pixels).to(device),
        "image_grid_thw": torch.cat(grids).to(device),
        "mm_token_type_ids": (mb["input_ids"] == image_token_id).int().to(device),
    }
