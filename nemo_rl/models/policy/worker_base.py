"""What every policy worker backend shares: the constructor, the scoring methods and the training step loop.

A backend (``DTensorPolicyWorker``, ``MegatronPolicyWorker``) subclasses :class:`PolicyWorkerBase` and
keeps only building its model and stepping it, through these hooks:

- :meth:`~PolicyWorkerBase._build`: join the process groups, build the model, optimizer and scheduler, and
  snapshot the reference weights (the constructor then resumes from a checkpoint when given one);
- :meth:`~PolicyWorkerBase._score`: the forward pass over a batch in inference mode, calling a function on
  each micro-batch's logits (or a reward model's rewards) and merging its per-row outputs;
- :meth:`~PolicyWorkerBase._reference_weights`: a context in which the model holds the initial weights;
- :meth:`~PolicyWorkerBase._forward_backward`: one global step's forward passes, and backward passes when
  training, over its micro-batches; returns the step's loss and the loss function's metrics per micro-batch;
- :meth:`~PolicyWorkerBase._optimizer_step`: clip, step the optimizer and the scheduler (skipped for a
  non-finite gradient norm), recording the update in the step log.

and implements the public methods the driver's ``Policy`` calls on every backend alike, with the same
signatures (abstract here): checkpoints and export, the memory moves around training and refits, the refit
sender (:meth:`~PolicyWorkerBase.iter_hf_weights`, :meth:`~PolicyWorkerBase.weights_manifest`,
:meth:`~PolicyWorkerBase.refit_stream`, :meth:`~PolicyWorkerBase.refit_send`,
:meth:`~PolicyWorkerBase.adapter_refits`) and what the driver asks about the model
(:meth:`~PolicyWorkerBase.lora_summary`, :meth:`~PolicyWorkerBase.trains_with_dropout`).

Every public method is a collective: all ranks of the policy call it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.interfaces import LoraSummary, TrainResult
from nemo_rl.models.policy.loss_interface import LossFunction
from nemo_rl.models.policy.utils import token_logprobs, topk_logits
from nemo_rl.models.policy.worker_batches import StepBatch, TrainLog, micro_batches, step_batches
from nemo_rl.weight_sync.interfaces import TransferStats, WeightSender
from nemo_rl.weight_sync.scope import RefitScope

ScoreFn = Callable[[torch.Tensor, BatchedDataDict[Any]], dict[str, torch.Tensor]]
"""Maps a micro-batch's model output (logits [B, T, V], a reward model's rewards [B], or a value model's head
output [B, T]) and the micro-batch to per-row outputs."""


def token_values(head_BT: torch.Tensor, input_lengths_B: torch.Tensor) -> torch.Tensor:
    """A value model's values aligned with the tokens, like log-probs: position ``t`` holds the head's output
    after reading ``input_ids[:, :t]`` (the value of the state in which token ``t`` was chosen), 0 at position
    0 and at padding. ``head_BT`` is the head's output at every position (not shifted)."""
    values_BT = torch.zeros_like(head_BT, dtype=torch.float32)
    values_BT[:, 1:] = head_BT[:, :-1].float()
    positions_BT = torch.arange(head_BT.shape[1], device=head_BT.device)[None, :]
    return values_BT * (positions_BT < input_lengths_B.to(head_BT.device)[:, None])


