"""Loss schemas: ``loss_fn`` of GRPO (clipped policy gradient) and of distillation, and the DPO loss terms."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.no_effect import refusal


class ClippedPGLossConfig(ConfigModel):
    """The clipped policy-gradient loss: PPO/GRPO clipping, optional dual clip, KL to the reference policy,
    and off-policy corrections. Key names and defaults follow NeMo RL's ``loss_fn`` section."""

    reference_policy_kl_penalty: float = Field(default=0.01, ge=0.0)
    """Weight of the KL(policy || reference) term added to the loss; 0 disables it (and the reference
    log-probs are then not read)."""

    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman): ``k1`` = -log r, ``k2`` = (log r)^2 / 2, ``k3`` = r - 1 - log r,
    with r = pi_ref / pi on the sampled token."""

    kl_input_clamp_value: float | None = Field(default=20.0, gt=0.0)
    """Clamp log r to [-v, v] before the KL estimator (keeps exp finite); ``None`` disables."""

    kl_output_clamp_value: float | None = Field(default=10.0, gt=0.0)
    """Clamp each token's KL estimate to [-v, v]; ``None`` disables."""

    ratio_clip_min: float = Field(default=0.2, ge=0.0, le=1.0)
    """Lower clip of the importance ratio: it is clamped to at least ``1 - ratio_clip_min``."""

    ratio_clip_max: float = Field(default=0.2, ge=0.0)
    """Upper clip of the importance ratio: it is clamped to at most ``1 + ratio_clip_max`` (DAPO's
    clip-higher uses a larger value than ``ratio_clip_min``)."""

    ratio_clip_c: float | None = Field(default=None, gt=1.0)
    """Dual-clip constant c (> 1, typically 3): for negative advantages the per-token loss is capped at
    ``-c * A``; ``None`` disables dual clipping."""

    use_on_policy_kl_approximation: bool = False
    """Weight each token's KL by pi_curr / pi_gen (detached) so the sampled estimate targets the KL under
    the current policy rather than under the generating policy."""

    use_importance_sampling_correction: bool = False
    """Multiply each token's loss by pi_prev / pi_gen (training vs generation backend mismatch; needed for
    off-policy / async rollouts)."""

    truncated_importance_sampling_ratio: float | None = Field(default=None, gt=0.0)
    """Upper bound of the importance-sampling weights (truncated IS); ``None`` leaves them unbounded.
    Needs ``use_importance_sampling_correction``."""

    truncated_importance_sampling_ratio_min: float | None = Field(default=None, ge=0.0)
    """Lower bound used by the ``icepop`` and ``seq-mask-tis`` filters."""

    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    """How the bound applies: ``tis`` (also what ``None`` means) clamps weights to the upper bound;
    ``icepop`` zeroes tokens whose weight is outside [min, max]; ``seq-mask-tis`` drops whole sequences
    whose geometric-mean weight is outside [min, max] and keeps raw token weights for the others."""

    token_level_loss: bool = True
    """Average the loss over all valid tokens of the batch (``True``), or per sequence first and then over
    sequences (``False``, needed for sequence-level ratios)."""

    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per sequence, exp(mean over its tokens of log pi_curr - log pi_prev), clipped as a
    whole; the importance-sampling weight becomes exp(sum of log pi_prev - log pi_gen). Needs
    ``token_level_loss: false``."""

    disable_ppo_ratio: bool = False
    """Plain REINFORCE: the per-token loss is ``-A * log pi_curr`` with no ratio and no clipping."""

    force_on_policy_ratio: bool = False
    """Force the ratio to exactly 1 (still differentiable), for one optimizer step per rollout."""

    use_kl_in_reward: Literal[False] = False
    """Accepted for NeMo RL recipes; only ``false`` (the KL term lives in the loss) is supported."""

    use_cispo: Literal[False] = False
    """CISPO (clipped importance-weight policy optimisation); not built here: must be false."""

    positive_example_nll_weight: float = 0.0
    """VAPO's NLL term on correct samples; not built here: must be 0."""

    @model_validator(mode="after")
    def _check_combinations(self) -> Self:
        if self.positive_example_nll_weight != 0.0:
            raise refusal("loss_fn.positive_example_nll_weight", "set loss_fn.positive_example_nll_weight=0")
        if self.sequence_level_importance_ratios and self.token_level_loss:
            raise ValueError(
                "loss_fn.sequence_level_importance_ratios (GSPO) averages per sequence: "
                "set loss_fn.token_level_loss=false as well."
            )
        if self.disable_ppo_ratio and (self.ratio_clip_c is not None or self.force_on_policy_ratio):
            raise ValueError(
                "loss_fn.disable_ppo_ratio has no importance ratio to clip or force: "
                "set loss_fn.ratio_clip_c=null and loss_fn.force_on_policy_ratio=false."
            )
        if self.disable_ppo_ratio and self.sequence_level_importance_ratios:
            raise ValueError(
                "loss_fn.disable_ppo_ratio and loss_fn.sequence_level_importance_ratios exclude each "
                "other: pick REINFORCE or GSPO."
            )
        if self.truncated_importance_sampling_ratio is not None:
            if not self.use_importance_sampling_correction:
                raise ValueError(
                    "loss_fn.truncated_importance_sampling_ratio bounds the importance-sampling weights: "
                    "set loss_fn.use_importance_sampling_correction=true or the ratio to null."
                )
            needs_min = self.truncated_importance_sampling_type in ("icepop", "seq-mask-tis")
            if needs_min and self.truncated_importance_sampling_ratio_min is None:
                raise ValueError(
                    f"loss_fn.truncated_importance_sampling_type={self.truncated_importance_sampling_type!r} "
                    "filters by [min, max]: set loss_fn.truncated_importance_sampling_ratio_min."
                )
            if (
                self.truncated_importance_sampling_type == "seq-mask-tis"
                and self.sequence_level_importance_ratios
            ):
                raise ValueError(
                    "loss_fn.truncated_importance_sampling_type='seq-mask-tis' masks sequences but keeps "
                    "token-level weights: it cannot be combined with sequence_level_importance_ratios."
                )
        return self


