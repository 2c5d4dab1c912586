"""The decode loop's state of :class:`~.engine.EmbeddedEngine`: what it produces per sequence
(:class:`Generated`) and the step state of the rows still in the batch (:class:`Rows`).

Tensor legend: B = sequences (or cache rows), T = generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Generated:
    """What the decode loop produces, indexed by sequence (the row of the input)."""

    tokens_BT: torch.Tensor
    """``[B, max budget]`` long, generated tokens; pad past each length."""
    logprobs_BT: torch.Tensor
    """``[B, max budget]`` float32, their log-probs."""
    lengths_B: torch.Tensor
    """``[B]`` long, tokens generated."""
    truncated_B: torch.Tensor
    """``[B]`` bool, ran out of budget without a stop."""


@dataclass
class Rows:
    """Step state of the rows in the batch, one entry per cache row; compaction selects them together."""

    orig_B: torch.Tensor
    """Sequence each cache row holds."""
    positions_B: torch.Tensor
    """Position of the token the next decode step feeds (the one sampled at this step)."""
    budget_B: torch.Tensor
    """Most tokens each row may generate."""
    alive_B: torch.Tensor
    """Rows still generating (finished rows stay until the next compaction)."""
    tokens_BT: torch.Tensor
    """``[B, max budget]`` tokens sampled so far, by step."""
    logprobs_BT: torch.Tensor
    """``[B, max budget]`` their log-probs."""
    stops: list[tuple[str, ...]]
    """Stop strings of each row."""
    rope_offset_B: torch.Tensor | None = None
    """Image prompts only: added to a token's position for its rotary embedding (the prompt's multimodal
    ``rope_delta``, see :mod:`.mrope`); ``None`` for text (rotary position = position)."""

    def rope_positions(self) -> torch.Tensor:
        """The rotary positions of the tokens the next decode step feeds."""
        if self.rope_offset_B is None:
            return self.positions_B
        return self.positions_B + self.rope_offset_B

    def select(self, keep_B: torch.Tensor) -> Rows:
        """The rows ``keep_B`` (ascending), in that order."""
        keep = keep_B.tolist()
        return Rows(
            orig_B=self.orig_B[keep_B],
            positions_B=self.positions_B[keep_B],
            budget_B=self.budget_B[keep_B],
            alive_B=self.alive_B[keep_B],
            tokens_BT=self.tokens_BT[keep_B],
            logprobs_BT=self.logprobs_BT[keep_B],
            stops=[self.stops[i] for i in keep],
            rope_offset_B=None if self.rope_offset_B is None else self.rope_offset_B[keep_B],
        )

    @classmethod
    def start(
        cls,
        lengths_B: torch.Tensor,
        budget_B: torch.Tensor,
        max_budget: int,
        row_stops: list[tuple[str, ...]],
        rope_offset_B: torch.Tensor | None,
    ) -> Rows:
        """Every sequence in its own row, about to sample the token after its prompt."""
        num_seqs, device = lengths_B.shape[0], lengths_B.device
        return cls(
            orig_B=torch.arange(num_seqs, device=device),
            positions_B=lengths_B.clone(),
            budget_B=budget_B,
            alive_B=budget_B > 0,
            tokens_BT=torch.empty((num_seqs, max_budget), dtype=torch.long, device=device),
            logprobs_BT=torch.empty((num_seqs, max_budget), dtype=torch.float32, device=device),
            stops=list(row_stops),
            rope_offset_B=rope_offset_B,
        )
