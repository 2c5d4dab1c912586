"""The losses as pure functions over named tensors; :mod:`nemo_rl.algorithms.loss_functions` adapts them to
the workers' ``LossFunction`` contract (reading the batch keys, checking them, returning float metrics).

Every function here takes the micro-batch's per-token tensors already aligned with the predicted tokens and
returns tensors: no batch dictionaries, no ``.item()``. A micro-batch's value is its *share* of the global
batch's average (see :class:`Masks`), so the shares of all micro-batches and ranks add up to the step's loss.

Tensor legend: B = sequences in the micro-batch, S = predicted positions (T - 1 for a padded length T),
V = vocabulary, K = the teacher's top-k, P = preference pairs (B / 2). ``curr`` / ``prev`` / ``gen`` /
``ref`` are the sampled tokens' log-probabilities under the current policy, the policy before this step's
updates, the sampler and the reference policy.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from nemo_rl.algorithms.utils import KLType, calculate_kl, masked_mean, masked_sum, token_entropy
from nemo_rl.config.loss import ClippedPGLossConfig, DistillationLossConfig, DPOLossConfig

# log-probability given to the teacher outside its top-k when ``zero_outside_topk`` (log 0 would be -inf).
LOG_TEACHER_OUTSIDE_TOPK = -100.0


@dataclasses.dataclass(frozen=True)
class Masks:
    """Which positions of a micro-batch count, and the global counts its shares are divided by."""

    token_mask_BS: torch.Tensor
    """1 where the position is trained on (an assistant token)."""
    sample_mask_B: torch.Tensor
    """1 where the sequence counts."""
    global_valid_seqs: torch.Tensor
    """Valid sequences in the global batch (all micro-batches and ranks)."""
    global_valid_toks: torch.Tensor
    """Valid tokens in the global batch."""
    mask_BS: torch.Tensor
    """1 where the token is trained on and its sequence counts."""

    @classmethod
    def of(
        cls,
        token_mask_BS: torch.Tensor,
        sample_mask_B: torch.Tensor,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> Masks:
        """The masks of a micro-batch, with ``mask_BS`` combining the token and sample masks."""
        mask_BS = token_mask_BS * sample_mask_B.unsqueeze(-1)
        return cls(token_mask_BS, sample_mask_B, global_valid_seqs, global_valid_toks, mask_BS)

    def token_mean(self, values_BS: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the mean of ``values_BS`` over the global batch's valid tokens."""
        return masked_mean(values_BS, self.mask_BS, global_normalization_factor=self.global_valid_toks)

    def seq_mean(self, values_B: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the mean of ``values_B`` over the global batch's valid sequences."""
        return masked_mean(values_B, self.sample_mask_B, global_normalization_factor=self.global_valid_seqs)

    def mean(self, values_BS: torch.Tensor, *, token_level: bool) -> torch.Tensor:
        """The token mean (``token_level``), or each sequence's token mean averaged over the sequences."""
        if token_level:
            return self.token_mean(values_BS)
        return self.seq_mean(masked_mean(values_BS, self.token_mask_BS, dim=-1))


def at_least_fp32(values: torch.Tensor) -> torch.Tensor:
    """``values`` in float32, or kept in its own dtype when that is wider (float64)."""
    return values.to(torch.promote_types(values.dtype, torch.float32))


def unclamped_kl(logprobs_a: torch.Tensor, logprobs_b: torch.Tensor, kl_type: KLType) -> torch.Tensor:
    """Per-token KL estimate of ``kl_type`` between two log-probability tensors, without clamping (metrics)."""
    return calculate_kl(
        logprobs_a, logprobs_b, kl_type=kl_type, input_clamp_value=None, output_clamp_value=None
    )


def masked_min_max(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Min and max of ``values`` where ``mask`` is set; (inf, -inf) when nothing is, so reductions ignore it."""
    selected = values.detach()[mask.bool()]
    if selected.numel() == 0:
        return float("inf"), float("-inf")
    return selected.min().item(), selected.max().item()


def _finite_or_zero(values: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)


# --- clipped policy gradient -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PGInputs:
    """The per-token log-probabilities and advantages the clipped policy-gradient loss reads."""

    curr_BS: torch.Tensor
    prev_BS: torch.Tensor
    gen_BS: torch.Tensor
    advantages_BS: torch.Tensor
    ref_BS: torch.Tensor | None
    """``None`` when the KL penalty is off."""


@dataclasses.dataclass(frozen=True)
class PGTerms:
    """The clipped policy-gradient loss and the per-token pieces its metrics read."""

    loss: torch.Tensor
    actor_loss: torch.Tensor
    kl: torch.Tensor
    ratios_BS: torch.Tensor
    clamped_BS: torch.Tensor
    dual_clipped_BS: torch.Tensor
    is_weights_BS: torch.Tensor
    is_metrics: dict[str, torch.Tensor]
    """Filter metrics of truncated importance sampling (``is_oob_ratio``), as shares."""


def reference_kl_BS(x: PGInputs, cfg: ClippedPGLossConfig) -> torch.Tensor:
    """Per-token KL(pi_curr || pi_ref), reweighted by pi_curr / pi_gen with the on-policy approximation."""
    assert x.ref_BS is not None
    kl_BS = calculate_kl(
        x.curr_BS,
        x.ref_BS,
        kl_type=cfg.reference_policy_kl_type,
        input_clamp_value=cfg.kl_input_clamp_value,
        output_clamp_value=cfg.kl_output_clamp_value,
    )
    if cfg.use_on_policy_kl_approximation:
        # Samples come from pi_gen; reweighting by pi_curr / pi_gen estimates the KL under pi_curr.
        kl_BS = _finite_or_zero(torch.exp(x.curr_BS - x.gen_BS).detach()) * kl_BS
    return kl_BS


def policy_ratios(
    x: PGInputs, token_mask_BS: torch.Tensor, cfg: ClippedPGLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratios_BS, clamped_BS): pi_curr / pi_prev (per sequence for GSPO) and its clipped value."""
    if cfg.force_on_policy_ratio:
        # Value 1, gradient that of pi_curr / pi_prev at pi_curr = pi_prev.
        ratios_BS = torch.exp(x.curr_BS - x.curr_BS.detach())
        return ratios_BS, ratios_BS
    log_ratio_BS = x.curr_BS - x.prev_BS
    if cfg.disable_ppo_ratio:
        ratios_BS = torch.exp(log_ratio_BS).detach()  # reported only
        return ratios_BS, ratios_BS
    if cfg.sequence_level_importance_ratios:
        seq_log_ratio_B = masked_mean(log_ratio_BS, token_mask_BS, dim=-1)
        ratios_BS = torch.exp(seq_log_ratio_B).unsqueeze(-1).expand_as(x.curr_BS)
    else:
        ratios_BS = torch.exp(log_ratio_BS)
    return ratios_BS, ratios_BS.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)


def pg_objective_BS(
    x: PGInputs, ratios_BS: torch.Tensor, clamped_BS: torch.Tensor, cfg: ClippedPGLossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pg_BS, dual_clipped_BS): the pessimistic clipped objective per token (REINFORCE's -A log pi with
    ``disable_ppo_ratio``), bounded by the dual clip where it applies."""
    a_BS = x.advantages_BS
    if cfg.disable_ppo_ratio:
        pg_BS = -a_BS * x.curr_BS
    else:
        pg_BS = torch.maximum(-a_BS * ratios_BS, -a_BS * clamped_BS)
    dual_clipped_BS = torch.zeros_like(pg_BS, dtype=torch.bool)
    if cfg.ratio_clip_c is not None:
        dual_bound_BS = -a_BS * cfg.ratio_clip_c
        dual_clipped_BS = (a_BS < 0) & (dual_bound_BS < pg_BS)
        pg_BS = torch.where(dual_clipped_BS, dual_bound_BS, pg_BS)
    return pg_BS, dual_clipped_BS


def importance_weights(
    prev_BS: torch.Tensor, gen_BS: torch.Tensor, masks: Masks, cfg: ClippedPGLossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pi_prev / pi_gen per token (or per sequence for GSPO), optionally truncated; plus filter metrics."""
    mask_BS = masks.mask_BS
    if cfg.sequence_level_importance_ratios:
        log_w_B = masked_sum(prev_BS - gen_BS, mask_BS, dim=-1)
        weights = torch.exp(log_w_B).unsqueeze(-1).expand_as(prev_BS)
    else:
        weights = torch.exp(prev_BS - gen_BS)
    # A non-finite weight means the two backends disagree completely on a token; drop it, don't explode.
    weights = _finite_or_zero(weights)
    upper = cfg.truncated_importance_sampling_ratio
    if upper is None:
        return weights, {}
    lower = cfg.truncated_importance_sampling_ratio_min
    kind = cfg.truncated_importance_sampling_type or "tis"
    if kind == "tis":
        return weights.clamp(max=upper), {}
    assert lower is not None  # the config validator requires it for icepop and seq-mask-tis
    if kind == "icepop":
        kept_BS = ((weights >= lower) & (weights <= upper)).float()
        return weights * kept_BS, {"is_oob_ratio": masks.token_mean(1.0 - kept_BS)}
    # seq-mask-tis: drop whole sequences whose geometric-mean weight leaves [lower, upper].
    log_w_BS = _finite_or_zero(prev_BS - gen_BS)
    geo_mean_B = torch.exp(masked_mean(log_w_BS, masks.token_mask_BS, dim=-1))
    kept_B = ((geo_mean_B >= lower) & (geo_mean_B <= upper)).float()
    return weights * kept_B.unsqueeze(-1), {"is_oob_ratio": masks.seq_mean(1.0 - kept_B)}


def clipped_pg_loss(x: PGInputs, masks: Masks, cfg: ClippedPGLossConfig) -> PGTerms:
    """The clipped policy-gradient loss with its KL penalty (see ``ClippedPGLossFn`` for the formula)."""
    token_level = cfg.token_level_loss
    if x.ref_BS is not None:
        kl = masks.mean(reference_kl_BS(x, cfg), token_level=token_level)
    else:
        kl = torch.zeros((), device=x.curr_BS.device)
    ratios_BS, clamped_BS = policy_ratios(x, masks.token_mask_BS, cfg)
    pg_BS, dual_clipped_BS = pg_objective_BS(x, ratios_BS, clamped_BS, cfg)
    is_weights_BS, is_metrics = importance_weights(x.prev_BS, x.gen_BS, masks, cfg)
    if cfg.use_importance_sampling_correction:
        pg_BS = is_weights_BS * pg_BS
    actor_loss = masks.mean(pg_BS, token_level=token_level)
    return PGTerms(
        loss=actor_loss + cfg.reference_policy_kl_penalty * kl,
        actor_loss=actor_loss,
        kl=kl,
        ratios_BS=ratios_BS,
        clamped_BS=clamped_BS,
        dual_clipped_BS=dual_clipped_BS,
        is_weights_BS=is_weights_BS,
        is_metrics=is_metrics,
    )


def ratio_metrics(x: PGInputs, terms: PGTerms, masks: Masks, cfg: ClippedPGLossConfig) -> dict[str, float]:
    """How far the policy moved from pi_prev this step, and how often the clip stopped a token's gradient."""
    ratios_BS, clamped_BS = terms.ratios_BS.detach(), terms.clamped_BS.detach()
    mask_BS = masks.mask_BS
    ratio_min, ratio_max = masked_min_max(ratios_BS, mask_BS)
    clamped_min, clamped_max = masked_min_max(clamped_BS, mask_BS)
    # A token is clipped when the clipped branch wins and stops its gradient.
    if cfg.disable_ppo_ratio or cfg.force_on_policy_ratio:
        clipped_BS = torch.zeros_like(mask_BS)
    else:
        a_BS = x.advantages_BS
        clipped_BS = (
            ((a_BS > 0) & (ratios_BS > clamped_BS)) | ((a_BS < 0) & (ratios_BS < clamped_BS))
        ).float()
    return {
        "probs_ratio": masks.token_mean(ratios_BS).item(),
        "probs_ratio_clamped": masks.token_mean(clamped_BS).item(),
        "probs_ratio_min": ratio_min,
        "probs_ratio_max": ratio_max,
        "probs_ratio_clamped_min": clamped_min,
        "probs_ratio_clamped_max": clamped_max,
        "clipped_fraction": masks.token_mean(clipped_BS).item(),
        "dual_clipped_fraction": masks.token_mean(terms.dual_clipped_BS.float()).item(),
    }


def mismatch_metrics(x: PGInputs, terms: PGTerms, masks: Masks, cfg: ClippedPGLossConfig) -> dict[str, float]:
    """How the training backend's log-probabilities (pi_prev) differ from the sampler's (pi_gen)."""
    prev_BS, gen_BS, kl_type = x.prev_BS, x.gen_BS, cfg.reference_policy_kl_type
    # Jensen-Shannon divergence between the training and generation distributions on the sampled token.
    log_mix_BS = torch.logaddexp(prev_BS, gen_BS) - math.log(2.0)
    js_BS = 0.5 * (unclamped_kl(log_mix_BS, prev_BS, "k3") + unclamped_kl(log_mix_BS, gen_BS, "k3"))
    if cfg.sequence_level_importance_ratios:
        # Every token of a sequence carries its sequence's weight; take the first column.
        is_weights_BS = terms.is_weights_BS
        per_seq_B = (
            is_weights_BS[:, 0] if is_weights_BS.shape[1] > 0 else torch.zeros_like(masks.sample_mask_B)
        )
        sampling_ratio = masks.seq_mean(per_seq_B)
    else:
        sampling_ratio = masks.token_mean(terms.is_weights_BS)
    return {
        # NeMo RL's definition: mean over valid tokens of exp(|log pi_prev - log pi_gen|), >= 1.
        "token_mult_prob_error": masks.token_mean(torch.exp((prev_BS - gen_BS).abs() * masks.mask_BS)).item(),
        # KL(pi_gen || pi_prev), estimated on tokens sampled from pi_gen.
        "gen_kl_error": masks.token_mean(unclamped_kl(gen_BS, prev_BS, kl_type)).item(),
        # KL(pi_prev || pi_gen), same samples.
        "policy_kl_error": masks.token_mean(unclamped_kl(prev_BS, gen_BS, kl_type)).item(),
        "js_divergence_error": masks.token_mean(js_BS).item(),
        "sampling_importance_ratio": sampling_ratio.item(),
        # E_{pi_gen}[-(pi_curr / pi_gen) log pi_curr]: the current policy's entropy from sampled tokens.
        "approx_entropy": masks.token_mean(-torch.exp(x.curr_BS - gen_BS) * x.curr_BS).item(),
    }


def clipped_pg_metrics(
    next_token_logits_BTV: torch.Tensor, x: PGInputs, terms: PGTerms, masks: Masks, cfg: ClippedPGLossConfig
) -> dict[str, float]:
    """Diagnostics (NeMo RL names), each an additive share except ``*_min`` / ``*_max``; ``x.curr_BS`` is
    detached by the caller."""
    return {
        **ratio_metrics(x, terms, masks, cfg),
        **mismatch_metrics(x, terms, masks, cfg),
        # Exact entropy of the current policy's next-token distribution at the trained positions.
        "entropy": masks.token_mean(token_entropy(next_token_logits_BTV.detach())).item(),
        "num_valid_samples": masks.sample_mask_B.sum().item(),
        "num_valid_tokens": masks.mask_BS.sum().item(),
        **{name: value.item() for name, value in terms.is_metrics.items()},
        "loss": terms.loss.item(),
        "actor_loss": terms.actor_loss.item(),
        "kl_penalty": terms.kl.item(),
    }


# --- clipped value loss (PPO's critic) ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ValueTerms:
    """The critic's clipped value loss and the per-token pieces its metrics read."""

    loss: torch.Tensor
    clipped_BS: torch.Tensor
    """True where the clipped squared error is the larger one (the clip stopped the token's gradient)."""


def clipped_value_loss(
    values_BS: torch.Tensor,
    old_values_BS: torch.Tensor,
    returns_BS: torch.Tensor,
    masks: Masks,
    *,
    scale: float,
    cliprange: float | None,
    token_level: bool,
) -> ValueTerms:
    """``0.5 * scale * mean(max((V - R)^2, (V_clip - R)^2))`` with ``V_clip = clamp(V, V_old - c, V_old + c)``.

    ``values_BS`` are the critic's predictions now, ``old_values_BS`` those the returns were computed with
    (before this step's updates), ``returns_BS`` the GAE value targets. ``cliprange`` ``None`` or <= 0 drops
    the clipped branch (plain half squared error), as NeMo RL's ``value_loss_fn.cliprange`` does. The mean
    is over the global batch's valid tokens (``token_level``) or per sequence then over the sequences.
    """
    values_BS = at_least_fp32(values_BS)
    returns_BS = returns_BS.to(values_BS.dtype)
    unclipped_BS = (values_BS - returns_BS) ** 2
    if cliprange is not None and cliprange > 0:
        old_BS = old_values_BS.to(values_BS.dtype)
        clamped_values_BS = torch.clamp(values_BS, old_BS - cliprange, old_BS + cliprange)
        clipped_error_BS = (clamped_values_BS - returns_BS) ** 2
        squared_error_BS = torch.maximum(unclipped_BS, clipped_error_BS)
        clipped_BS = (clipped_error_BS > unclipped_BS).detach()
    else:
        squared_error_BS = unclipped_BS
        clipped_BS = torch.zeros_like(unclipped_BS, dtype=torch.bool)
    loss = 0.5 * scale * masks.mean(squared_error_BS, token_level=token_level)
    return ValueTerms(loss=loss, clipped_BS=clipped_BS)


def value_metrics(
    values_BS: torch.Tensor, returns_BS: torch.Tensor, terms: ValueTerms, masks: Masks
) -> dict[str, float]:
    """The critic's diagnostics (NeMo RL names), token shares except ``values_min`` / ``values_max``.

    ``returns_sq_mean`` and ``residual_sq_mean`` are there so that :func:`explained_variance` can be taken
    over the whole batch once the shares of all micro-batches are summed.
    """
    values_BS, returns_BS = values_BS.detach(), returns_BS.detach().to(values_BS.dtype)
    values_min, values_max = masked_min_max(values_BS, masks.mask_BS)
    return {
        "loss": terms.loss.item(),
        "vf_clipfrac": masks.token_mean(terms.clipped_BS.to(values_BS.dtype)).item(),
        "returns_mean": masks.token_mean(returns_BS).item(),
        "values_mean": masks.token_mean(values_BS).item(),
        "values_min": values_min,
        "values_max": values_max,
        "returns_sq_mean": masks.token_mean(returns_BS**2).item(),
        "residual_sq_mean": masks.token_mean((returns_BS - values_BS) ** 2).item(),
        "num_valid_samples": masks.sample_mask_B.sum().item(),
    }


EXPLAINED_VARIANCE_MIN_VAR = 1e-8
"""Floor of the returns' variance in :func:`explained_variance`, so constant returns do not divide by 0."""


def explained_variance(
    returns_mean: float, values_mean: float, returns_sq_mean: float, residual_sq_mean: float
) -> float:
    """``1 - Var(R - V) / Var(R)`` over the batch, from the summed shares of :func:`value_metrics`.

    1 is a perfect critic, 0 one no better than the mean return, negative one worse than that.
    """
    returns_var = returns_sq_mean - returns_mean**2
    residual_var = residual_sq_mean - (returns_mean - values_mean) ** 2
    return 1.0 - residual_var / max(returns_var, EXPLAINED_VARIANCE_MIN_VAR)


# --- preference pairs ------------------------------------------------------------------------------------


def pair_halves(values_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a batch of interleaved preference pairs into (chosen, rejected): rows 0, 2, 4... are chosen."""
    if values_B.shape[0] % 2 != 0:
        raise ValueError(
            f"preference batches interleave (chosen, rejected) pairs, so their size must be even; got "
            f"{values_B.shape[0]}. Keep micro-batch sizes even."
        )
    return values_B[0::2], values_B[1::2]


def pair_mask_and_count(
    sample_mask_B: torch.Tensor, global_valid_seqs: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_mask_P, global_pairs): a pair is valid where its chosen row is; ``global_valid_seqs`` / 2 pairs.

    ``global_pairs`` takes ``like``'s dtype and device.
    """
    pair_mask_P, _ = pair_halves(sample_mask_B)
    global_pairs = torch.as_tensor(global_valid_seqs, dtype=like.dtype, device=like.device) / 2
    return pair_mask_P, global_pairs


def preference_terms(
    rewards_B: torch.Tensor, sample_mask_B: torch.Tensor, global_valid_seqs: torch.Tensor, beta: float
) -> dict[str, torch.Tensor]:
    """Bradley-Terry terms of interleaved pairs' rewards: ``preference_loss`` = -log sigmoid(beta * margin)
    and the pairwise ``accuracy``, mean rewards and valid pair count, each a share over the valid pairs."""
    chosen_P, rejected_P = pair_halves(rewards_B)
    pair_mask_P, global_pairs = pair_mask_and_count(sample_mask_B, global_valid_seqs, rewards_B)
    margin_P = chosen_P - rejected_P

    def pair_mean(values_P: torch.Tensor) -> torch.Tensor:
        return masked_mean(values_P, pair_mask_P, global_normalization_factor=global_pairs)

    return {
        "preference_loss": pair_mean(-F.logsigmoid(beta * margin_P)),
        "accuracy": pair_mean((margin_P > 0).float()),
        "rewards_chosen_mean": pair_mean(chosen_P),
        "rewards_rejected_mean": pair_mean(rejected_P),
        "num_valid_samples": pair_mask_P.sum(),
    }


def dpo_loss(
    logprobs_BS: torch.Tensor, ref_BS: torch.Tensor, mask_BS: torch.Tensor, masks: Masks, cfg: DPOLossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's weighted preference and SFT terms (see ``DPOLossFn``); returns the loss and the terms."""
    num_tokens_B = mask_BS.sum(dim=-1).clamp(min=1)
    rewards_B = masked_sum(logprobs_BS - ref_BS, mask_BS, dim=-1)
    if cfg.preference_average_log_probs:
        rewards_B = rewards_B / num_tokens_B
    terms = preference_terms(
        rewards_B, masks.sample_mask_B, masks.global_valid_seqs, beta=cfg.reference_policy_kl_penalty
    )
    sft_nll_B = -masked_sum(logprobs_BS, mask_BS, dim=-1)
    if cfg.sft_average_log_probs:
        sft_nll_B = sft_nll_B / num_tokens_B
    sft_chosen_P, _ = pair_halves(sft_nll_B)
    pair_mask_P, global_pairs = pair_mask_and_count(masks.sample_mask_B, masks.global_valid_seqs, logprobs_BS)
    sft_loss = masked_mean(sft_chosen_P, pair_mask_P, global_normalization_factor=global_pairs)
    loss = cfg.preference_loss_weight * terms["preference_loss"] + cfg.sft_loss_weight * sft_loss
    return loss, {**terms, "sft_loss": sft_loss}


# --- top-k distillation ----------------------------------------------------------------------------------


def distillation_kls(
    logits_BSV: torch.Tensor,
    teacher_BSK: torch.Tensor,
    indices_BSK: torch.Tensor,
    cfg: DistillationLossConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kl_BS, forward_BS, reverse_BS) between the teacher's log-probabilities ``teacher_BSK`` on its top-k
    tokens ``indices_BSK`` and the student's ``logits_BSV``; ``kl_BS`` mixes them as ``cfg.kl_type`` says."""
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
        reverse_BS = reverse_BS + neg_entropy_rest_BS - LOG_TEACHER_OUTSIDE_TOPK * mass_rest_BS
    if cfg.kl_type == "forward":
        return forward_BS, forward_BS, reverse_BS
    if cfg.kl_type == "reverse":
        return reverse_BS, forward_BS, reverse_BS
    return cfg.mixed_kl_weight * forward_BS + (1.0 - cfg.mixed_kl_weight) * reverse_BS, forward_BS, reverse_BS
