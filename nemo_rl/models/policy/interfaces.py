"""What every policy backend (DTensor, Megatron) offers the algorithms, through the driver-side ``Policy``.

Batch keys (contract with the data and loss code; tensors are right-padded, B = sequences, T = tokens):
``input_ids`` [B, T] long, ``input_lengths`` [B] long, ``token_mask`` [B, T] (1 = train on this token),
``sample_mask`` [B] float; GRPO adds ``advantages``, ``prev_logprobs``, ``generation_logprobs`` and
``reference_policy_logprobs`` [B, T]; DPO adds ``reference_policy_logprobs`` and reward-model training uses
the keys above alone (a pair's chosen and rejected rows are consecutive). Log-probs are aligned with the tokens:
``logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``, position 0 and padding are 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NotRequired, Protocol, TypedDict

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.loss_interface import LossFunction


class TrainResult(TypedDict):
    """What ``train`` returns: one entry per optimizer step (global batch) it took."""

    loss: torch.Tensor
    """[num_steps] float: each step's loss (summed micro-batch shares over all data-parallel ranks)."""

    grad_norm: NotRequired[torch.Tensor]
    """[num_steps] float: global gradient norm *before* clipping (absent in ``eval_mode``)."""

    lr: NotRequired[torch.Tensor]
    """[num_steps] float: learning rate the step used (absent in ``eval_mode``)."""

    global_valid_seqs: torch.Tensor
    """[num_steps] float: sequences with ``sample_mask`` set in each global batch."""

    global_valid_toks: torch.Tensor
    """[num_steps] float: trained tokens (``token_mask[:, 1:] * sample_mask``) in each global batch."""

    metrics: dict[str, list[float]]
    """The loss function's metrics per step: shares summed over micro-batches and ranks (``*_min`` /
    ``*_max`` metrics reduced with min / max instead)."""


@dataclass(frozen=True)
class LoraSummary:
    """The size of a policy's LoRA adapters (full counts, whatever the sharding), for the line printed at start."""

    rank: int
    """The adapters' rank (``lora_cfg.dim`` / ``peft.dim``)."""
    num_layers: int
    """Adapted (Hugging Face) linear layers."""
    num_trained: int
    """Parameters that train: the adapters'."""
    num_params: int
    """All parameters, the adapters included."""

    def describe(self, name: str) -> str:
        """One line about the adapters of the policy ``name``."""
        return (
            f"LoRA: rank-{self.rank} adapters on {self.num_layers} linear layers of {name}; "
            f"{self.num_trained:,} of {self.num_params:,} parameters train "
            f"({self.num_trained / self.num_params:.1%}), the base model is frozen"
        )


def nonfinite_step_flags(result: TrainResult) -> list[bool]:
    """Per optimizer step of ``result``: whether its loss or gradient norm was not finite (the workers then
    skipped its update and its scheduler step)."""
    losses = result["loss"].reshape(-1).tolist()
    grad_norms = result["grad_norm"].reshape(-1).tolist() if "grad_norm" in result else [0.0] * len(losses)
    return [
        not (math.isfinite(loss) and math.isfinite(grad_norm))
        for loss, grad_norm in zip(losses, grad_norms, strict=True)
    ]


class PolicyInterface(Protocol):
    """A trainable language-model policy spread over workers; every method is a collective over them."""

    def get_logprobs(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"logprobs": [B, T] float32}`` of ``data["input_ids"]`` under the current weights:
        ``log_softmax`` of the sampling distribution (``policy.generation`` temperature, top-k, top-p; see
        :func:`nemo_rl.models.sampling.sampling_logits`), the sampler's log-probs for the same weights (the
        contract in :mod:`nemo_rl.models.generation.interfaces`)."""
        ...

    def get_reference_policy_logprobs(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"reference_logprobs": [B, T] float32}`` under the frozen initial (reference) weights."""
        ...

    def get_topk_logits(self, data: BatchedDataDict[Any], k: int) -> BatchedDataDict[Any]:
        """``{"topk_logits": [B, T, k] float32, "topk_indices": [B, T, k] long}``.

        Position ``t`` holds the ``k`` largest next-token logits after reading ``input_ids[:, : t + 1]``
        (not shifted); padding positions are 0.
        """
        ...

    def score(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"scores": [B] float32}``: each sequence's reward, for a reward model
        (``policy.reward_model_cfg.enabled``: the model's scalar head read at the sequence's last token)."""
        ...

    def get_values(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """``{"values": [B, T] float32}``: a value model's (``reward_model_type: regression``) value of the
        state before each token, aligned as log-probs are (0 at position 0 and padding)."""
        ...

    def train(
        self,
        data: BatchedDataDict[Any],
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """One optimizer step per global batch of ``gbs`` sequences in ``data`` (``eval_mode``: loss only).

        ``gbs`` / ``mbs`` override ``policy.train_global_batch_size`` / ``train_micro_batch_size``.
        """
        ...

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Save the (sharded) weights, and the optimizer and scheduler state when ``optimizer_path`` is given."""
        ...

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Restore what :meth:`save_checkpoint` wrote, so training continues exactly where it stopped."""
        ...

    def export_hf(self, path: str) -> None:
        """Write a Hugging Face checkpoint (safetensors, config, tokenizer) that ``from_pretrained`` loads."""
        ...

    def prepare_for_training(self) -> None:
        """Bring weights and optimizer state onto the devices and switch to training mode."""
        ...

    def prepare_for_lp_inference(self) -> None:
        """Bring weights onto the devices for log-prob inference; the optimizer state may be offloaded."""
        ...

    def offload_before_refit(self) -> None:
        """Free device memory the refit does not need (optimizer state) before weights are sent."""
        ...

    def offload_after_refit(self) -> None:
        """Move weights off the devices after a refit so colocated generation can use the memory."""
        ...

    def shutdown(self) -> None:
        """Stop the workers and release their resources."""
        ...
