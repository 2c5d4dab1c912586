"""Loss functions the policy workers train with: clipped policy gradient (GRPO/PPO/GSPO/REINFORCE),
negative log-likelihood (SFT), DPO / pairwise preference losses and top-k distillation.

Every loss follows :mod:`nemo_rl.models.policy.loss_interface`: per-token tensors are aligned with ``input_ids``
(position 0 is never trained on, so they are sliced ``[:, 1:]`` against ``next_token_logits[:, :-1]``),
a token is valid where ``token_mask[:, 1:] * sample_mask[:, None]`` is 1, and each call returns its
micro-batch's *share* of the global loss (its sum divided by the global count of valid tokens or
sequences). Metrics are shares as well, except names ending in ``_min`` / ``_max``.

Tensor legend: B = sequences in the micro-batch, T = padded length, V = vocabulary; ``*_BS`` tensors are
the per-token values for positions 1..T-1 (S = T - 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from nemo_rl.algorithms.utils import (
    KLType,
    calculate_kl,
    masked_mean,
    masked_sum,
    next_token_logprobs,
    token_entropy,
)
from nemo_rl.config.loss import ClippedPGLossConfig, DistillationLossConfig, DPOLossConfig
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
]


# Every loss on token log-probabilities needs these batch keys (see nemo_rl.models.policy.loss_interface).
_TOKEN_LOSS_KEYS = ("input_ids", "token_mask", "sample_mask")


def _require_keys(data: BatchedDataDict[Any], keys: tuple[str, ...], loss_name: str) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise KeyError(f"{loss_name} needs batch keys {missing}; the batch has {sorted(data.keys())}.")


def _per_token(data: BatchedDataDict[Any], key: str, like: torch.Tensor) -> torch.Tensor:
    """``data[key][:, 1:]`` in ``like``'s dtype and device (positions aligned with ``next_token_logprobs``)."""
    value: torch.Tensor = data[key]
    return value[:, 1:].to(device=like.device, dtype=like.dtype)


def _masks(data: BatchedDataDict[Any], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_mask_BS, sample_mask_B, mask_BS) in ``like``'s dtype, where ``mask`` combines both."""
    token_mask_BS = _per_token(data, "token_mask", like)
    sample_mask_B = data["sample_mask"].to(device=like.device, dtype=like.dtype)
    return token_mask_BS, sample_mask_B, token_mask_BS * sample_mask_B.unsqueeze(-1)


