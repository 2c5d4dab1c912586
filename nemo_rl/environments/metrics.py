"""Metrics over a finished rollout batch that several environments share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict


def batch_rewards(batch: BatchedDataDict[Any]) -> torch.Tensor:
    """The batch's per-sample rewards: ``total_reward`` (rollouts) or ``rewards``, as a float [B] tensor."""
    for key in ("total_reward", "rewards"):
        if key in batch:
            return torch.as_tensor(batch[key]).float().reshape(-1)
    raise KeyError(f"the rollout batch has no 'total_reward' or 'rewards' key; it has {sorted(batch.keys())}")


def prompt_key(message_log: Sequence[Mapping[str, Any]]) -> str:
    """The conversation before the first assistant turn: identical for the responses to one prompt."""
    parts = []
    for message in message_log:
        if message["role"] == "assistant":
            break
        parts.append(f"{message['role']}\x00{message['content']}")
    return "\x01".join(parts)


def group_ids(batch: BatchedDataDict[Any]) -> list[Any]:
    """Which prompt each sample answers: the dataset ``idx`` when present, else the prompt's text."""
    if "idx" in batch:
        return [int(i) for i in torch.as_tensor(batch["idx"]).reshape(-1).tolist()]
    if "message_log" in batch:
        return [prompt_key(log) for log in batch["message_log"]]
    raise KeyError("grouping samples by prompt needs an 'idx' or a 'message_log' key in the batch")


def pass_at_samples(rewards_B: torch.Tensor, groups: Sequence[Any], *, threshold: float) -> float:
    """Fraction of prompts with at least one sample whose reward reaches ``threshold`` (pass@k, k = group size)."""
    best: dict[Any, float] = {}
    for group, reward in zip(groups, rewards_B.tolist(), strict=True):
        best[group] = max(best.get(group, float("-inf")), reward)
    if not best:
        return 0.0
    return sum(r >= threshold for r in best.values()) / len(best)


def assistant_text(message_log: Sequence[Mapping[str, Any]]) -> str:
    """All assistant turns of a conversation, concatenated."""
    return "".join(str(m["content"]) for m in message_log if m["role"] == "assistant")


def last_assistant_text(message_log: Sequence[Mapping[str, Any]]) -> str:
    """The content of the conversation's last assistant turn ('' when there is none)."""
    for message in reversed(message_log):
        if message["role"] == "assistant":
            return str(message["content"])
    return ""