class PolicyWorkerBase(abc.ABC):
    """The scoring methods and the training step loop of a policy worker; see the module docstring."""

    cfg: PolicyConfig
    tokenizer_source: str
    """The tokenizer saved next to exported checkpoints."""
    model: Any
    """The backend's trainable model (``train(mode)`` switches dropout and the like)."""
    dp_size: int
    dp_group: Any
    """The data-parallel process group."""
    seq_multiple: int
    """Sequence lengths are padded to a multiple of this."""
    device: torch.device

    def __init__(
        self,
        cfg: PolicyConfig,
        tokenizer_path: str | None = None,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_reference_model: bool = True,
    ) -> None:
        """Join the process groups and build the model, optimizer and scheduler (the backend's :meth:`_build`),
        then resume from a checkpoint when given.

        ``tokenizer_path`` is the tokenizer written next to exported checkpoints (default: the tokenizer
        ``cfg`` names). ``weights_path`` / ``optimizer_path`` resume from :meth:`save_checkpoint` output; the
        reference policy is always the initial ``cfg.model_name`` weights.
        """
        if optimizer_path is not None and weights_path is None:
            raise ValueError(
                "optimizer_path was given without weights_path: resume needs both from one checkpoint"
            )
        self.cfg = cfg
        self.tokenizer_source = tokenizer_path if tokenizer_path is not None else cfg.tokenizer_name
        self._build(init_reference_model)
        if weights_path is not None:
            self.load_checkpoint(weights_path, optimizer_path)

    # ------------------------------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _build(self, init_reference_model: bool) -> None:
        """Join the process groups, build the model, optimizer and scheduler, and keep a host copy of the
        initial weights as the reference policy when ``init_reference_model`` (backend hook)."""

    @abc.abstractmethod
    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load what ``save_checkpoint`` wrote: weights, and with ``optimizer_path`` the optimizer, scheduler
        and RNG state (backend hook)."""

    @abc.abstractmethod
    def _score(
        self, data: BatchedDataDict[Any], fn: ScoreFn, micro_batch_size: int | None
    ) -> BatchedDataDict[Any]:
        """Run ``fn`` over ``data``'s micro-batches in inference mode and merge its outputs (backend hook)."""

    @abc.abstractmethod
    def _reference_weights(self) -> AbstractContextManager[None]:
        """A context in which the model holds the reference (initial) weights (backend hook)."""

    @abc.abstractmethod
    def _forward_backward(
        self, step: StepBatch, loss_fn: LossFunction, eval_mode: bool
    ) -> tuple[float, list[dict[str, Any]]]:
        """One global step's forward (and, unless ``eval_mode``, backward) passes; returns the summed loss of
        its micro-batches and the loss function's metrics of each (backend hook)."""

    @abc.abstractmethod
    def _optimizer_step(self, log: TrainLog) -> None:
        """Apply the accumulated gradients and record the update in ``log`` (backend hook)."""

    def _after_eval_step(self) -> None:  # noqa: B027 (an optional hook: most backends do nothing)
        """What a backend does after a step computed without gradients (nothing unless it says so)."""

    def _micro_batch_options(self) -> dict[str, Any]:
        """Backend options of :func:`micro_batches` (sequence packing, shared prefixes); none by default."""
        return {}

    def _micro_batches(
        self, batch: BatchedDataDict[Any], micro_batch_size: int, max_tokens: int
    ) -> Iterator[tuple[list[int], BatchedDataDict[Any]]]:
        """``(row indices, micro-batch on the device)`` pairs covering ``batch`` (see ``worker_batches``)."""
        return micro_batches(
            batch,
            micro_batch_size=micro_batch_size,
            max_tokens=max_tokens,
            dynamic=self.cfg.dynamic_batching,
            seq_multiple=self.seq_multiple,
            device=self.device,
            dp_group=self.dp_group,
            **self._micro_batch_options(),
        )

    # ---------------------------------------------------------------------------------------- scoring
    @property
    def is_reward_model(self) -> bool:
        """Whether the model has a scalar head (``reward_model_cfg.enabled``): a reward model, or with
        ``reward_model_type: regression`` a value model."""
        return self.cfg.reward_model_cfg.enabled

    @property
    def is_value_model(self) -> bool:
        """Whether the model is PPO's value model: a scalar head read at every token
        (``reward_model_cfg.reward_model_type: regression``)."""
        return self.is_reward_model and self.cfg.reward_model_cfg.reward_model_type == "regression"

    def _require_language_model(self, method: str) -> None:
        if self.is_reward_model:
            raise ValueError(
                f"{method} needs next-token logits, but this model has a scalar head "
                "(reward_model_cfg.enabled=true); use score() for a reward model, get_values() for a value model"
            )

    def get_logprobs(
        self, data: BatchedDataDict[Any], micro_batch_size: int | None = None
    ) -> BatchedDataDict[Any]:
        """``{"logprobs": [B, T]}`` of ``data["input_ids"]`` (aligned with the tokens, 0 at position 0 / padding)."""
        self._require_language_model("get_logprobs")
        return self._score(
            data,
            lambda logits, mb: {"logprobs": token_logprobs(logits, mb["input_ids"], mb["input_lengths"])},
            micro_batch_size,
        )

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict[Any], micro_batch_size: int | None = None
    ) -> BatchedDataDict[Any]:
        """``{"reference_logprobs": [B, T]}`` under the initial weights."""
        with self._reference_weights():
            out = self.get_logprobs(data, micro_batch_size)
        return BatchedDataDict({"reference_logprobs": out["logprobs"]})

    def get_topk_logits(
        self, data: BatchedDataDict[Any], k: int, micro_batch_size: int | None = None
    ) -> BatchedDataDict[Any]:
        """``{"topk_logits", "topk_indices"}``, each [B, T, K]; see ``PolicyInterface.get_topk_logits``."""
        self._require_language_model("get_topk_logits")

        def fn(logits: torch.Tensor, mb: BatchedDataDict[Any]) -> dict[str, torch.Tensor]:
            values, indices = topk_logits(logits, mb["input_lengths"], k)
            return {"topk_logits": values, "topk_indices": indices}

        return self._score(data, fn, micro_batch_size)

    def score(self, data: BatchedDataDict[Any], micro_batch_size: int | None = None) -> BatchedDataDict[Any]:
        """``{"scores": [B]}``: a reward model's reward of each sequence of ``data``."""
        if not self.is_reward_model or self.is_value_model:
            raise ValueError(
                "score() needs a reward model: set policy.reward_model_cfg.enabled=true with "
                "reward_model_type=bradley_terry (use get_logprobs() for a language model, get_values() for a "
                "value model)"
            )
        return self._score(data, lambda rewards_B, mb: {"scores": rewards_B}, micro_batch_size)

    def get_values(
        self, data: BatchedDataDict[Any], micro_batch_size: int | None = None
    ) -> BatchedDataDict[Any]:
        """``{"values": [B, T] float32}``: a value model's values, aligned with the tokens as log-probs are
        (see :func:`token_values`)."""
        if not self.is_value_model:
            raise ValueError(
                "get_values() needs a value model: reward_model_cfg.enabled=true and "
                "reward_model_cfg.reward_model_type=regression (the value section of a PPO config)"
            )
        return self._score(
            data,
            lambda head_BT, mb: {"values": token_values(head_BT, mb["input_lengths"])},
            micro_batch_size,
        )

    # --------------------------------------------------------------------------------------- training
    def train(
        self,
        data: BatchedDataDict[Any],
        loss_fn: LossFunction,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> TrainResult:
        """Take one optimizer step per global batch in this rank's shard ``data``.

        ``data`` holds ``gbs // dp`` rows per step, in step order (``shard_by_batch_size(dp, batch_size=gbs)``
        on the driver). ``eval_mode`` computes the loss without gradients or updates.
        """
        self.model.train(not eval_mode)
        log = TrainLog()
        for step in step_batches(
            data,
            self.cfg,
            gbs=gbs,
            mbs=mbs,
            rows_per_group=loss_fn.rows_per_group,
            dp_size=self.dp_size,
            seq_multiple=self.seq_multiple,
            device=self.device,
            dp_group=self.dp_group,
        ):
            step_loss, mb_metrics = self._forward_backward(step, loss_fn, eval_mode)
            if eval_mode:
                self._after_eval_step()
            else:
                self._optimizer_step(log)
            log.end_step(step, step_loss, mb_metrics, self.dp_group, self.device)
        return log.result(eval_mode)

    # ------------------------------------------------------------------ checkpoints, memory, shutdown
    @abc.abstractmethod
    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Save the weights (and with ``optimizer_path`` the optimizer, scheduler and RNG state)."""

    @abc.abstractmethod
    def export_hf(self, path: str) -> None:
        """Write a Hugging Face checkpoint of the current weights (with LoRA: merged, plus a PEFT folder)."""

    @abc.abstractmethod
    def prepare_for_training(self) -> None:
        """Weights and optimizer state onto the device; training mode."""

    @abc.abstractmethod
    def prepare_for_lp_inference(self) -> None:
        """Weights onto the device, optimizer state to the host; inference mode."""

    @abc.abstractmethod
    def offload_before_refit(self) -> None:
        """Optimizer state to the host, so the refit's gathers fit on the device."""

    @abc.abstractmethod
    def offload_after_refit(self) -> None:
        """Weights and optimizer state to the host, leaving the device to generation."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the model, the optimizer and the process groups."""

    # ------------------------------------------------------------------------------- refit (sender)
    @abc.abstractmethod
    def iter_hf_weights(
        self, dtype: torch.dtype, scope: RefitScope = "full"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights of refit ``scope`` this rank's stream sends, under their Hugging Face names, as FULL
        tensors cast to ``dtype`` (floating point only). A collective over the ranks that gather them."""

    @abc.abstractmethod
    def weights_manifest(
        self, dtype: torch.dtype, scope: RefitScope = "full"
    ) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (full shape, dtype name)}`` of what a refit of ``scope`` sends, all streams together;
        no communication."""

    @abc.abstractmethod
    def refit_stream(self) -> int:
        """The refit stream this rank sends (see :mod:`nemo_rl.weight_sync.interfaces`)."""

    @abc.abstractmethod
    def refit_send(self, sender: WeightSender, scope: RefitScope = "full") -> TransferStats:
        """Stream this rank's weights of refit ``scope`` through ``sender`` (every rank calls it)."""

    @abc.abstractmethod
    def adapter_refits(self) -> bool:
        """Whether a refit may move the LoRA adapters alone (scope ``"adapters"``): the policy trains adapters
        on a frozen base and sends them unmerged."""

    # ------------------------------------------------------------------------ what the driver asks
    @abc.abstractmethod
    def lora_summary(self) -> LoraSummary | None:
        """The LoRA adapters' size, for the line the driver prints at start; ``None`` without LoRA."""

    @abc.abstractmethod
    def trains_with_dropout(self) -> bool:
        """Whether the training forward differs from the scoring forward (a positive dropout probability in
        the model), so log-probs of a training forward cannot stand in for a scoring pass."""
