"""The token tensors a rollout carries from the generation engine to the training batch.

A rollout keeps every conversation as one right-padded row of token ids, with the sampler's log-probs and a
mask of the sampled tokens beside it (and, with routing replay, the experts the sampler's routers chose).
Each turn appends to the rows with tensor ops: the engine's output already holds the prompt followed by the
response, so a turn copies the response's span into the rows; an observation or a tool turn appends its
ids. The training batch (:mod:`nemo_rl.experience.train_batch`) is then these rows, trimmed and masked; the
message logs the environments read are kept beside them but never flattened again.

Legend: B = samples, T = tokens (padded), A = samples of one generation call, L = MoE layers,
K = experts per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from nemo_rl.data.interfaces import MessageLog
from nemo_rl.data.llm_message_utils import flat_token_positions, message_logs_to_batch
from nemo_rl.data.routed_experts import ROUTED_EXPERTS_KEY
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

SAMPLED_ROLES = ("assistant",)
"""The role of the messages a rollout sampled: the only tokens a loop trains on."""

TOKEN_KEYS = ("input_ids", "input_lengths", "token_mask", "generation_logprobs", ROUTED_EXPERTS_KEY)
"""The keys a rolled-out batch carries its token tensors under (``routed_experts`` only with routing
replay); they are the training batch's names for the same tensors."""