def _logprobs_and_masks(
    next_token_logits_BTV: torch.Tensor,
    data: BatchedDataDict[Any],
    extra_keys: tuple[str, ...],
    loss_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the batch and return (logprobs_BS, token_mask_BS, sample_mask_B, mask_BS) for a token loss.

    The batch must hold ``input_ids``, ``token_mask``, ``sample_mask`` and ``extra_keys``; ``logprobs_BS``
    are the sampled tokens' log-probabilities under ``next_token_logits_BTV`` (see :func:`_masks`).
    """
    _require_keys(data, (*_TOKEN_LOSS_KEYS, *extra_keys), loss_name)
    logprobs_BS = next_token_logprobs(next_token_logits_BTV, data["input_ids"])
    return (logprobs_BS, *_masks(data, logprobs_BS))


def _token_share(
    values_BS: torch.Tensor, mask_BS: torch.Tensor, global_valid_toks: torch.Tensor
) -> torch.Tensor:
    """This micro-batch's share of the mean of ``values_BS`` over the valid tokens of the global batch."""
    return masked_mean(values_BS, mask_BS, global_normalization_factor=global_valid_toks)


def _unclamped_kl(logprobs_a: torch.Tensor, logprobs_b: torch.Tensor, kl_type: KLType) -> torch.Tensor:
    """Per-token KL estimate of ``kl_type`` between two log-probability tensors, without clamping (metrics)."""
    return calculate_kl(
        logprobs_a, logprobs_b, kl_type=kl_type, input_clamp_value=None, output_clamp_value=None
    )


def _at_least_fp32(values: torch.Tensor) -> torch.Tensor:
    """``values`` in float32, or kept in its own dtype when that is wider (float64)."""
    return values.to(torch.promote_types(values.dtype, torch.float32))


def _masked_min_max(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Min and max of ``values`` where ``mask`` is set; (inf, -inf) when nothing is, so reductions ignore it."""
    selected = values.detach()[mask.bool()]
    if selected.numel() == 0:
        return float("inf"), float("-inf")
    return selected.min().item(), selected.max().item()


class ClippedPGLossFn:
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

    def _reduce(
        self,
        values_BS: torch.Tensor,
        token_mask_BS: torch.Tensor,
        sample_mask_B: torch.Tensor,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> torch.Tensor:
        """This micro-batch's share of the loss-type average of a per-token quantity."""
        if self.loss_type == LossType.TOKEN_LEVEL:
            return _token_share(values_BS, token_mask_BS * sample_mask_B.unsqueeze(-1), global_valid_toks)
        per_seq_B = masked_mean(values_BS, token_mask_BS, dim=-1)
        return masked_mean(per_seq_B, sample_mask_B, global_normalization_factor=global_valid_seqs)

    def _importance_weights(
        self,
        prev_BS: torch.Tensor,
        gen_BS: torch.Tensor,
        token_mask_BS: torch.Tensor,
        mask_BS: torch.Tensor,
        sample_mask_B: torch.Tensor,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """pi_prev / pi_gen per token (or per sequence for GSPO), optionally truncated; plus filter metrics."""
        cfg = self.cfg
        if cfg.sequence_level_importance_ratios:
            log_w_B = masked_sum(prev_BS - gen_BS, mask_BS, dim=-1)
            weights = torch.exp(log_w_B).unsqueeze(-1).expand_as(prev_BS)
        else:
            weights = torch.exp(prev_BS - gen_BS)
        # A non-finite weight means the two backends disagree completely on a token; drop it, don't explode.
        weights = torch.nan_to_num(weights, nan=0.0, posinf=0.0, neginf=0.0)
        metrics: dict[str, float] = {}
        upper = cfg.truncated_importance_sampling_ratio
        if upper is None:
            return weights, metrics
        lower = cfg.truncated_importance_sampling_ratio_min
        kind = cfg.truncated_importance_sampling_type or "tis"
        if kind == "tis":
            weights = weights.clamp(max=upper)
        elif kind == "icepop":
            assert lower is not None  # the config validator requires it
            kept_BS = ((weights >= lower) & (weights <= upper)).float()
            metrics["is_oob_ratio"] = _token_share(1.0 - kept_BS, mask_BS, global_valid_toks).item()
            weights = weights * kept_BS
        else:  # seq-mask-tis
            assert lower is not None  # the config validator requires it
            log_w_BS = torch.nan_to_num(prev_BS - gen_BS, nan=0.0, posinf=0.0, neginf=0.0)
            geo_mean_B = torch.exp(masked_mean(log_w_BS, token_mask_BS, dim=-1))
            kept_B = ((geo_mean_B >= lower) & (geo_mean_B <= upper)).float()
            metrics["is_oob_ratio"] = masked_mean(
                1.0 - kept_B, sample_mask_B, global_normalization_factor=global_valid_seqs
            ).item()
            weights = weights * kept_B.unsqueeze(-1)
        return weights, metrics

    def __call__(
        self,
        next_token_logits_BTV: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the clipped policy-gradient loss, and its metrics.

        Needs ``input_ids``, ``token_mask``, ``sample_mask``, ``advantages``, ``prev_logprobs`` (unless
        ``prev_logprobs_from_forward``), ``generation_logprobs`` and, when the KL penalty is on,
        ``reference_policy_logprobs``.
        """
        cfg = self.cfg
        use_kl = cfg.reference_policy_kl_penalty != 0
        required: tuple[str, ...] = ("advantages", "generation_logprobs")
        if not self.prev_logprobs_from_forward:
            required += ("prev_logprobs",)
        curr_BS, token_mask_BS, sample_mask_B, mask_BS = _logprobs_and_masks(
            next_token_logits_BTV,
            data,
            (*required, "reference_policy_logprobs") if use_kl else required,
            "ClippedPGLossFn",
        )
        advantages_BS = _per_token(data, "advantages", curr_BS)
        if self.prev_logprobs_from_forward:
            prev_BS = curr_BS.detach()
        else:
            prev_BS = _per_token(data, "prev_logprobs", curr_BS)
        gen_BS = _per_token(data, "generation_logprobs", curr_BS)

        def share_tok(values_BS: torch.Tensor) -> torch.Tensor:
            return _token_share(values_BS, mask_BS, global_valid_toks)

        # KL to the reference policy.
        if use_kl:
            ref_BS = _per_token(data, "reference_policy_logprobs", curr_BS)
            kl_BS = calculate_kl(
                curr_BS,
                ref_BS,
                kl_type=cfg.reference_policy_kl_type,
                input_clamp_value=cfg.kl_input_clamp_value,
                output_clamp_value=cfg.kl_output_clamp_value,
            )
            if cfg.use_on_policy_kl_approximation:
                # Samples come from pi_gen; reweighting by pi_curr / pi_gen estimates the KL under pi_curr.
                kl_weights_BS = torch.nan_to_num(
                    torch.exp(curr_BS - gen_BS).detach(), nan=0.0, posinf=0.0, neginf=0.0
                )
                kl_BS = kl_weights_BS * kl_BS
            kl = self._reduce(kl_BS, token_mask_BS, sample_mask_B, global_valid_seqs, global_valid_toks)
        else:
            kl = torch.zeros((), device=curr_BS.device)

        # Policy-gradient term.
        log_ratio_BS = curr_BS - prev_BS
        if cfg.force_on_policy_ratio:
            # Value 1, gradient that of pi_curr / pi_prev at pi_curr = pi_prev.
            ratios_BS = torch.exp(curr_BS - curr_BS.detach())
            clamped_BS = ratios_BS
        elif cfg.disable_ppo_ratio:
            ratios_BS = torch.exp(log_ratio_BS).detach()  # reported only
            clamped_BS = ratios_BS
        else:
            if cfg.sequence_level_importance_ratios:
                seq_log_ratio_B = masked_mean(log_ratio_BS, token_mask_BS, dim=-1)
                ratios_BS = torch.exp(seq_log_ratio_B).unsqueeze(-1).expand_as(curr_BS)
            else:
                ratios_BS = torch.exp(log_ratio_BS)
            clamped_BS = ratios_BS.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)

        if cfg.disable_ppo_ratio:
            pg_BS = -advantages_BS * curr_BS
        else:
            pg_BS = torch.maximum(-advantages_BS * ratios_BS, -advantages_BS * clamped_BS)
        dual_clipped_BS = torch.zeros_like(pg_BS, dtype=torch.bool)
        if cfg.ratio_clip_c is not None:
            dual_bound_BS = -advantages_BS * cfg.ratio_clip_c
            dual_clipped_BS = (advantages_BS < 0) & (dual_bound_BS < pg_BS)
            pg_BS = torch.where(dual_clipped_BS, dual_bound_BS, pg_BS)

        is_weights_BS, is_metrics = self._importance_weights(
            prev_BS, gen_BS, token_mask_BS, mask_BS, sample_mask_B, global_valid_seqs, global_valid_toks
        )
        if cfg.use_importance_sampling_correction:
            pg_BS = is_weights_BS * pg_BS
        actor_loss = self._reduce(pg_BS, token_mask_BS, sample_mask_B, global_valid_seqs, global_valid_toks)
        loss = actor_loss + cfg.reference_policy_kl_penalty * kl

        with torch.no_grad():
            metrics = self._metrics(
                next_token_logits_BTV,
                curr_BS=curr_BS.detach(),
                prev_BS=prev_BS,
                gen_BS=gen_BS,
                advantages_BS=advantages_BS,
                ratios_BS=ratios_BS.detach(),
                clamped_BS=clamped_BS.detach(),
                dual_clipped_BS=dual_clipped_BS,
                is_weights_BS=is_weights_BS,
                mask_BS=mask_BS,
                sample_mask_B=sample_mask_B,
                global_valid_seqs=global_valid_seqs,
                global_valid_toks=global_valid_toks,
                share_tok=share_tok,
            )
        metrics.update(is_metrics)
        metrics["loss"] = loss.item()
        metrics["actor_loss"] = actor_loss.item()
        metrics["kl_penalty"] = kl.item()
        return loss, metrics

    def _metrics(
        self,
        next_token_logits_BTV: torch.Tensor,
        *,
        curr_BS: torch.Tensor,
        prev_BS: torch.Tensor,
        gen_BS: torch.Tensor,
        advantages_BS: torch.Tensor,
        ratios_BS: torch.Tensor,
        clamped_BS: torch.Tensor,
        dual_clipped_BS: torch.Tensor,
        is_weights_BS: torch.Tensor,
        mask_BS: torch.Tensor,
        sample_mask_B: torch.Tensor,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        share_tok: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[str, float]:
        """Diagnostics (NeMo RL names), each an additive share except ``*_min`` / ``*_max``."""
        cfg = self.cfg
        kl_type = cfg.reference_policy_kl_type
        ratio_min, ratio_max = _masked_min_max(ratios_BS, mask_BS)
        clamped_min, clamped_max = _masked_min_max(clamped_BS, mask_BS)
        # A token is clipped when the clipped branch wins and stops its gradient.
        if cfg.disable_ppo_ratio or cfg.force_on_policy_ratio:
            clipped_BS = torch.zeros_like(mask_BS)
        else:
            clipped_BS = (
                ((advantages_BS > 0) & (ratios_BS > clamped_BS))
                | ((advantages_BS < 0) & (ratios_BS < clamped_BS))
            ).float()
        # Jensen-Shannon divergence between the training and generation distributions on the sampled token.
        log_mix_BS = torch.logaddexp(prev_BS, gen_BS) - math.log(2.0)
        js_BS = 0.5 * (_unclamped_kl(log_mix_BS, prev_BS, "k3") + _unclamped_kl(log_mix_BS, gen_BS, "k3"))
        if cfg.sequence_level_importance_ratios:
            # Every token of a sequence carries its sequence's weight; take the first column.
            per_seq_B = is_weights_BS[:, 0] if is_weights_BS.shape[1] > 0 else torch.zeros_like(sample_mask_B)
            sampling_ratio = masked_mean(
                per_seq_B, sample_mask_B, global_normalization_factor=global_valid_seqs
            )
        else:
            sampling_ratio = share_tok(is_weights_BS)
        return {
            "probs_ratio": share_tok(ratios_BS).item(),
            "probs_ratio_clamped": share_tok(clamped_BS).item(),
            "probs_ratio_min": ratio_min,
            "probs_ratio_max": ratio_max,
            "probs_ratio_clamped_min": clamped_min,
            "probs_ratio_clamped_max": clamped_max,
            "clipped_fraction": share_tok(clipped_BS).item(),
            "dual_clipped_fraction": share_tok(dual_clipped_BS.float()).item(),
            # NeMo RL's definition: mean over valid tokens of exp(|log pi_prev - log pi_gen|), >= 1.
            "token_mult_prob_error": share_tok(torch.exp((prev_BS - gen_BS).abs() * mask_BS)).item(),
            # KL(pi_gen || pi_prev), estimated on tokens sampled from pi_gen.
            "gen_kl_error": share_tok(_unclamped_kl(gen_BS, prev_BS, kl_type)).item(),
            # KL(pi_prev || pi_gen), same samples.
            "policy_kl_error": share_tok(_unclamped_kl(prev_BS, gen_BS, kl_type)).item(),
            "js_divergence_error": share_tok(js_BS).item(),
            "sampling_importance_ratio": sampling_ratio.item(),
            # E_{pi_gen}[-(pi_curr / pi_gen) log pi_curr]: the current policy's entropy from sampled tokens.
            "approx_entropy": share_tok(-torch.exp(curr_BS - gen_BS) * curr_BS).item(),
            # Exact entropy of the current policy's next-token distribution at the trained positions.
            "entropy": share_tok(token_entropy(next_token_logits_BTV.detach())).item(),
            "num_valid_samples": sample_mask_B.sum().item(),
            "num_valid_tokens": mask_BS.sum().item(),
        }


class NLLLoss:
    """Token-level negative log-likelihood of the masked tokens (SFT), normalised by the global token count."""

    loss_type = LossType.TOKEN_LEVEL
    rows_per_group = 1

    def __call__(
        self,
        next_token_logits_BTV: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of -mean(log p(token)) over the valid tokens of the global batch."""
        logprobs_BS, _, sample_mask_B, mask_BS = _logprobs_and_masks(
            next_token_logits_BTV, data, (), "NLLLoss"
        )
        loss = -_token_share(logprobs_BS, mask_BS, global_valid_toks)
        num_tokens = mask_BS.sum().item()
        return loss, {
            "loss": loss.item(),
            "num_valid_tokens": num_tokens,
            "num_unmasked_tokens": num_tokens,
            "num_valid_samples": sample_mask_B.sum().item(),
        }


def _pair_halves(values_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a batch of interleaved preference pairs into (chosen, rejected): rows 0, 2, 4... are chosen."""
    if values_B.shape[0] % 2 != 0:
        raise ValueError(
            f"preference batches interleave (chosen, rejected) pairs, so their size must be even; got "
            f"{values_B.shape[0]}. Keep micro-batch sizes even."
        )
    return values_B[0::2], values_B[1::2]


def _check_pairs(data: BatchedDataDict[Any]) -> None:
    """Rows 2i and 2i + 1 must be one example's chosen and rejected responses (same ``idx`` when present)."""
    if "idx" not in data:
        return
    chosen_idx, rejected_idx = _pair_halves(torch.as_tensor(data["idx"]))
    if not torch.equal(chosen_idx, rejected_idx):
        raise ValueError(
            "a preference micro-batch holds rows of different pairs side by side (idx "
            f"{torch.as_tensor(data['idx']).tolist()[:8]}...): pairs were split between micro-batches or ranks; "
            "shard preference batches with whole pairs (loss_fn.rows_per_group = 2)"
        )


def _pair_mask_and_count(
    sample_mask_B: torch.Tensor, global_valid_seqs: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_mask_P, global_pairs): a pair is valid where its chosen row is; ``global_valid_seqs`` / 2 pairs.

    ``global_pairs`` takes ``like``'s dtype and device.
    """
    pair_mask_P, _ = _pair_halves(sample_mask_B)
    global_pairs = torch.as_tensor(global_valid_seqs, dtype=like.dtype, device=like.device) / 2
    return pair_mask_P, global_pairs


def _item_metrics(terms: dict[str, torch.Tensor], loss: torch.Tensor) -> dict[str, float]:
    """``terms`` as floats, plus ``loss``."""
    metrics = {name: value.item() for name, value in terms.items()}
    metrics["loss"] = loss.item()
    return metrics


class PreferenceLoss:
    """Bradley-Terry loss on scalar rewards of interleaved (chosen, rejected) pairs (reward-model training).

    ``loss = -log sigmoid(r_chosen - r_rejected)`` averaged over valid pairs; a pair is valid where its
    chosen row's ``sample_mask`` is 1. ``global_valid_seqs`` counts sequences (two per pair).
    """

    loss_type = LossType.SEQUENCE_LEVEL
    rows_per_group = 2  # (chosen, rejected) pairs, read together

    @staticmethod
    def _preference_terms(
        rewards_B: torch.Tensor,
        sample_mask_B: torch.Tensor,
        global_valid_seqs: torch.Tensor,
        beta: float,
    ) -> dict[str, torch.Tensor]:
        chosen_P, rejected_P = _pair_halves(rewards_B)
        pair_mask_P, global_pairs = _pair_mask_and_count(sample_mask_B, global_valid_seqs, rewards_B)
        margin_P = chosen_P - rejected_P
        return {
            "preference_loss": masked_mean(
                -F.logsigmoid(beta * margin_P), pair_mask_P, global_normalization_factor=global_pairs
            ),
            "accuracy": masked_mean(
                (margin_P > 0).float(), pair_mask_P, global_normalization_factor=global_pairs
            ),
            "rewards_chosen_mean": masked_mean(
                chosen_P, pair_mask_P, global_normalization_factor=global_pairs
            ),
            "rewards_rejected_mean": masked_mean(
                rejected_P, pair_mask_P, global_normalization_factor=global_pairs
            ),
            "num_valid_samples": pair_mask_P.sum(),
        }

    def __call__(
        self,
        rewards_B: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the pairwise loss; ``rewards_B`` is the reward head's output [B] or [B, 1]."""
        _check_pairs(data)
        rewards_B = _at_least_fp32(rewards_B).reshape(rewards_B.shape[0])
        sample_mask_B = data["sample_mask"].to(device=rewards_B.device, dtype=rewards_B.dtype)
        terms = self._preference_terms(rewards_B, sample_mask_B, global_valid_seqs, beta=1.0)
        loss = terms["preference_loss"]
        return loss, _item_metrics(terms, loss)


class DPOLossFn:
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

    def __call__(
        self,
        next_token_logits_BTV: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the DPO loss, and its metrics."""
        logprobs_BS, _, sample_mask_B, mask_BS = _logprobs_and_masks(
            next_token_logits_BTV, data, ("reference_policy_logprobs",), "DPOLossFn"
        )
        _check_pairs(data)
        cfg = self.cfg
        ref_BS = _per_token(data, "reference_policy_logprobs", logprobs_BS)
        num_tokens_B = mask_BS.sum(dim=-1).clamp(min=1)

        rewards_B = masked_sum(logprobs_BS - ref_BS, mask_BS, dim=-1)
        if cfg.preference_average_log_probs:
            rewards_B = rewards_B / num_tokens_B
        terms = PreferenceLoss._preference_terms(
            rewards_B, sample_mask_B, global_valid_seqs, beta=cfg.reference_policy_kl_penalty
        )

        sft_nll_B = -masked_sum(logprobs_BS, mask_BS, dim=-1)
        if cfg.sft_average_log_probs:
            sft_nll_B = sft_nll_B / num_tokens_B
        sft_chosen_P, _ = _pair_halves(sft_nll_B)
        pair_mask_P, global_pairs = _pair_mask_and_count(sample_mask_B, global_valid_seqs, logprobs_BS)
        sft_loss = masked_mean(sft_chosen_P, pair_mask_P, global_normalization_factor=global_pairs)

        loss = cfg.preference_loss_weight * terms["preference_loss"] + cfg.sft_loss_weight * sft_loss
        metrics = _item_metrics(terms, loss)
        metrics["sft_loss"] = sft_loss.item()
        return loss, metrics


# log-probability given to the teacher outside its top-k when ``zero_outside_topk`` (log 0 would be -inf).
_LOG_TEACHER_OUTSIDE_TOPK = -100.0


class DistillationLossFn:
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

    def __call__(
        self,
        next_token_logits_BTV: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the distillation KL, and its metrics."""
        _require_keys(
            data,
            (*_TOKEN_LOSS_KEYS, "teacher_topk_logits", "teacher_topk_indices"),
            "DistillationLossFn",
        )
        cfg = self.cfg
        logits_BSV = _at_least_fp32(next_token_logits_BTV[:, :-1])
        indices_BSK = data["teacher_topk_indices"][:, :-1].to(logits_BSV.device).long()
        if indices_BSK.shape[-1] < 1:
            raise ValueError(
                "teacher_topk_indices has k = 0: ask the teacher for at least one logit per position"
            )
        teacher_BSK = torch.log_softmax(data["teacher_topk_logits"][:, :-1].to(logits_BSV), dim=-1)
        _, sample_mask_B, mask_BS = _masks(data, logits_BSV[..., 0])

        if cfg.zero_outside_topk:
            student_logp_BSV = torch.log_softmax(logits_BSV, dim=-1)
            student_BSK = student_logp_BSV.gather(-1, indices_BSK)
        else:
            student_BSK = torch.log_softmax(logits_BSV.gather(-1, indices_BSK), dim=-1)

        forward_BS = (teacher_BSK.exp() * (teacher_BSK - student_BSK)).sum(-1)
        reverse_BS = (student_BSK.exp() * (student_BSK - teacher_BSK)).sum(-1)
        if cfg.zero_outside_topk and cfg.kl_type != "forward":
            # Student mass outside the top-k: sum over those tokens of q (log q - log p_outside).
            neg_entropy_all_BS = (student_logp_BSV.exp() * student_logp_BSV).sum(-1)
            neg_entropy_rest_BS = neg_entropy_all_BS - (student_BSK.exp() * student_BSK).sum(-1)
            mass_rest_BS = 1.0 - student_BSK.exp().sum(-1)
            reverse_BS = reverse_BS + neg_entropy_rest_BS - _LOG_TEACHER_OUTSIDE_TOPK * mass_rest_BS

        if cfg.kl_type == "forward":
            kl_BS = forward_BS
        elif cfg.kl_type == "reverse":
            kl_BS = reverse_BS
        else:
            kl_BS = cfg.mixed_kl_weight * forward_BS + (1.0 - cfg.mixed_kl_weight) * reverse_BS
        loss = _token_share(kl_BS, mask_BS, global_valid_toks)
        with torch.no_grad():
            metrics = {
                "loss": loss.item(),
                "forward_kl": _token_share(forward_BS, mask_BS, global_valid_toks).item(),
                "reverse_kl": _token_share(reverse_BS, mask_BS, global_valid_toks).item(),
                "num_valid_samples": sample_mask_B.sum().item(),
                "num_valid_tokens": mask_BS.sum().item(),
            }
        return loss, metrics
