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


def vlm_token_ids(hf_config: Any) -> dict[str, Any]:
    """What :func:`image_forward_inputs` needs of a model's config: ``image_token_id`` (``None`` for a text
    model), ``pad_token_id`` and the vision tower's ``merge_size``."""
    vision = _config_value(hf_config, "vision_config")
    if vision is None:
        return {"image_token_id": None}
    pad = _config_value(hf_config, "pad_token_id")
    if pad is None:  # transformers 5 keeps it in the language model's config
        pad = _config_value(_config_value(hf_config, "text_config") or {}, "pad_token_id")
    return {
        "image_token_id": _config_value(hf_config, "image_token_id"),
        # A model without a pad token: any text token serves, it only stands in for a stray placeholder.
        "pad_token_id": 0 if pad is None else int(pad),
        "merge_size": int(_config_value(vision, "spatial_merge_size")),
    }


def image_forward_inputs(
    mb: BatchedDataDict[Any],
    device: torch.device,
    image_token_id: int | None,
    *,
    pad_token_id: int | None = None,
    merge_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """The model's image keywords for a micro-batch: its rows' ``pixel_values`` [N, D] and ``image_grid_thw``
    [I, 3] concatenated in row order, and ``mm_token_type_ids`` [B, T] (1 at the image placeholders, as the
    processor returns it: without it transformers gives the tokens plain 1-D positions instead of the
    multimodal RoPE ones). Empty when no row holds an image.

    With ``pad_token_id`` and ``merge_size`` (the vision config's ``spatial_merge_size``), a sampled response
    (``token_mask`` > 0) that holds the image placeholder token itself, in a row whose prompt already has all
    its images' placeholders, is fed with those tokens as ``pad_token_id`` (``input_ids`` is returned then):
    transformers would otherwise count more placeholders than image features and fail. They are still scored
    where they were sampled; only the later tokens of that rare row read another embedding than the sampler
    did."""
    pixels = [p for p in mb.get("pixel_values") or () if p is not None]
    if not pixels:
        return {}
    assert image_token_id is not None, "a batch with images needs the model's image_token_id"
    grids = [g for g in mb["image_grid_thw"] if g is not None]
    ids_BT = mb["input_ids"]
    placeholders_BT = ids_BT == image_token_id
    inputs: dict[str, torch.Tensor] = {}
    if pad_token_id is not None and merge_size is not None and "token_mask" in mb:
        stray_BT = _stray_placeholders(mb, placeholders_BT, merge_size)
        if bool(stray_BT.any()):
            placeholders_BT = placeholders_BT & ~stray_BT
            inputs["input_ids"] = ids_BT.masked_fill(stray_BT, pad_token_id).to(device)
    return {
        **inputs,
        "pixel_values": torch.cat(pixels).to(device),
        "image_grid_thw": torch.cat(grids).to(device),
        "mm_token_type_ids": placeholders_BT.int().to(device),
    }


def _stray_placeholders(
    mb: BatchedDataDict[Any], placeholders_BT: torch.Tensor, merge_size: int
) -> torch.Tensor:
    """[B, T] bool: sampled image placeholders of rows whose other placeholders already match their images."""
    sampled_BT = mb["token_mask"][:, : placeholders_BT.shape[1]].to(placeholders_BT.device) > 0
    expected_B = torch.tensor(
        [0 if g is None else int(g.prod(dim=-1).sum()) // merge_size**2 for g in mb["image_grid_thw"]],
        device=placeholders_BT.device,
    )
    given_B = (placeholders_BT & ~sampled_BT).sum(dim=1)
    return placeholders_BT & sampled_BT & (given_B == expected_B)[:, None]
