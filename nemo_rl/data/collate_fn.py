"""Collate functions: a list of :class:`DatumSpec` samples -> one :class:`BatchedDataDict`.

Legend: B = samples in the batch, T = padded sequence length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.data.interfaces import DatumSpec
from nemo_rl.data.llm_message_utils import message_logs_to_batch, truncate_message_log
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.tokenizer import require_pad_token_id

SFT_TRAIN_ROLES = ("assistant",)
"""Roles whose tokens SFT puts loss on."""


def rl_collate_fn(batch: Sequence[DatumSpec]) -> BatchedDataDict[Any]:
    """Batch RL prompts, keeping their message logs (generation and environments extend them).

    Keys: ``message_log``, ``extra_env_info``, ``task_name`` (lists), ``idx`` [B] long, ``length`` [B] long,
    ``loss_multiplier`` [B] float; ``stop_strings`` (a list, ``None`` where a sample has none) when any
    sample carries them; for multimodal prompts ``pixel_values`` and ``image_grid_thw`` (lists, see
    :func:`add_image_inputs`), which the rollout hands to generation and the training batch to the policy.
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    collated: BatchedDataDict[Any] = BatchedDataDict(
        message_log=[d["message_log"] for d in batch],
        extra_env_info=[d["extra_env_info"] for d in batch],
        task_name=[d["task_name"] for d in batch],
        idx=torch.tensor([d["idx"] for d in batch], dtype=torch.long),
        length=torch.tensor([d["length"] for d in batch], dtype=torch.long),
        loss_multiplier=torch.tensor([d["loss_multiplier"] for d in batch], dtype=torch.float32),
    )
    if any(d.get("stop_strings") for d in batch):
        collated["stop_strings"] = [d.get("stop_strings") for d in batch]
    add_image_inputs(collated, batch)
    return collated


def sft_collate_fn(
    batch: Sequence[DatumSpec], *, pad_token_id: int, max_seq_length: int
) -> BatchedDataDict[Any]:
    """Batch SFT conversations into training tensors, truncating each to ``max_seq_length`` tokens.

    Keys: ``input_ids`` [B, T] long (right-padded with ``pad_token_id``), ``input_lengths`` [B] long,
    ``token_mask`` [B, T] float (1 on assistant tokens), ``sample_mask`` [B] float (the sample's
    ``loss_multiplier``, or 0 when truncation left it no assistant token), ``idx`` [B] long; for multimodal
    samples ``pixel_values`` and ``image_grid_thw`` (lists, see :func:`add_image_inputs`).
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    message_logs = [truncate_message_log(d["message_log"], max_seq_length) for d in batch]
    data = message_logs_to_batch(message_logs, pad_token_id=pad_token_id, train_roles=SFT_TRAIN_ROLES)
    has_target_B = (data["token_mask"].sum(dim=1) > 0).to(torch.float32)
    data["sample_mask"] = (
        torch.tensor([d["loss_multiplier"] for d in batch], dtype=torch.float32) * has_target_B
    )
    data["idx"] = torch.tensor([d["idx"] for d in batch], dtype=torch.long)
    add_image_inputs(data, batch)
    return data


IMAGE_KEYS = ("pixel_values", "image_grid_thw")
"""Per-sample image tensors of multimodal samples, kept per row in batches (see ``nemo_rl.data.vlm``)."""


def add_image_inputs(data: BatchedDataDict[Any], batch: Sequence[DatumSpec]) -> None:
    """Carry the samples' image tensors as lists with one entry per row (``None`` for a row without images),
    when any sample has images: rows of different image sizes cannot be stacked, and a list keeps each row's
    images with it through sharding and micro-batching."""
    if not any("pixel_values" in d for d in batch):
        return
    for key in IMAGE_KEYS:
        data[key] = [d.get(key) for d in batch]


def repeat_prompts(batch: BatchedDataDict[Any], num_repeats: int) -> BatchedDataDict[Any]:
    """Every prompt of ``batch`` repeated ``num_repeats`` times in a row (a GRPO group, an evaluation's samples):
    message logs copied, so each repeat is extended on its own, but a prompt's image tensors shared by its
    repeats, which only read them (and Ray's pickling then sends them once per call, not once per repeat)."""
    repeated = batch.repeat_interleave(num_repeats)
    for key in IMAGE_KEYS:
        if key in batch:
            repeated[key] = [value for value in batch[key] for _ in range(num_repeats)]
    return repeated


def _bound(
    collate: Callable[..., BatchedDataDict[Any]], tokenizer: PreTrainedTokenizerBase, max_seq_length: int
) -> Callable[[Sequence[DatumSpec]], BatchedDataDict[Any]]:
    return functools.partial(
        collate, pad_token_id=require_pad_token_id(tokenizer), max_seq_length=max_seq_length
    )


def make_sft_collate_fn(
    tokenizer: PreTrainedTokenizerBase, max_seq_length: int
) -> Callable[[Sequence[DatumSpec]], BatchedDataDict[Any]]:
    """:func:`sft_collate_fn` bound to the tokenizer's pad token and a length limit, for a dataloader."""
    return _bound(sft_collate_fn, tokenizer, max_seq_length)


def preference_collate_fn(
    batch: Sequence[DatumSpec], *, pad_token_id: int, max_seq_length: int
) -> BatchedDataDict[Any]:
    """Batch preference pairs as interleaved rows: row ``2i`` is pair ``i`` with the chosen response, row
    ``2i + 1`` with the rejected one (the layout of :class:`nemo_rl.algorithms.loss_functions.DPOLossFn`).

    Keys as in :func:`sft_collate_fn` over the ``2 * len(batch)`` rows; ``idx`` repeats each pair's index.
    A pair one of whose halves has no assistant token left after truncation, or whose two conversations are
    the same tokens (a tie, which says nothing about which is better), gets ``sample_mask`` 0 on both rows,
    so pairs stay whole.
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    message_logs = []
    for datum in batch:
        if "rejected_message_log" not in datum:
            raise ValueError(
                f"sample {datum['idx']} has no rejected response: build the dataset with preference_processor"
            )
        message_logs.append(truncate_message_log(datum["message_log"], max_seq_length))
        message_logs.append(truncate_message_log(datum["rejected_message_log"], max_seq_length))
    data = message_logs_to_batch(message_logs, pad_token_id=pad_token_id, train_roles=SFT_TRAIN_ROLES)
    has_target_P = (data["token_mask"].sum(dim=1) > 0).reshape(-1, 2).all(dim=1).to(torch.float32)
    ids_P2T = data["input_ids"].reshape(len(batch), 2, -1)
    lengths_P2 = data["input_lengths"].reshape(len(batch), 2)
    same_P = (ids_P2T[:, 0] == ids_P2T[:, 1]).all(dim=1) & (lengths_P2[:, 0] == lengths_P2[:, 1])
    differs_P = (~same_P).to(torch.float32)
    loss_multiplier_P = torch.tensor([d["loss_multiplier"] for d in batch], dtype=torch.float32)
    data["sample_mask"] = (loss_multiplier_P * has_target_P * differs_P).repeat_interleave(2)
    data["idx"] = torch.tensor([d["idx"] for d in batch], dtype=torch.long).repeat_interleave(2)
    return data


def make_preference_collate_fn(
    tokenizer: PreTrainedTokenizerBase, max_seq_length: int
) -> Callable[[Sequence[DatumSpec]], BatchedDataDict[Any]]:
    """:func:`preference_collate_fn` bound to the tokenizer's pad token and a length limit."""
    return _bound(preference_collate_fn, tokenizer, max_seq_length)
