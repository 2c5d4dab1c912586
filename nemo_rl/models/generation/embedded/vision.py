"""Vision-language models (Qwen2.5-VL, Qwen2-VL) in the embedded engine: the language model is a
:class:`~.model.DecoderLM` (a Qwen2 decoder under ``model.language_model.``) and the vision tower is
transformers' own module, so its numerics are transformers' by construction.

- :class:`VisionTower` holds the tower (patch embedding, blocks and the merger that projects into the language
  model) under its Hugging Face names (``model.visual.*``), encodes a batch's images into the placeholder
  tokens' embeddings, and computes the prompts' multimodal rotary positions with the model class's own
  ``get_rope_index`` (bound to a shell of the model built on the meta device: no weights, no memory).
- :class:`VisionLanguageLM` is the decoder plus the tower: one set of weights for checkpoints and refits
  (the tower's names go to the tower), so the engine, its replicas and the refit manifest see one model.

:func:`load_decoder` loads either kind from a checkpoint folder.

Tensor legend: B = prompts, T = prompt width, N = patches (or image tokens), D = values per patch,
I = images, H = the language model's hidden size.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nemo_rl.models.generation.embedded.model import DecoderLM, WeightManifest
from nemo_rl.models.generation.embedded.mrope import ImagePrefill, mrope_axes
from nemo_rl.models.hf_decoder import decoder_arch
from nemo_rl.models.vlm import LANGUAGE_MODEL, VISION_TOWER, is_vision_language

LANGUAGE_PREFIX = LANGUAGE_MODEL + "."
"""Name prefix of the language model's weights in a vision-language checkpoint."""


class VisionTower:
    """transformers' vision tower of a Qwen2-VL / Qwen2.5-VL config, with the model's multimodal positions.

    Args:
        config: the model's ``transformers`` config (with ``vision_config``).
        dtype: the tower's dtype (the engine's).
        device: where it runs.
    """

    def __init__(self, config: Any, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        from transformers import AutoModel

        with torch.device("meta"):
            shell = AutoModel.from_config(config)
        # get_rope_index reads only the shell's config: the transformers function, not a copy of it.
        self._rope_index = shell.get_rope_index
        self.module: torch.nn.Module = (
            type(shell.visual)._from_config(config.vision_config, dtype=dtype).to(device).eval()
        )
        self.image_token_id = int(config.image_token_id)
        self.dtype = dtype
        self._params = {VISION_TOWER + name: p for name, p in self.module.named_parameters()}

    @property
    def device(self) -> torch.device:
        """Where the tower's weights are."""
        return next(iter(self._params.values())).device

    def to(self, device: torch.device | str) -> None:
        """Move the tower to ``device`` (in place: the named parameters stay the module's)."""
        self.module.to(device)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight under its Hugging Face name."""
        yield from self._params.items()

    def weights_manifest(self) -> WeightManifest:
        """Name -> (shape, dtype) of every weight of the tower (it has no persistent buffers)."""
        return {name: (tuple(p.shape), self.dtype) for name, p in self._params.items()}

    def load_weight(self, name: str, tensor: torch.Tensor) -> int:
        """Copy one Hugging Face-named tensor into the tower; return the bytes read."""
        target = self._params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        return tensor.numel() * tensor.element_size()

    @torch.inference_mode()
    def encode(self, pixel_values_ND: torch.Tensor, grid_thw_I3: torch.Tensor) -> torch.Tensor:
        """The image tokens' embeddings ``[tokens, H]`` of the images (``pixel_values`` / ``image_grid_thw``
        as the processor gives them), in image order: what transformers' ``get_image_features`` concatenates."""
        device = self.device
        out = self.module(pixel_values_ND.to(device, self.dtype), grid_thw=grid_thw_I3.to(device))
        features: torch.Tensor = out.pooler_output
        return features

    def positions(
        self, input_ids_BT: torch.Tensor, lengths_B: torch.Tensor, grid_thw_I3: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions [3, B, T], rope_deltas [B])`` of right-padded prompts whose images have the grids
        ``grid_thw_I3`` (in prompt order; ``None``: no image), from transformers' ``get_rope_index``."""
        ids_BT = input_ids_BT.cpu()
        mask_BT = torch.arange(ids_BT.shape[1])[None, :] < lengths_B.cpu()[:, None]
        positions_3BT, deltas_B1 = self._rope_index(
            ids_BT,
            mm_token_type_ids=(ids_BT == self.image_token_id).int(),
            image_grid_thw=None if grid_thw_I3 is None else grid_thw_I3.cpu(),
            attention_mask=mask_BT.long(),
        )
        return positions_3BT, deltas_B1.reshape(-1)


