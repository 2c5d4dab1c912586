"""Carrying a sampler's MoE routing (routing replay) from generation outputs through message logs into the
training batch.

Each message of a rolled-out log gets ``routed_experts`` ``[n_tokens, L, K]`` (L = MoE layers, K = experts
per token): the experts the sampler's routers chose for its tokens, -1 where none ran the token. A
generation call covers the whole conversation so far (its prompt is the flattened log): the messages new to
the call (the prompt, an observation) take their routing from its prefill, the response from its decode
steps; a message recorded by an earlier call keeps its routing, only its unrecorded tokens (a response's last
token, run first by the next turn's prefill) are filled in. :func:`routed_experts_batch` lays the messages'
routing out as the flattened batch lays out their tokens.

Tensor legend: B = sequences, T = tokens, L = MoE layers, K = experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from nemo_rl.data.interfaces import LLMMessage, MessageLog
from nemo_rl.data.llm_message_utils import flat_token_positions, message_log_length

ROUTED_EXPERTS_KEY = "routed_experts"
"""The key of the routing in generation outputs, messages and the training batch (NeMo RL's name)."""


def attach_routed_experts(log: MessageLog, routed_TLK: torch.Tensor) -> None:
    """Give every message of ``log`` its tokens' routing from ``routed_TLK``, one generation output row
    aligned with the flattened log (see the module docstring) and at least as long. The messages are replaced
    by copies, never changed in place."""
    start = 0
    for index, message in enumerate(log):
        num_tokens = int(message["token_ids"].numel())
        new_TLK = routed_TLK[start : start + num_tokens]
        start += num_tokens
        old_TLK = cast("torch.Tensor | None", message.get(ROUTED_EXPERTS_KEY))
        if old_TLK is not None:
            new_TLK = torch.where(old_TLK[:, :1, :1] < 0, new_TLK, old_TLK)
        # A new message object: the prompt's messages are shared with the input batch (and its repeats).
        log[index] = cast(LLMMessage, {**message, ROUTED_EXPERTS_KEY: new_TLK.clone()})


def routed_experts_batch(logs: Sequence[MessageLog], width: int) -> torch.Tensor | None:
    """``[B, width, L, K]`` routing of the flattened logs (-1 at padding and at messages without any), or None
    when no message carries routing."""
    messages = [message for log in logs for message in log]
    first = next((m[ROUTED_EXPERTS_KEY] for m in messages if ROUTED_EXPERTS_KEY in m), None)  # type: ignore[literal-required]
    if first is None:
        return None
    shape_LK = tuple(first.shape[1:])
    routed_BTLK = first.new_full((len(logs), width, *shape_LK), -1)
    rows_N, cols_N = flat_token_positions([message_log_length(log) for log in logs])
    routed_BTLK[rows_N, cols_N] = torch.cat(
        [
            m[ROUTED_EXPERTS_KEY]  # type: ignore[literal-required]
            if ROUTED_EXPERTS_KEY in m
            else first.new_full((int(m["token_ids"].numel()), *shape_LK), -1)
            for m in messages
        ]
    )
    return routed_BTLK
