"""What the embedded engine's MoE routers chose during one ``generate`` call, for routing replay.

:class:`RoutingLog` holds, per sequence of the call and per position of its output (prompt, then response), the
top-k experts of every MoE layer, ``-1`` where no forward ran the token (the last sampled token of a response,
padding). The engine fills it from :attr:`~.model.DecoderLM.routing_sink`: each prefill (of the distinct
prompts only; repeats get copies) and each decode step, indexed by the sequence each cache row holds, so
compacting the cache moves nothing here. Tokens re-run after an in-flight weight update are not recorded
again: the routing kept is the one the tokens were sampled under.

Tensor legend: B = sequences, T = positions, M = token rows of one forward, L = MoE layers, K = experts per
token, U = distinct prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nemo_rl.models.generation.embedded.model import DecoderLM

ROUTED_EXPERTS_DTYPE = torch.int16
"""Expert indices travel as int16 (up to 32,767 experts per layer; DeepSeek-V3 has 256)."""


class RoutingLog:
    """The routing of one ``generate`` call: ``experts_BTLK`` ``[B, T, L, K]``, -1 where not recorded."""

    def __init__(self, model: DecoderLM, num_seqs: int, num_positions: int) -> None:
        moe = model.arch.moe
        if moe is None:
            raise ValueError("routing replay records mixture-of-experts routing, and this model is dense")
        self.model = model
        self.experts_BTLK = torch.full(
            (num_seqs, num_positions, sum(moe.sparse_layers), moe.top_k),
            -1,
            dtype=ROUTED_EXPERTS_DTYPE,
            device=model.device,
        )

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Yields the list the MoE layers of the forwards run inside append their ``[M, K]`` experts to."""
        sink: list[torch.Tensor] = []
        self.model.routing_sink = sink
        try:
            yield sink
        finally:
            self.model.routing_sink = None

    def record_prefill(
        self, sink: list[torch.Tensor], lengths_U: torch.Tensor, width: int, inverse_B: torch.Tensor
    ) -> None:
        """Record a prefill of ``U`` right-padded prompts (its rows are their real tokens in row-major order,
        as :meth:`DecoderLM.prefill` packs them); sequence ``b`` ran prompt ``inverse_B[b]``."""
        valid_UT = torch.arange(width, device=lengths_U.device)[None, :] < lengths_U[:, None]
        rows_M, positions_M = valid_UT.nonzero().unbind(1)
        prompts_UTLK = self.experts_BTLK.new_full(
            (lengths_U.shape[0], width, *self.experts_BTLK.shape[2:]), -1
        )
        prompts_UTLK[rows_M, positions_M] = torch.stack(sink, dim=1).to(ROUTED_EXPERTS_DTYPE)
        self.experts_BTLK[:, :width] = prompts_UTLK[inverse_B]

    def record_step(self, sink: list[torch.Tensor], seqs_B: torch.Tensor, positions_B: torch.Tensor) -> None:
        """Record one decode step: cache row ``i`` fed sequence ``seqs_B[i]``'s token at ``positions_B[i]``."""
        self.experts_BTLK[seqs_B, positions_B] = torch.stack(sink, dim=1).to(ROUTED_EXPERTS_DTYPE)

    def output(self, lengths_B: torch.Tensor, width: int) -> torch.Tensor:
        """``[B, width, L, K]`` on the host for outputs ``width`` wide whose sequences are ``lengths_B`` long:
        -1 past each sequence's end (finished rows keep decoding until the cache is compacted)."""
        num_seqs, recorded = self.experts_BTLK.shape[:2]
        out = self.experts_BTLK.new_full((num_seqs, width, *self.experts_BTLK.shape[2:]), -1)
        out[:, : min(width, recorded)] = self.experts_BTLK[:, :width]
        past_end_BT = torch.arange(width, device=out.device)[None, :] >= lengths_B[:, None].to(out.device)
        out[past_end_BT] = -1
        return out.cpu()
