"""The training batch of a rollout: the token tensors it carries (:mod:`nemo_rl.experience.rollout_tokens`),
trimmed to the longest conversation, re-padded, and given the loss's per-sample and per-token inputs.

The rows of a rolled-out batch may have been selected (dynamic sampling drops groups) or concatenated with
rows of other rollouts (padded with other values), so the builder trims to the longest row left and writes
the padding again from ``input_lengths``: the batch is the same whichever way its rows were gathered.

Legend: B = samples, T = tokens (padded), L = MoE layers, K = experts per token.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_rl.data.collate_fn import IMAGE_KEYS
from nemo_rl.data.routed_experts import ROUTED_EXPERTS_KEY
from nemo_rl.distributed.batched_data_dict import BatchedDataDict


def _valid_mask(rollout: BatchedDataDict[Any]) -> torch.Tensor:
    """[B, T] bool: the positions within each row's length, T the longest row."""
    lengths_B = rollout["input_lengths"]
    return torch.arange(int(lengths_B.max()))[None, :] < lengths_B[:, None]


def train_batch(
    rollout: BatchedDataDict[Any], pad_token_id: int, *, overlong_filtering: bool
) -> BatchedDataDict[Any]:
    """The batch every RL loop trains on: ``input_ids`` [B, T] (right-padded with ``pad_token_id``),
    ``input_lengths`` [B], ``token_mask`` [B, T] (1.0 on the sampled tokens) and ``sample_mask`` [B] (the
    prompt's ``loss_multiplier``: 0 for prompts cut to fit; with ``overlong_filtering`` also 0 for truncated
    responses); for multimodal prompts each row's ``pixel_values`` and ``image_grid_thw`` (lists)."""
    valid_BT = _valid_mask(rollout)
    width = valid_BT.shape[1]
    sample_mask_B = rollout["loss_multiplier"].float().clone()
    if overlong_filtering:
        sample_mask_B *= (~rollout["truncated"]).float()
    batch = BatchedDataDict[Any](
        input_ids=torch.where(valid_BT, rollout["input_ids"][:, :width], pad_token_id),
        input_lengths=rollout["input_lengths"].clone(),
        token_mask=torch.where(valid_BT, rollout["token_mask"][:, :width], 0.0),
        sample_mask=sample_mask_B,
    )
    _carry_images(rollout, batch)
    return batch


def _carry_images(rollout: BatchedDataDict[Any], batch: BatchedDataDict[Any]) -> None:
    """A multimodal rollout's per-row images, which the policy's forward reads with the rows' tokens (the
    response follows the prompt's image placeholders, so the prompt's images are the whole row's)."""
    for key in IMAGE_KEYS:
        if key in rollout:
            batch[key] = list(rollout[key])


def build_train_batch(
    rollout: BatchedDataDict[Any],
    advantages_B: torch.Tensor | None,
    pad_token_id: int,
    overlong_filtering: bool,
) -> BatchedDataDict[Any]:
    """The policy-gradient training batch: :func:`train_batch` plus ``advantages`` [B, T] (each sample's
    advantage on every token; left out when ``advantages_B`` is ``None``, for PPO, whose per-token advantages
    need the critic's values of this very batch), the sampler's ``generation_logprobs`` [B, T] (0 off the
    sampled tokens) and, with routing replay, its ``routed_experts`` [B, T, L, K] (-1 at padding and where no
    forward ran a token)."""
    batch = train_batch(rollout, pad_token_id, overlong_filtering=overlong_filtering)
    valid_BT = _valid_mask(rollout)
    width = valid_BT.shape[1]
    result = BatchedDataDict[Any](
        input_ids=batch["input_ids"],
        input_lengths=batch["input_lengths"],
        token_mask=batch["token_mask"],
        generation_logprobs=torch.where(valid_BT, rollout["generation_logprobs"][:, :width], 0.0),
        sample_mask=batch["sample_mask"],
    )
    _carry_images(rollout, result)
    if advantages_B is not None:
        result["advantages"] = advantages_B[:, None].expand_as(batch["token_mask"]).contiguous()
    if ROUTED_EXPERTS_KEY in rollout:
        valid_BT11 = valid_BT[:, :, None, None]
        result[ROUTED_EXPERTS_KEY] = torch.where(valid_BT11, rollout[ROUTED_EXPERTS_KEY][:, :width], -1)
    return result
