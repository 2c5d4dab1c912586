"""The ``ppo`` section: PPO with a learned critic (NeMo RL's ``PPOConfig``; key names and defaults from its
``examples/configs/ppo_math_1B.yaml``).

The loop shares GRPO's sampling, reward transforms and dynamic sampling
(:class:`~nemo_rl.config.algorithms.PolicyGradientLoopConfig`); what is PPO's own is the advantage estimator
(GAE over the critic's values), the passes over each batch, the critic's warm-up and its warm start.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.algorithms import PolicyGradientLoopConfig
from nemo_rl.config.base import ConfigModel


class GAEConfig(ConfigModel):
    """NeMo RL's ``ppo.adv_estimator``: generalized advantage estimation over the critic's values, with VAPO's
    decoupled lambdas (arXiv:2504.05118); see :mod:`nemo_rl.algorithms.gae`."""

    name: Literal["gae"] = "gae"
    """The estimator: ``gae`` (the one PPO uses)."""

    gae_lambda: float = Field(default=0.95, ge=0.0, le=1.0)
    """Lambda of both the policy advantages and the value targets unless VAPO's keys decouple them."""

    gae_gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount per token."""

    normalize_advantages: bool = True
    """Whiten the policy advantages over the batch's response tokens."""

    gae_lambda_value: float | None = Field(default=None, ge=0.0, le=1.0)
    """Lambda of the critic's value targets (VAPO: 1.0, Monte-Carlo-like returns); ``null`` uses
    ``gae_lambda``."""

    gae_lambda_policy: float | None = Field(default=None, ge=0.0, le=1.0)
    """Lambda of the policy advantages; ``null`` uses ``gae_lambda`` (or the length-adaptive one)."""

    length_adaptive_alpha: float = Field(default=0.0, ge=0.0)
    """VAPO's length-adaptive policy lambda ``1 - 1 / (alpha * l)`` for a response of ``l`` tokens (VAPO:
    0.05); 0 disables it. Takes precedence over ``gae_lambda_policy``."""


class AsyncPPOConfig(ConfigModel):
    """NeMo RL's ``ppo.async_ppo``: generation running ahead of training. Not built for PPO here:
    ``enabled`` must be false (asynchronous GRPO is built; see docs/algorithms/ppo.md)."""

    enabled: Literal[False] = False
    """Not built here: must be false."""

    max_trajectory_age_steps: int = Field(default=1, ge=1)
    """Accepted, no effect while ``enabled`` is false."""

    warmup_generation_lead_steps: int | None = None
    """Accepted, no effect while ``enabled`` is false."""

    in_flight_weight_updates: bool = False
    """Accepted, no effect while ``enabled`` is false."""

    recompute_kv_cache_after_weight_updates: bool = False
    """Accepted, no effect while ``enabled`` is false."""

    drop_incomplete_targets_on_restore: bool = False
    """Accepted, no effect while ``enabled`` is false."""


class PPOConfig(PolicyGradientLoopConfig):
    """The PPO loop: sample, score, value the samples with the critic, GAE, then ``critic_ppo_epochs`` passes
    of the critic and ``ppo_epochs`` passes of the policy over the batch (NeMo RL's ``ppo`` section)."""

    _SECTION: ClassVar[str] = "ppo"

    ppo_epochs: int = Field(default=4, ge=1)
    """Passes of the policy over each rollout batch, each in mini-batches of ``policy.train_global_batch_size``
    (one optimizer step per mini-batch)."""

    critic_ppo_epochs: int | None = Field(default=None, ge=1)
    """Passes of the critic over each rollout batch, in mini-batches of ``value.train_global_batch_size``;
    ``null`` follows ``ppo_epochs``."""

    policy_training_start_step: int = Field(default=0, ge=0)
    """Steps of critic-only warm-up: before this step the policy is not trained (its weights stay as they
    are, and generation needs no refit), so the critic learns the initial policy's values first."""

    warm_start_value_checkpoint: str | None = None
    """A ``step_<n>`` folder of an earlier run whose ``value/`` checkpoint seeds the critic of a fresh run; a
    resumed run restores the critic from its own checkpoint and ignores this."""

    skip_reference_policy_logprobs_calculation: bool = False
    """Skip the reference policy's log-probs. They are computed only when the KL penalty is on
    (``loss_fn.reference_policy_kl_penalty > 0``), so this must then be false; with no KL term they are
    skipped either way."""

    adv_estimator: GAEConfig = Field(default_factory=GAEConfig)
    """GAE's settings."""

    async_ppo: AsyncPPOConfig = Field(default_factory=AsyncPPOConfig)
    """Asynchronous PPO (not built here)."""

    seq_logprob_error_threshold: None = None
    """Mask sequences whose generation/training log-prob error exceeds this; not built here: must be null
    (the error is logged as ``gen_kl_error``)."""

    @model_validator(mode="before")
    @classmethod
    def _null_sections_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("async_ppo", ...) is None:
            data = {**data, "async_ppo": {}}
        return data

    @property
    def critic_epochs(self) -> int:
        """The critic's passes over each batch (``critic_ppo_epochs``, or ``ppo_epochs`` when unset)."""
        return self.critic_ppo_epochs if self.critic_ppo_epochs is not None else self.ppo_epochs

    @model_validator(mode="after")
    def _check_warm_up(self) -> Self:
        if self.policy_training_start_step >= self.max_num_steps:
            raise ValueError(
                f"ppo.policy_training_start_step={self.policy_training_start_step} is not before "
                f"ppo.max_num_steps={self.max_num_steps}: the policy would never train; lower the warm-up"
            )
        return self
