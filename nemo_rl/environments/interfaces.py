"""The contract between rollouts and environments.

An environment scores a batch of conversations and, for multi-turn tasks, answers them. Rollouts call it
as a Ray actor (``env.call("step", message_logs, metadata)``, see :mod:`nemo_rl.environments.healing`), so
an implementation is a plain class deriving :class:`EnvironmentInterface` that
:func:`nemo_rl.environments.registry.create_env` starts as an actor (or a class already wrapped with
``ray.remote``).

All state of an episode lives in its ``metadata`` (what the dataset put in ``extra_env_info``, updated by
each step), so one environment actor serves any number of episodes and can be restarted freely: an actor
that dies or hangs is replaced and its call sent again. State an environment keeps in its actor between
calls (a random generator, a cache) starts afresh in the replacement.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict

MetadataT = TypeVar("MetadataT")

Message = Mapping[str, Any]
"""One turn: at least ``role`` and ``content`` (rollouts also pass ``token_ids`` and log-probs)."""


class EnvironmentReturn(NamedTuple, Generic[MetadataT]):
    """What one :meth:`EnvironmentInterface.step` returns; every field has one entry per conversation."""

    observations: list[dict[str, str]]
    """The environment's reply, ``{"role": ..., "content": ...}``; rollouts append it as the next user turn
    of conversations that are not terminated."""

    metadata: list[MetadataT]
    """Updated episode state, handed back to the next step of the same conversation."""

    next_stop_strings: list[list[str] | None]
    """Stop strings for the conversation's next generation (``None``: the default ones)."""

    rewards: torch.Tensor
    """[B] float: reward earned this turn (rollouts sum them over turns)."""

    terminateds: torch.Tensor
    """[B] bool: the episode is over."""

    answers: list[str | None] | None = None
    """Optional answer extracted from each response (for consistency metrics such as cons@k)."""


class EnvironmentInterface(abc.ABC, Generic[MetadataT]):
    """An environment: scores responses and (for multi-turn tasks) replies to them."""

    @abc.abstractmethod
    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[MetadataT]
    ) -> EnvironmentReturn[MetadataT]:
        """Score the last assistant turn of each conversation and say what happens next.

        Args:
            message_log_batch: One conversation per sample, OpenAI-style messages ending with the
                assistant's latest response, e.g. ``[{"role": "user", ...}, {"role": "assistant", ...}]``.
            metadata: One episode state per conversation (for math: ``{"ground_truth": "42"}``).
        """

    @abc.abstractmethod
    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """After all rollouts of a step: post-process the finished batch and return this task's metrics."""

    def shutdown(self) -> None:
        """Release processes or connections the environment holds; called before the actor is killed."""


def check_step_batch(message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[Any]) -> None:
    """Raise ``ValueError`` unless :meth:`EnvironmentInterface.step` got one metadata entry per conversation."""
    if len(message_log_batch) != len(metadata):
        raise ValueError(f"{len(message_log_batch)} conversations but {len(metadata)} metadata entries")


def check_ground_truths(metadata: Sequence[Mapping[str, Any] | None], task: str, hint: str) -> None:
    """Raise ``KeyError`` naming the first samples of ``task`` whose metadata has no ``ground_truth``;
    ``hint`` says where the data should have put it."""
    missing = [i for i, m in enumerate(metadata) if m is None or "ground_truth" not in m]
    if missing:
        raise KeyError(
            f"{task} samples {missing[:8]} have no 'ground_truth' in their metadata (extra_env_info); {hint}"
        )
