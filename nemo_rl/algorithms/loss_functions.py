"""Loss functions the policy workers train with: clipped policy gradient (GRPO/PPO/GSPO/REINFORCE),
PPO's clipped value loss (the critic), negative log-likelihood (SFT), DPO / pairwise preference losses and
top-k distillation.

Each class is a thin adapter from :mod:`nemo_rl.models.policy.loss_interface`'s ``LossFunction`` contract to
the pure functions of :mod:`nemo_rl.algorithms.losses`: it checks and reads the batch keys, aligns the
per-token tensors with the predicted tokens (position 0 is never trained on, so they are sliced ``[:, 1:]``
against ``next_token_logits[:, :-1]``), calls the loss and turns its metrics into floats. A token is valid
where ``token_mask[:, 1:] * sample_mask[:, None]`` is 1, and each call returns its micro-batch's *share* of
the global loss (its sum divided by the global count of valid tokens or sequences). Metrics are shares as
well, except names ending in ``_min`` / ``_max``.

Tensor legend: B = sequences in the micro-batch, T = padded length, V = vocabulary; ``*_BS`` tensors are
the per-token values for positions 1..T-1 (S = T - 1).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from nemo_rl.algorithms import losses
from nemo_rl.algorithms.losses import Masks, PGInputs, at_least_fp32, pair_halves
from nemo_rl.algorithms.utils import next_token_logprobs
from nemo_rl.config.loss import ClippedPGLossConfig, DistillationLossConfig, DPOLossConfig, ValueLossConfig
from nemo_rl.models.policy.loss_interface import LossType

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

__all__ = [
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "NLLLoss",
    "PreferenceLoss",
    "ValueLossFn",
]


# Every loss on token log-probabilities needs these batch keys (see nemo_rl.models.policy.loss_interface).
_TOKEN_LOSS_KEYS = ("input_ids", "token_mask", "sample_mask")


@dataclasses.dataclass(frozen=True)
class LossCall:
    """One call of a loss by the workers: the model's output, the micro-batch and the global counts."""

    output: torch.Tensor
    """Next-token logits [B, T, V], a reward model's rewards [B] / [B, 1], or a value model's head output at
    every position [B, T]."""
    data: BatchedDataDict[Any]
    global_valid_seqs: torch.Tensor
    global_valid_toks: torch.Tensor

    def require(self, keys: tuple[str, ...], loss_name: str) -> None:
        """Fail with the missing names when the batch lacks any of ``keys``."""
        missing = [k for k in keys if k not in self.data]
        if missing:
            raise KeyError(
                f"{loss_name} needs batch keys {missing}; the batch has {sorted(self.data.keys())}."
            )

    def per_token(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """``data[key][:, 1:]`` in ``like``'s dtype and device (aligned with ``next_token_logprobs``)."""
        value: torch.Tensor = self.data[key]
        return value[:, 1:].to(device=like.device, dtype=like.dtype)

    def masks(self, like: torch.Tensor) -> Masks:
        """The token and sample masks in ``like``'s dtype and device, with the global counts."""
        sample_mask_B = self.data["sample_mask"].to(device=like.device, dtype=like.dtype)
        return Masks.of(
            self.per_token("token_mask", like), sample_mask_B, self.global_valid_seqs, self.global_valid_toks
        )

    def token_logprobs(self, extra_keys: tuple[str, ...], loss_name: str) -> tuple[torch.Tensor, Masks]:
        """Check the batch (``input_ids``, ``token_mask``, ``sample_mask`` and ``extra_keys``) and return the
        sampled tokens' log-probabilities under the logits, ``logprobs_BS``, with the masks."""
        self.require((*_TOKEN_LOSS_KEYS, *extra_keys), loss_name)
        logprobs_BS = next_token_logprobs(self.output, self.data["input_ids"])
        return logprobs_BS, self.masks(logprobs_BS)


class _LossAdapter:
    """The ``LossFunction`` call, read into a :class:`LossCall` for the adapter's :meth:`compute`."""

    def __call__(
        self,
        next_token_logits_BTV: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the loss, and its metrics (see the class docstring)."""
        return self.compute(LossCall(next_token_logits_BTV, data, global_valid_seqs, global_valid_toks))

    def compute(self, call: LossCall) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one call; each adapter defines it."""
        raise NotImplementedError


def _floats(terms: dict[str, torch.Tensor], loss: torch.Tensor) -> dict[str, float]:
    """``terms`` as floats, then ``loss``."""
    return {**{name: value.item() for name, value in terms.items()}, "loss": loss.item()}


def _check_pairs(data: BatchedDataDict[Any]) -> None:
    """Rows 2i and 2i + 1 must be one example's chosen and rejected responses (same ``idx`` when present)."""
    if "idx" not in data:
        return
    chosen_idx, rejected_idx = pair_halves(torch.as_tensor(data["idx"]))
    if not torch.equal(chosen_idx, rejected_idx):
        raise ValueError(
            "a preference micro-batch holds rows of different pairs side by side (idx "
            f"{torch.as_tensor(data['idx']).tolist()[:8]}...): pairs were split between micro-batches or ranks; "
            "shard preference batches with whole pairs (loss_fn.rows_per_group = 2)"
        )


class ClippedPGLossFn(_LossAdapter):
    """Clipped policy-gradient loss with a KL penalty to the reference policy.

    Per valid token t of a response with advantage A_t, ratio r_t = pi_curr / pi_prev and
    clipped ratio c_t = clamp(r_t, 1 - ratio_clip_min, 1 + ratio_clip_max)::

        pg_t   = max(-A_t * r_t, -A_t * c_t)                  (PPO / GRPO pessimistic bound)
        pg_t   = min(pg_t, -A_t * ratio_clip_c) if A_t < 0     (dual clip, when enabled)
        loss_t = w_t * pg_t + beta * v_t * KL_t(pi_curr || pi_ref)

    with w_t = pi_prev / pi_gen when ``use_importance_sampling_correction`` (else 1) and
    v_t = pi_curr / pi_gen (detached) when ``use_on_policy_kl_approximation`` (else 1). Variants:
    ``disable_ppo_ratio`` uses pg_t = -A_t * log pi_curr (REINFORCE); ``sequence_level_importance_ratios``
    (GSPO) replaces r_t by exp(mean over the sequence of log r_t) and w_t by exp(sum over the sequence
    of log pi_prev - log pi_gen). ``token_level_loss`` averages loss_t over all valid tokens of the global
    batch; otherwise each sequence's tokens are averaged first and the sequences then averaged.
    """

    def __init__(self, cfg: ClippedPGLossConfig, *, prev_logprobs_from_forward: bool = False) -> None:
        """``prev_logprobs_from_forward``: take pi_prev from this very forward pass (detached) instead of the
        batch's ``prev_logprobs``. Exact when the training call takes one optimizer step on the weights the
        batch would have been scored with (every micro-batch's forward runs before the update) and the
        training forward equals the scoring one (no dropout); it saves the separate scoring pass, as TRL does.
        """
        self.cfg = cfg
        self.loss_type = LossType.TOKEN_LEVEL if cfg.token_level_loss else LossType.SEQUENCE_LEVEL
        self.rows_per_group = 1
        self.prev_logprobs_from_forward = prev_logprobs_from_forward

    def required_keys(self) -> tuple[str, ...]:
        """The batch keys besides ``input_ids`` / ``token_mask`` / ``sample_mask`` this loss reads."""
        required: tuple[str, ...] = ("advantages", "generation_logprobs")
        if not self.prev_logprobs_from_forward:
            required += ("prev_logprobs",)
        if self.cfg.reference_policy_kl_penalty != 0:
            required += ("reference_policy_logprobs",)
        return required

    def compute(self, call: LossCall) -> tuple[torch.Tensor, dict[str, float]]:
        """Needs ``input_ids``, ``token_mask``, ``sample_mask``, ``advantages``, ``prev_logprobs`` (unless
        ``prev_logprobs_from_forward``), ``generation_logprobs`` and, when the KL penalty is on,
        ``reference_policy_logprobs``."""
        curr_BS, masks = call.token_logprobs(self.required_keys(), "ClippedPGLossFn")
        use_kl = self.cfg.reference_policy_kl_penalty != 0
        x = PGInputs(
            curr_BS=curr_BS,
            prev_BS=(
                curr_BS.detach()
                if self.prev_logprobs_from_forward
                else call.per_token("prev_logprobs", curr_BS)
            ),
            gen_BS=call.per_token("generation_logprobs", curr_BS),
            advantages_BS=call.per_token("advantages", curr_BS),
            ref_BS=call.per_token("reference_policy_logprobs", curr_BS) if use_kl else None,
        )
        terms = losses.clipped_pg_loss(x, masks, self.cfg)
        with torch.no_grad():
            detached = dataclasses.replace(x, curr_BS=curr_BS.detach())
            metrics = losses.clipped_pg_metrics(call.output, detached, terms, masks, self.cfg)
        return terms.loss, metrics


class ValueLossFn(_LossAdapter):
    """PPO's clipped value loss (:func:`nemo_rl.algorithms.losses.clipped_value_loss`) for a value model.

    The model output is the value head at every position, ``head_BT``; the value of the state in which token
    ``t`` was chosen is ``head_BT[:, t - 1]``, so ``head_BT[:, :-1]`` lines up with the per-token batch keys
    ``returns`` and ``old_values`` sliced ``[:, 1:]`` (both aligned with the tokens, as ``get_values`` returns
    them). Metrics: the loss, the clipped share ``vf_clipfrac``, value and return means, and the shares that
    :func:`nemo_rl.algorithms.losses.explained_variance` reads once summed over the batch."""

    def __init__(self, cfg: ValueLossConfig) -> None:
        """``cfg``: the ``value_loss_fn`` section."""
        self.cfg = cfg
        self.loss_type = LossType.TOKEN_LEVEL
        self.rows_per_group = 1

    def compute(self, call: LossCall) -> tuple[torch.Tensor, dict[str, float]]:
        """Needs ``input_ids``, ``token_mask``, ``sample_mask``, ``returns`` and ``old_values``."""
        call.require((*_TOKEN_LOSS_KEYS, "returns", "old_values"), "ValueLossFn")
        if tuple(call.output.shape) != tuple(call.data["input_ids"].shape):
            raise ValueError(
                f"ValueLossFn trains a value head read at every token ([B, T]) but the model gave "
                f"{tuple(call.output.shape)}: train a critic with policy.reward_model_cfg.reward_model_type=regression"
            )
        values_BS = at_least_fp32(call.output[:, :-1])
        masks = call.masks(values_BS)
        returns_BS = call.per_token("returns", values_BS)
        terms = losses.clipped_value_loss(
            values_BS,
            call.per_token("old_values", values_BS),
            returns_BS,
            masks,
            scale=self.cfg.scale,
            cliprange=self.cfg.cliprange,
            token_level=True,
        )
        return terms.loss, losses.value_metrics(values_BS, returns_BS, terms, masks)


class NLLLoss(_LossAdapter):
    """Token-level negative log-likelihood of the masked tokens (SFT), normalised by the global token count."""

    loss_type = LossType.TOKEN_LEVEL
    rows_per_group = 1

    def compute(self, call: LossCall) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of -mean(log p(token)) over the valid tokens of the global batch."""
        logprobs_BS, masks = call.token_logprobs((), "NLLLoss")
        loss = -masks.token_mean(logprobs_BS)
        num_tokens = masks.mask_BS.sum().item()
        return loss, {
            "loss": loss.item(),
            "num_valid_tokens": num_tokens,
            "num_unmasked_tokens": num_tokens,
            "num_valid_samples": masks.sample_mask_B.sum().item(),
        }


class PreferenceLoss(_LossAdapter):
    """Bradley-Terry loss on scalar rewards of interleaved (chosen, rejected) pairs (reward-model training).

    ``loss = -log sigmoid(r_chosen - r_rejected)`` averaged over valid pairs; a pair is valid where its
    chosen row's ``sample_mask`` is 1. ``global_valid_seqs`` counts sequences (two per pair).
    """

    loss_type = LossType.SEQUENCE_LEVEL
    rows_per_group = 2  # (chosen, rejected) pairs, read together

    def compute(self, call: LossCall) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the pairwise loss; the output is the reward head's [B] or [B, 1]."""
        _check_pairs(call.data)
        if call.output.dim() > 1 and call.output.shape[1] != 1:
            raise ValueError(
                f"PreferenceLoss reads one reward per sequence but the model gave {tuple(call.output.shape)} (a value "
                "model's head at every token): train reward models with policy.reward_model_cfg.reward_model_type="
                "bradley_terry"
            )
        rewards_B = at_least_fp32(call.output).reshape(call.output.shape[0])
        sample_mask_B = call.data["sample_mask"].to(device=rewards_B.device, dtype=rewards_B.dtype)
        terms = losses.preference_terms(rewards_B, sample_mask_B, call.global_valid_seqs, beta=1.0)
        loss = terms["preference_loss"]
        return loss, _floats(terms, loss)


class DPOLossFn(_LossAdapter):
    """Direct Preference Optimisation on interleaved (chosen, rejected) pairs, plus an optional SFT term.

    The implicit reward of a response is r = sum_t (log pi(y_t) - log pi_ref(y_t)) over its masked tokens
    (averaged instead with ``preference_average_log_probs``). The loss is::

        preference_loss_weight * -log sigmoid(beta * (r_chosen - r_rejected))
        + sft_loss_weight * -sum_t log pi(chosen_t)      (averaged with ``sft_average_log_probs``)

    each averaged over valid pairs; ``global_valid_seqs`` counts sequences (two per pair). Needs
    ``reference_policy_logprobs`` aligned with ``input_ids``.
    """

    loss_type = LossType.SEQUENCE_LEVEL
    rows_per_group = 2  # (chosen, rejected) pairs, read together

    def __init__(self, cfg: DPOLossConfig) -> None:
        self.cfg = cfg

    def compute(self, call: LossCall) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the DPO loss, and its metrics."""
        logprobs_BS, masks = call.token_logprobs(("reference_policy_logprobs",), "DPOLossFn")
        _check_pairs(call.data)
        ref_BS = call.per_token("reference_policy_logprobs", logprobs_BS)
        loss, terms = losses.dpo_loss(logprobs_BS, ref_BS, masks.mask_BS, masks, self.cfg)
        sft_loss = terms.pop("sft_loss")
        return loss, {**_floats(terms, loss), "sft_loss": sft_loss.item()}


class DistillationLossFn(_LossAdapter):
    """KL between the teacher's and the student's next-token distributions on the teacher's top-k tokens.

    Needs ``teacher_topk_logits`` and ``teacher_topk_indices`` [B, T, K], unshifted like the logits (row
    ``t`` is the distribution of token ``t + 1``, see ``PolicyInterface.get_topk_logits``). Per trained
    position, with p = teacher and q = student over the K tokens::

        forward = sum_k p_k (log p_k - log q_k)      reverse = sum_k q_k (log q_k - log p_k)

    Both are renormalised over the K tokens unless ``zero_outside_topk``: then q keeps its full-vocabulary
    probabilities and the reverse KL adds the student mass outside the top-k, where the teacher's
    log-probability is taken as -100. The loss averages over the valid tokens of the global batch.
    """

    loss_type = LossType.TOKEN_LEVEL
    rows_per_group = 1

    def __init__(self, cfg: DistillationLossConfig) -> None:
        self.cfg = cfg

    def compute(self, call: LossCall) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the distillation KL, and its metrics."""
        call.require((*_TOKEN_LOSS_KEYS, "teacher_topk_logits", "teacher_topk_indices"), "DistillationLossFn")
        logits_BSV = at_least_fp32(call.output[:, :-1])
        indices_BSK = call.data["teacher_topk_indices"][:, :-1].to(logits_BSV.device).long()
        if indices_BSK.shape[-1] < 1:
            raise ValueError(
                "teacher_topk_indices has k = 0: ask the teacher for at least one logit per position"
            )
        teacher_BSK = torch.log_softmax(call.data["teacher_topk_logits"][:, :-1].to(logits_BSV), dim=-1)
        masks = call.masks(logits_BSV[..., 0])
        kl_BS, forward_BS, reverse_BS = losses.distillation_kls(
            logits_BSV, teacher_BSK, indices_BSK, self.cfg
        )
        loss = masks.token_mean(kl_BS)
        with torch.no_grad():
            metrics = {
                "loss": loss.item(),
                "forward_kl": masks.token_mean(forward_BS).item(),
                "reverse_kl": masks.token_mean(reverse_BS).item(),
                "num_valid_samples": masks.sample_mask_B.sum().item(),
                "num_valid_tokens": masks.mask_BS.sum().item(),
            }
        return loss, metrics