class DPOLossConfig(ConfigModel):
    """The terms of the DPO loss (NeMo RL's ``dpo`` section names)."""

    reference_policy_kl_penalty: float = Field(default=0.05, gt=0.0)
    """beta: scale of the implicit reward, beta * (log pi - log pi_ref) summed (or averaged) over tokens."""

    preference_loss_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the preference (sigmoid) term."""

    sft_loss_weight: float = Field(default=0.0, ge=0.0)
    """Weight of an auxiliary negative log-likelihood on the chosen responses; 0 disables it."""

    preference_average_log_probs: bool = False
    """Average (instead of sum) the per-token log-ratio over the response when forming the reward."""

    sft_average_log_probs: bool = False
    """Average (instead of sum) the chosen response's token log-likelihoods in the SFT term."""


class DistillationLossConfig(ConfigModel):
    """The KL between a teacher's and the student's next-token distributions on the teacher's top-k tokens
    (NeMo RL's ``loss_fn`` section of on-policy distillation)."""

    kl_type: Literal["forward", "reverse", "mixed"] = "mixed"
    """``forward`` = KL(teacher || student) (mode covering), ``reverse`` = KL(student || teacher) (mode
    seeking), ``mixed`` = ``mixed_kl_weight`` * forward + (1 - ``mixed_kl_weight``) * reverse."""

    mixed_kl_weight: float = Field(default=0.5, ge=0.0, le=1.0)
    """Weight of the forward KL in ``mixed``."""

    zero_outside_topk: bool = False
    """``False``: renormalise both distributions over the teacher's top-k tokens. ``True``: the teacher has
    (almost) zero probability outside its top-k, and the student keeps its full-vocabulary probabilities, so
    the student is also pushed to move mass into the teacher's top-k."""


class ValueLossConfig(ConfigModel):
    """PPO's clipped value loss for the critic (NeMo RL's ``value_loss_fn`` section)::

        loss = scale * 0.5 * mean_t max((V_t - R_t)^2, (clip(V_t, V_old_t - c, V_old_t + c) - R_t)^2)

    over the response tokens of the batch, with ``R`` the GAE returns and ``V_old`` the values the returns
    were computed with."""

    scale: float = Field(default=0.4, gt=0.0)
    """Weight of the value loss (the critic's only loss, so it acts as a learning-rate multiplier)."""

    cliprange: float | None = Field(default=0.2, ge=0.0)
    """How far a value may move from the rollout's value before its error stops giving gradient; ``null`` or
    0 trains on the plain squared error."""