class VisionLanguageLM(DecoderLM):
    """A Qwen2-VL / Qwen2.5-VL for inference: the language model as a :class:`DecoderLM` (names under
    ``model.language_model.``) and the :class:`VisionTower` (``model.visual.``), loaded and refitted as one.

    Args:
        config: the model's ``transformers`` config.
        dtype: the weights' dtype.
        device: where they live.
    """

    def __init__(self, config: Any, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        # Tying is the outer config's (transformers 5 moves it out of text_config).
        arch = dataclasses.replace(
            decoder_arch(config.text_config), tie_word_embeddings=bool(config.tie_word_embeddings)
        )
        super().__init__(arch, dtype=dtype, device=device, prefix=LANGUAGE_PREFIX)
        self.vision = VisionTower(config, dtype=dtype, device=device)
        self._axes_D = mrope_axes(self.arch.rope_parameters["mrope_section"], self.arch.head_dim)

    @classmethod
    def from_config(
        cls, config: Any, *, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> VisionLanguageLM:
        """The model of a ``transformers`` vision-language config, its weights uninitialised until loaded."""
        return cls(config, dtype=dtype, device=device)

    def to(self, device: torch.device | str) -> VisionLanguageLM:
        """Move the decoder's and the tower's weights to ``device`` in place."""
        super().to(device)
        self.vision.to(device)
        return self

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The decoder's weights, then the tower's, under their Hugging Face names."""
        yield from super().named_weights()
        yield from self.vision.named_weights()

    def weights_manifest(self) -> WeightManifest:
        """The decoder's manifest and the tower's."""
        return super().weights_manifest() | self.vision.weights_manifest()

    @property
    def num_weight_bytes(self) -> int:
        """Bytes held by the decoder's and the tower's weights."""
        tower = sum(t.numel() * t.element_size() for _, t in self.vision.named_weights())
        return super().num_weight_bytes + tower

    def load_weight(self, name: str, tensor: torch.Tensor) -> int:
        """Copy one Hugging Face-named tensor into the tower or the decoder (see :meth:`DecoderLM.load_weight`);
        a checkpoint's names (``visual.*``, ``model.layers.*``) are read as transformers reads them."""
        name = in_memory_name(name)
        if name.startswith(VISION_TOWER):
            return self.vision.load_weight(name, tensor)
        return super().load_weight(name, tensor)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a stream of ``(name, tensor)`` (checkpoint or in-memory names); return the in-memory names
        written."""
        return super().load_weights((in_memory_name(name), tensor) for name, tensor in named_tensors)

    def image_prefill(
        self,
        input_ids_BT: torch.Tensor,
        lengths_B: torch.Tensor,
        pixel_values_ND: torch.Tensor | None,
        grid_thw_I3: torch.Tensor | None,
    ) -> tuple[ImagePrefill, torch.Tensor]:
        """What :meth:`prefill` needs for these prompts and their images (all of them, in prompt order;
        ``None`` when no prompt has one), and each prompt's ``rope_delta`` ``[B]`` for decoding."""
        positions_3BT, deltas_B = self.vision.positions(input_ids_BT, lengths_B, grid_thw_I3)
        if pixel_values_ND is None or grid_thw_I3 is None:
            features_NH = torch.zeros((0, self.arch.hidden_size), dtype=self.dtype, device=self.device)
        else:
            features_NH = self.vision.encode(pixel_values_ND, grid_thw_I3)
        images = ImagePrefill(features_NH, positions_3BT, self._axes_D, self.vision.image_token_id)
        return images, deltas_B.to(self.device)


def in_memory_name(name: str) -> str:
    """The name a Qwen2-VL / Qwen2.5-VL weight has in transformers' model (and in refits) for a name as a
    checkpoint stores it: Qwen's checkpoints (and transformers' own saves) keep ``visual.*`` and
    ``model.*`` for the tower and the language model, which transformers renames on load to ``model.visual.*``
    and ``model.language_model.*``."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith((VISION_TOWER, LANGUAGE_PREFIX)):
        return LANGUAGE_PREFIX + name.removeprefix("model.")
    return name


def decoder_class(config: Any) -> type[DecoderLM]:
    """The embedded model class for a ``transformers`` config: :class:`VisionLanguageLM` for a
    vision-language model, else :class:`DecoderLM`."""
    return VisionLanguageLM if is_vision_language(config) else DecoderLM


def load_decoder(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    config_overrides: Mapping[str, Any] | None = None,
) -> DecoderLM:
    """The model of a local Hugging Face checkpoint folder, text or vision-language (``from_pretrained``)."""
    from nemo_rl.models.hf_config import load_hf_config

    config = load_hf_config(Path(path), overrides=config_overrides)
    return decoder_class(config).from_pretrained(
        path, dtype=dtype, device=device, config_overrides=config_overrides
    )
