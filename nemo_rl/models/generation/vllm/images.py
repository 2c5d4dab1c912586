"""Image prompts for vLLM: the generation batch's per-row ``pixel_values`` / ``image_grid_thw`` as the
pictures vLLM's ``multi_modal_data`` takes.

vLLM runs the model's Hugging Face processor itself and accepts, besides pictures, only precomputed image
*embeddings* (not patches). The batch holds the processor's patches, so each picture is rebuilt from them:
the processor resized the picture to whole patches in 8-bit RGB, then rescaled, normalised and cut it into
patches (each repeated ``temporal_patch_size`` times); undoing the cut and the normalisation and rounding
gives those 8-bit pixels back exactly. vLLM's processor then finds the size already a multiple of the patch
grid within its pixel bounds, leaves it as it is, and computes the same patches (a unit test checks the
round trip against the processor). vLLM also expands each image's placeholder into one per merged patch
itself, from the grid of the patches it computes: a batch's prompts hold them expanded already (as the
policy reads them), so each image's run is given to vLLM as the single placeholder the chat template wrote.

Tensor legend: N = patches of an image, C = channels, T = temporal patch, P = patch side, M = merge size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from nemo_rl.models.vlm import is_vision_language


@dataclass(frozen=True)
class PatchLayout:
    """What the image processor did to a picture: patch geometry and normalisation."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    image_token_id: int
    """The image placeholder token."""

    @classmethod
    def of_source(cls, source: str, trust_remote_code: bool, image_token_id: int) -> PatchLayout:
        """The layout of the image processor vLLM loads for the engine (from ``source``, its tokenizer folder)."""
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(source, trust_remote_code=trust_remote_code)
        return cls.of_processor(processor, image_token_id)

    @classmethod
    def of_processor(cls, image_processor: Any, image_token_id: int) -> PatchLayout:
        """The layout of a Qwen2-VL image processor (``AutoProcessor(...).image_processor``)."""
        return cls(
            image_token_id=image_token_id,
            patch_size=int(image_processor.patch_size),
            merge_size=int(image_processor.merge_size),
            temporal_patch_size=int(image_processor.temporal_patch_size),
            image_mean=tuple(float(v) for v in image_processor.image_mean),
            image_std=tuple(float(v) for v in image_processor.image_std),
            rescale_factor=float(image_processor.rescale_factor),
        )


def patch_layout(hf_config: Any, source: str, trust_remote_code: bool) -> PatchLayout | None:
    """The :class:`PatchLayout` of a vision-language model's processor (loaded from ``source``, where vLLM
    loads it), ``None`` for a text model."""
    if not is_vision_language(hf_config):
        return None
    return PatchLayout.of_source(source, trust_remote_code, int(hf_config.image_token_id))


def picture_from_patches(
    pixel_values_ND: torch.Tensor, grid_thw: torch.Tensor, layout: PatchLayout
) -> Image.Image:
    """The 8-bit RGB picture whose processing gave one image's patches ``[t * h * w, C * T * P * P]``."""
    grid_t, grid_h, grid_w = (int(v) for v in grid_thw.tolist())
    if grid_t != 1:
        raise ValueError(
            f"image grid {grid_thw.tolist()} has {grid_t} temporal patches: videos are not supported"
        )
    p, m, t = layout.patch_size, layout.merge_size, layout.temporal_patch_size
    channels = pixel_values_ND.shape[1] // (t * p * p)
    x = pixel_values_ND.float().reshape(grid_h // m, grid_w // m, m, m, channels, t, p, p)[:, :, :, :, :, 0]
    # [h/M, w/M, M, M, C, P, P] -> [C, h/M, M, P, w/M, M, P] -> [C, H, W]: the processor's cut, undone.
    image_CHW = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(channels, grid_h * p, grid_w * p)
    mean = torch.tensor(layout.image_mean)[:, None, None]
    std = torch.tensor(layout.image_std)[:, None, None]
    pixels = ((image_CHW * std + mean) / layout.rescale_factor).round().clamp(0, 255).to(torch.uint8)
    return Image.fromarray(np.ascontiguousarray(pixels.permute(1, 2, 0).numpy()), mode="RGB")


def row_pictures(
    pixel_values_ND: torch.Tensor, grid_thw_I3: torch.Tensor, layout: PatchLayout
) -> list[Image.Image]:
    """The pictures of one row (its images' patches concatenated, as the batch holds them)."""
    sizes = grid_thw_I3.prod(dim=-1).tolist()
    chunks = torch.split(pixel_values_ND, [int(s) for s in sizes])
    return [
        picture_from_patches(chunk, grid, layout) for chunk, grid in zip(chunks, grid_thw_I3, strict=True)
    ]


def collapse_placeholders(token_ids: list[int], grid_thw_I3: torch.Tensor, layout: PatchLayout) -> list[int]:
    """``token_ids`` with each image's run of placeholders (one per merged patch) given as one placeholder."""
    counts = [int(n) // layout.merge_size**2 for n in grid_thw_I3.prod(dim=-1).tolist()]
    out: list[int] = []
    position, image = 0, 0
    while position < len(token_ids):
        if token_ids[position] != layout.image_token_id:
            out.append(token_ids[position])
            position += 1
            continue
        run = counts[image] if image < len(counts) else 0
        if run == 0 or token_ids[position : position + run] != [layout.image_token_id] * run:
            raise ValueError(
                f"the prompt's image placeholders do not match its {len(counts)} images ({counts} tokens each): "
                "each image's placeholder must be repeated once per merged patch, as the processor does"
            )
        out.append(layout.image_token_id)
        position, image = position + run, image + 1
    if image != len(counts):
        raise ValueError(f"the prompt has placeholders for {image} of its {len(counts)} images")
    return out


def vllm_prompts(
    prompts: list[list[int]],
    pixel_values: list[torch.Tensor | None] | None,
    image_grid_thw: list[torch.Tensor | None] | None,
    layout: PatchLayout | None,
) -> list[dict[str, Any]]:
    """vLLM's prompt dicts: the token ids, and ``multi_modal_data`` for rows with images."""
    out: list[dict[str, Any]] = []
    for row, token_ids in enumerate(prompts):
        prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
        pixels = None if pixel_values is None else pixel_values[row]
        if pixels is not None:
            if layout is None or image_grid_thw is None:
                raise ValueError("the prompts carry images, but the vLLM engine's model is a text model")
            grid = image_grid_thw[row]
            assert grid is not None, "check_generation_input pairs pixel_values with image_grid_thw"
            prompt["prompt_token_ids"] = collapse_placeholders(token_ids, grid, layout)
            prompt["multi_modal_data"] = {"image": row_pictures(pixels, grid, layout)}
        out.append(prompt)
    return out