def _pad_width(tensor: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """``tensor`` right-padded along dim 1 to ``width`` with ``value`` (unchanged when wide enough)."""
    if tensor.shape[1] >= width:
        return tensor
    padded = tensor.new_full((tensor.shape[0], width, *tensor.shape[2:]), value)
    padded[:, : tensor.shape[1]] = tensor
    return padded


@dataclasses.dataclass
class RolloutTokens:
    """Every conversation of a rollout as token tensors; positions past a row's length hold padding
    (``pad_token_id``, 0, 0 and -1)."""

    ids_BT: torch.Tensor
    """Token ids, long."""

    lengths_B: torch.Tensor
    """Tokens of each conversation so far, long."""

    sampled_BT: torch.Tensor
    """1.0 on the tokens the sampler generated (the trained ones), 0.0 elsewhere; float32."""

    logprobs_BT: torch.Tensor
    """The sampler's log-prob of each sampled token, 0.0 elsewhere; float32."""

    pad_token_id: int
    """Fills the ids past each row's length."""

    routed_BTLK: torch.Tensor | None = None
    """The experts each MoE layer routed each token to (-1: no forward ran the token), from an engine that
    records routing; ``None`` until one returns it."""

    @classmethod
    def from_prompts(cls, logs: Sequence[MessageLog], pad_token_id: int) -> RolloutTokens:
        """The prompts' token ids, nothing sampled yet."""
        prompts = message_logs_to_batch(logs, pad_token_id=pad_token_id, train_roles=())
        ids_BT = prompts["input_ids"]
        zeros_BT = torch.zeros(ids_BT.shape, dtype=torch.float32)
        return cls(ids_BT, prompts["input_lengths"], zeros_BT, zeros_BT.clone(), pad_token_id)

    def generation_input(self, rows: Sequence[int]) -> BatchedDataDict[Any]:
        """``input_ids`` [A, T] and ``input_lengths`` [A] of ``rows``, as wide as the longest of them."""
        index_A = torch.tensor(rows, dtype=torch.long)
        lengths_A = self.lengths_B[index_A]
        width = int(lengths_A.max())
        return BatchedDataDict(input_ids=self.ids_BT[index_A, :width], input_lengths=lengths_A.clone())

    def _grow(self, width: int) -> None:
        """Widen every tensor to at least ``width`` tokens."""
        self.ids_BT = _pad_width(self.ids_BT, width, self.pad_token_id)
        self.sampled_BT = _pad_width(self.sampled_BT, width, 0.0)
        self.logprobs_BT = _pad_width(self.logprobs_BT, width, 0.0)
        if self.routed_BTLK is not None:
            self.routed_BTLK = _pad_width(self.routed_BTLK, width, -1)

    def append_generated(
        self, rows: Sequence[int], output: BatchedDataDict[Any], keep_A: torch.Tensor
    ) -> None:
        """Append the first ``keep_A`` generated tokens of each row of a generation ``output`` (whose input
        was :meth:`generation_input` of ``rows``), with their log-probs and, when the engine recorded it, the
        routing of the whole call (see :meth:`_merge_routing`)."""
        index_A = torch.tensor(rows, dtype=torch.long)
        start_A = self.lengths_B[index_A]
        end_A = start_A + keep_A
        width = int(end_A.max())
        self._grow(width)
        cols_T = torch.arange(width)
        new_AT = (cols_T >= start_A[:, None]) & (cols_T < end_A[:, None])
        self.ids_BT[index_A, :width] = torch.where(
            new_AT, output["output_ids"][:, :width], self.ids_BT[index_A, :width]
        )
        self.logprobs_BT[index_A, :width] = torch.where(
            new_AT, output["logprobs"][:, :width].float(), self.logprobs_BT[index_A, :width]
        )
        self.sampled_BT[index_A, :width] = torch.where(new_AT, 1.0, self.sampled_BT[index_A, :width])
        if ROUTED_EXPERTS_KEY in output:
            self._merge_routing(index_A, output[ROUTED_EXPERTS_KEY][:, :width], cols_T < end_A[:, None])
        self.lengths_B[index_A] = end_A

    def _merge_routing(
        self, index_A: torch.Tensor, call_ATLK: torch.Tensor, covered_AT: torch.Tensor
    ) -> None:
        """Record a generation call's routing of the ``covered_AT`` tokens (its prompt and the kept response).

        A token routed by an earlier call keeps that routing; the others (new prompt tokens, observations,
        the response itself, and a response's last token, which only the next call's prefill runs) take this
        call's."""
        if self.routed_BTLK is None:
            shape = (*self.ids_BT.shape, *call_ATLK.shape[2:])
            self.routed_BTLK = torch.full(shape, -1, dtype=call_ATLK.dtype)
        width = call_ATLK.shape[1]
        old_ATLK = self.routed_BTLK[index_A, :width]
        take_AT11 = covered_AT[:, :, None, None] & (old_ATLK[:, :, :1, :1] < 0)
        self.routed_BTLK[index_A, :width] = torch.where(take_AT11, call_ATLK, old_ATLK)

    def append(self, row: int, ids: torch.Tensor) -> None:
        """Append tokens the sampler did not generate (an observation, a tool turn) to ``row``."""
        start = int(self.lengths_B[row])
        end = start + int(ids.numel())
        self._grow(end)
        self.ids_BT[row, start:end] = ids
        self.lengths_B[row] = end

    def batch_fields(self) -> dict[str, torch.Tensor]:
        """The tensors under :data:`TOKEN_KEYS`, as wide as the longest conversation."""
        width = int(self.lengths_B.max())
        fields = {
            "input_ids": self.ids_BT[:, :width],
            "input_lengths": self.lengths_B,
            "token_mask": self.sampled_BT[:, :width],
            "generation_logprobs": self.logprobs_BT[:, :width],
        }
        if self.routed_BTLK is not None:
            fields[ROUTED_EXPERTS_KEY] = self.routed_BTLK[:, :width]
        return fields


def pack_message_logs(logs: Sequence[MessageLog], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The :data:`TOKEN_KEYS` tensors of conversations that arrive as message logs rather than from an
    engine's output (external agents' trajectories, recorded over HTTP turn by turn): ``assistant`` messages
    are the sampled ones and carry their ``generation_logprobs``."""
    batch = message_logs_to_batch(logs, pad_token_id=pad_token_id, train_roles=SAMPLED_ROLES)
    logprobs_BT = torch.zeros_like(batch["token_mask"])
    rows_N, cols_N = flat_token_positions(batch["input_lengths"].tolist())
    logprobs_BT[rows_N, cols_N] = torch.cat(
        [
            message["generation_logprobs"].to(logprobs_BT.dtype)  # type: ignore[typeddict-item]
            if message["role"] in SAMPLED_ROLES
            else logprobs_BT.new_zeros(int(message["token_ids"].numel()))
            for log in logs
            for message in log
        ]
    )
    return {
        "input_ids": batch["input_ids"],
        "input_lengths": batch["input_lengths"],
        "token_mask": batch["token_mask"],
        "generation_logprobs": logprobs_BT,
    }
