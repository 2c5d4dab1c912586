"""What a prefill of image prompts adds to a text prefill: the image features written into the placeholder
tokens' embeddings, and Qwen2-VL's multimodal rotary positions (mRoPE).

mRoPE gives every prompt token three positions (temporal, height, width): equal for text tokens, the
image grid's coordinates for image tokens (transformers' ``get_rope_index`` computes them, see :mod:`.vision`).
The rotary frequencies are split into three sections (``rope_parameters["mrope_section"]``), each rotated by
one of the three positions. After the prompt every token is text, so its three positions are equal and its
rotation is the plain 1-D one at ``position + rope_delta`` (``rope_delta`` = the prompt's largest
multimodal position + 1 - its length, <= 0): decoding reads the 1-D table at that offset.

Tensor legend: B = prompts, T = prompt width, M = real prompt tokens (packed), N = image tokens,
H = hidden size, P = table positions, D = head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def mrope_axes(sections: Sequence[int], head_dim: int) -> torch.Tensor:
    """``[D]`` long: which of the three positions (0 temporal, 1 height, 2 width) rotates each dim, in the
    half-split layout (as transformers' ``recomposition_frequencies``: section ``i`` uses axis ``i % 3``)."""
    half = torch.cat([torch.full((size,), i % 3, dtype=torch.long) for i, size in enumerate(sections)])
    if half.numel() * 2 != head_dim:
        raise ValueError(f"mrope_section {list(sections)} does not cover half the head dim {head_dim}")
    return torch.cat((half, half))


@dataclass(frozen=True)
class ImagePrefill:
    """The image part of one prefill call over ``B`` right-padded prompts."""

    features_NH: torch.Tensor
    """The image tokens' embeddings (the vision tower's merged output), in prompt order then token order."""
    positions_3BT: torch.Tensor
    """``[3, B, T]`` long: each prompt token's multimodal positions (padding: anything)."""
    axes_D: torch.Tensor
    """:func:`mrope_axes` of the model."""
    image_token_id: int
    """The placeholder token the features replace."""

    def write_features(self, x_MH: torch.Tensor, ids_M: torch.Tensor) -> torch.Tensor:
        """``x`` with the placeholder tokens' rows replaced by the image features (as transformers'
        ``masked_scatter``); the count must match."""
        mask_M = ids_M == self.image_token_id
        num_tokens = int(mask_M.sum())
        if num_tokens != self.features_NH.shape[0]:
            raise ValueError(
                f"the prompts hold {num_tokens} image tokens for {self.features_NH.shape[0]} image features: "
                "each image's placeholder must be repeated once per merged patch (as the processor does)"
            )
        x_MH[mask_M] = self.features_NH.to(x_MH.dtype)
        return x_MH

    def rope_tables(
        self, cos_P1D: torch.Tensor, sin_P1D: torch.Tensor, rows_M: torch.Tensor, positions_M: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[M, 1, D]`` of the packed prompt tokens: each dim read from the 1-D tables at the
        position of its axis (the tables hold exactly what transformers computes for one position)."""
        device = cos_P1D.device
        positions_3M = self.positions_3BT.to(device)[:, rows_M, positions_M]
        index = self.axes_D.to(device).view(1, 1, 1, -1).expand(1, positions_3M.shape[1], 1, -1)
        cos_M1D = cos_P1D[positions_3M].gather(0, index)[0]
        sin_M1D = sin_P1D[positions_3M].gather(0, index)[0]
        return cos_M1D, sin_M1D
