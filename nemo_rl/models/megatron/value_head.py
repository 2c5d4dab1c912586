"""PPO's value model on the Megatron backend: the ``GPTModel`` with a scalar head per token instead of its
LM output layer.

With ``policy.reward_model_cfg.enabled`` and ``reward_model_type: regression`` the last pipeline stage's
``output_layer`` is a :class:`ValueHead` (hidden -> 1, no bias), Hugging Face's ``score`` of
``*ForSequenceClassification`` with ``num_labels=1``, read at every token rather than at the last one. Its
output dim 1 cannot be split over tensor-parallel ranks, so every TP rank holds the whole head and computes
the same output: the hidden states entering it are replicated over TP (gathered first under sequence
parallelism, with a backward that only takes each rank's slice), so its gradient, and the one it sends back
into the model, is the full one on every TP rank, identical, with no reduction. Megatron counts the head once
in the gradient norm (a parameter without ``tensor_model_parallel`` counts on TP rank 0 only).

Weights: the head is ``score.weight`` of a sequence-classification checkpoint. A causal-LM checkpoint (the
policy's) has none; the head then starts as Hugging Face starts a missing one, ``normal(0,
initializer_range)`` drawn from a generator seeded with :data:`NEW_HEAD_SEED`, the seed the DTensor backend
loads with, so both backends start a critic from the same head. Exports are sequence-classification
checkpoints (:func:`export_config`).

Tensor legend: S = sequence (Megatron's first dim), B = sequences, T = tokens, H = hidden size.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.hf_decoder import SafetensorsReader

logger = logging.getLogger(__name__)

HF_NAME = "score.weight"
"""The head's Hugging Face name (``*ForSequenceClassification.score``)."""

MEGATRON_NAME = "output_layer.weight"
"""The head's name in the unwrapped ``GPTModel`` (it takes the LM output layer's place)."""

NEW_HEAD_SEED = 0
"""Seed of a head the checkpoint lacks: the DTensor backend's (``hf_io``), which draws the same head."""


def builds_value_head(policy: PolicyConfig) -> bool:
    """Whether ``policy`` is PPO's value model (``reward_model_cfg`` enabled with ``regression``)."""
    rm = policy.reward_model_cfg
    return rm.enabled and rm.reward_model_type == "regression"


class ValueHead(nn.Module):
    """hidden -> 1 at every position, replicated over tensor-parallel ranks (see the module docstring).

    Called as ``GPTModel`` calls its output layer: ``head(hidden_SBH, weight=None, runtime_gather_output=...)``
    returns ``(values_SB1, None)`` over the full sequence."""

    def __init__(self, config: TransformerConfig, tp_group: Any) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        self.weight = nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))

    def forward(
        self, hidden_SBH: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        """The head's output at every position of the full sequence."""
        del weight, runtime_gather_output  # no tied weight, nothing split to gather
        if self.sequence_parallel:
            # Every rank then computes the head on the whole sequence; backward keeps its own slice.
            hidden_SBH = gather_from_sequence_parallel_region(
                hidden_SBH, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return nn.functional.linear(hidden_SBH, self.weight), None


def attach(gpt: nn.Module, config: TransformerConfig, tp_group: Any) -> None:
    """Replace the last stage's LM output layer of ``gpt`` with a :class:`ValueHead` (weights loaded later)."""
    gpt.output_layer = ValueHead(config, tp_group)


def head_BT(output_BT1: torch.Tensor, input_lengths_B: torch.Tensor) -> torch.Tensor:
    """[B, T] float32: the head at every position (0 past each row's length), as the losses receive it."""
    values_BT = output_BT1[..., 0].float()
    positions_BT = torch.arange(values_BT.shape[1], device=values_BT.device)[None, :]
    return values_BT * (positions_BT < input_lengths_B.to(values_BT.device)[:, None])


def checkpoint_getter(
    reader: SafetensorsReader, hidden_size: int, initializer_range: float
) -> Callable[[str], torch.Tensor]:
    """``reader.get`` that also gives the head: the checkpoint's ``score.weight`` (one label), or a fresh one
    when it has none (a causal-LM checkpoint), drawn as the module docstring says."""
    if HF_NAME in reader:
        head = reader.get(HF_NAME)
        if tuple(head.shape) != (1, hidden_size):
            raise ValueError(
                f"{reader.folder} has a {tuple(head.shape)} score.weight, but a value model needs num_labels=1 "
                f"({(1, hidden_size)}): use a checkpoint with one label or its causal LM"
            )
    else:
        logger.warning("%s has no %s: the value head starts fresh (seeded)", reader.folder, HF_NAME)
        generator = torch.Generator().manual_seed(NEW_HEAD_SEED)
        head = torch.empty(1, hidden_size).normal_(0.0, initializer_range, generator=generator)

    def get(name: str) -> torch.Tensor:
        return head if name == HF_NAME else reader.get(name)

    return get


def export_config(hf_config: Any, architecture: str) -> Any:
    """A copy of ``hf_config`` (with one label and a pad token id, ``hf_io.load_hf_config``) that names the
    ``*ForSequenceClassification`` class of causal-LM class ``architecture``."""
    config = copy.deepcopy(hf_config)
    config.architectures = [architecture.replace("ForCausalLM", "ForSequenceClassification")]
    return config
