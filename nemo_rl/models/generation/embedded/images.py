"""The images of a generation batch's prompts, as the embedded engine reads them.

A batch carries them per row (``pixel_values`` ``[N, D]`` and ``image_grid_thw`` ``[I, 3]``, ``None`` for a
text row; :class:`~nemo_rl.models.generation.interfaces.GenerationDatumSpec`), exactly as
:mod:`nemo_rl.data.vlm` builds them for the policy. GRPO repeats each prompt, images included, once per
sample: :meth:`PromptImages.identity_B` tells equal images apart from different ones by content, so the
engine runs the vision tower and the prefill once per distinct prompt.

Tensor legend: B = rows, N = patches, D = values per patch, I = images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _fingerprint(pixel_values_ND: torch.Tensor, grid_thw_I3: torch.Tensor) -> tuple[object, ...]:
    """A cheap key equal images share (shape, grids, two sums); equal keys are then compared in full."""
    sums = (float(pixel_values_ND.sum()), float(pixel_values_ND[::7].abs().sum()))
    return (tuple(pixel_values_ND.shape), tuple(grid_thw_I3.flatten().tolist()), sums)


@dataclass(frozen=True)
class PromptImages:
    """The images of ``B`` prompts, one entry per prompt (``None``: a prompt without images)."""

    pixel_values: list[torch.Tensor | None]
    """Per prompt, its images' patches ``[N, D]`` as the processor gives them."""
    image_grid_thw: list[torch.Tensor | None]
    """Per prompt, its images' patch grids ``[I, 3]``."""

    @classmethod
    def of_batch(
        cls,
        pixel_values: Sequence[torch.Tensor | None] | None,
        image_grid_thw: Sequence[torch.Tensor | None] | None,
    ) -> PromptImages | None:
        """The images of a batch's rows, or ``None`` when no row has one (a text batch takes the text path)."""
        if pixel_values is None or all(p is None for p in pixel_values):
            return None
        assert image_grid_thw is not None, "check_generation_input pairs pixel_values with image_grid_thw"
        return cls(list(pixel_values), list(image_grid_thw))

    def select(self, rows: Sequence[int]) -> PromptImages:
        """The images of prompts ``rows``, in that order."""
        return PromptImages([self.pixel_values[r] for r in rows], [self.image_grid_thw[r] for r in rows])

    def identity_B(self) -> torch.Tensor:
        """``[B]`` long: prompts with equal images (by value) share an id; -1 for prompts without images."""
        # Per fingerprint, the first row of each distinct image set seen: (its id, its pixels).
        firsts: dict[tuple[object, ...], list[tuple[int, torch.Tensor]]] = {}
        ids: list[int] = []
        num_ids = 0
        for pixels, grid in zip(self.pixel_values, self.image_grid_thw, strict=True):
            if pixels is None or grid is None:
                ids.append(-1)
                continue
            candidates = firsts.setdefault(_fingerprint(pixels, grid), [])
            match = next((id_ for id_, seen in candidates if torch.equal(seen, pixels)), None)
            if match is None:
                match, num_ids = num_ids, num_ids + 1
                candidates.append((match, pixels))
            ids.append(match)
        return torch.tensor(ids, dtype=torch.long)

    def concatenated(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """All prompts' ``pixel_values`` and ``image_grid_thw`` in prompt order (the order of their
        placeholders in a batch), ``(None, None)`` when none has images."""
        pixels = [p for p in self.pixel_values if p is not None]
        grids = [g for g in self.image_grid_thw if g is not None]
        if not pixels:
            return None, None
        return torch.cat(pixels), torch.cat(grids)
