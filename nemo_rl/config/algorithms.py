"""Schemas of the algorithm sections: ``sft``, ``grpo``, ``dpo``, ``rm`` and ``distillation`` (``ppo`` is in
:mod:`nemo_rl.config.ppo`).

Every loop's section inherits its step budget, validation schedule and seed from :class:`LoopConfig`; the
loops over a fixed data set add batch-wise validation (:class:`SupervisedLoopConfig`), the loops that sample
add prompt counts and sampled validation (:class:`RolloutLoopConfig`), and the policy-gradient loops (GRPO,
PPO) their reward transforms and dynamic sampling (:class:`PolicyGradientLoopConfig`). Each key is declared, with its
default and its docstring, in exactly one of these classes.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from pydantic import Field, field_validator, model_validator

from nemo_rl.config.agent import AgentConfig
from nemo_rl.config.base import ConfigModel
from nemo_rl.config.compat import AdvantageEstimatorConfig
from nemo_rl.config.loss import DPOLossConfig

NO_STEP_LIMIT = 1_000_000
"""``max_num_steps`` of a run bounded by its epochs alone (also what NeMo RL's ``max_num_steps: -1`` reads as)."""


class LoopConfig(ConfigModel):
    """What every training loop's section holds: the step budget, when to validate, and the seed."""

    max_num_epochs: int = Field(default=1, ge=1)
    """Passes over the training set; training stops at whichever of this and ``max_num_steps`` comes first."""

    max_num_steps: int = Field(default=NO_STEP_LIMIT, ge=1)
    """Optimizer steps to run in total (a resumed run counts the steps already taken); -1 (NeMo RL's
    spelling of "no step limit") trains for ``max_num_epochs`` epochs."""

    val_period: int = Field(default=10, ge=0)
    """Validate every this many steps; 0 disables periodic validation."""

    val_at_start: bool = False
    """Validate once before the first training step."""

    val_at_end: bool = False
    """Also validate after the last step when ``val_period`` does not fall on it, so the final checkpoint
    carries validation metrics."""

    seed: int = 42
    """Seed of data shuffling, sampling and model initialisation."""

    @field_validator("max_num_steps", mode="before")
    @classmethod
    def _no_step_limit(cls, value: Any) -> Any:
        return NO_STEP_LIMIT if value == -1 else value


class SupervisedLoopConfig(LoopConfig):
    """A loop over a fixed data set (SFT, DPO, RM): validation runs the loss over held-out batches."""

    val_batches: int = Field(default=8, ge=0)
    """Validation batches per validation run; 0 (or NeMo RL's -1) uses the whole validation set."""

    val_global_batch_size: int = Field(default=32, ge=1)
    """Sequences per validation batch, summed over data-parallel ranks (preference pairs for DPO and RM)."""

    val_micro_batch_size: int = Field(default=1, ge=1)
    """Sequences per validation forward pass on one rank (preference pairs for DPO and RM)."""

    export_dir: str | None = None
    """Where the final weights are exported as a Hugging Face folder (safetensors, config, tokenizer; a
    reward model loads with ``AutoModelForSequenceClassification``); ``None`` uses
    ``<checkpointing.checkpoint_dir>/hf_final``."""

    @field_validator("val_batches", mode="before")
    @classmethod
    def _whole_validation_set(cls, value: Any) -> Any:
        return 0 if value == -1 else value


class SFTConfig(SupervisedLoopConfig):
    """The supervised fine-tuning loop."""

    only_unmask_final: Literal[False] = False
    """Train only on the final assistant turn; not built here: must be false (every assistant turn is
    trained)."""


class PreferenceLoopConfig(SupervisedLoopConfig):
    """A loop over preference pairs (DPO, RM). ``policy.train_global_batch_size`` and
    ``policy.train_micro_batch_size`` count pairs; the workers see twice as many sequences, a pair's chosen
    and rejected responses always in one micro-batch."""

    group_pairs_by_prompt: int = Field(default=0, ge=0)
    """Serve up to this many pairs of one prompt together (0: every pair shuffled on its own): each prompt's
    pairs are cut into groups of this size, each epoch shuffles the groups, and a group's pairs stay
    consecutive in a batch. With ``policy.shared_prefix`` and its ``dedupe_rows``, a group's prompt and its
    repeated chosen response then run once; large groups make batches less varied (fewer prompts each)."""


class RolloutLoopConfig(LoopConfig):
    """A loop that samples responses to prompts (GRPO, distillation): validation samples and scores them."""

    num_prompts_per_step: int = Field(default=32, ge=1)
    """Distinct prompts sampled per step."""

    num_generations_per_prompt: int = Field(default=1, ge=1)
    """Responses sampled per prompt (GRPO's own default and bound override this)."""

    max_rollout_turns: int = Field(default=1, ge=1)
    """Generate / environment-step turns per rollout (1 = single turn)."""

    max_val_samples: int = Field(default=256, ge=1)
    """Validation prompts per validation run."""

    val_batch_size: int = Field(default=256, ge=1)
    """Validation prompts per generation call."""

    @property
    def samples_per_step(self) -> int:
        """Responses trained on per step: ``num_prompts_per_step`` x ``num_generations_per_prompt``."""
        return self.num_prompts_per_step * self.num_generations_per_prompt


class RewardShapingConfig(ConfigModel):
    """DAPO's overlong reward shaping (NeMo RL's ``grpo.reward_shaping``), applied to each response's reward
    before advantages.

    With ``stop_properly_penalty_coef`` set, the reward of a truncated response is multiplied by it. Otherwise
    a response longer than ``max_response_length - overlong_buffer_length`` tokens (its first assistant
    turn) loses ``overlong_buffer_penalty`` per ``overlong_buffer_length`` tokens beyond that."""

    enabled: bool = False
    """Shape rewards."""

    overlong_buffer_length: int = Field(default=128, ge=1)
    """Tokens before ``max_response_length`` over which the penalty ramps up to ``overlong_buffer_penalty``."""

    overlong_buffer_penalty: float = Field(default=1.0, ge=0.0)
    """Penalty reached at ``max_response_length`` tokens."""

    max_response_length: int | None = Field(default=None, ge=1)
    """Response length of the full penalty (NeMo RL's recipes use ``policy.max_total_sequence_length``);
    needed when ``enabled`` unless ``stop_properly_penalty_coef`` is set."""

    stop_properly_penalty_coef: float | None = Field(default=None, ge=0.0, le=1.0)
    """Factor on the reward of truncated responses instead of the length penalty; ``None`` uses the length
    penalty."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.enabled and self.stop_properly_penalty_coef is None and self.max_response_length is None:
            raise ValueError(
                "reward_shaping.enabled=true (grpo or ppo) needs reward_shaping.max_response_length (or "
                "stop_properly_penalty_coef)"
            )
        return self


class RewardScalingConfig(ConfigModel):
    """Linear reward scaling (NeMo RL's ``grpo.reward_scaling``): rewards are clamped to
    [``source_min``, ``source_max``] and mapped onto [``target_min``, ``target_max``] before reward shaping
    and advantages."""

    enabled: bool = False
    """Scale rewards."""

    source_min: float = 0.0
    """Reward mapped to ``target_min`` (lower rewards are clamped to it)."""

    source_max: float = 1.0
    """Reward mapped to ``target_max`` (higher rewards are clamped to it)."""

    target_min: float = 0.0
    """Lower end of the scaled range."""

    target_max: float = 1.0
    """Upper end of the scaled range."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.source_max <= self.source_min:
            raise ValueError(
                f"reward_scaling.source_max={self.source_max} must exceed source_min={self.source_min} (grpo or ppo)"
            )
        return self


class PolicyGradientLoopConfig(RolloutLoopConfig):
    """A loop that trains the policy on its scored samples with the clipped policy-gradient loss (GRPO, PPO):
    reward scaling and shaping, overlong filtering and DAPO's dynamic sampling."""

    _SECTION: ClassVar[str] = "grpo"
    """The section's name in messages."""

    val_greedy: bool = False
    """Decode validation responses greedily instead of sampling with ``policy.generation`` settings."""

    overlong_filtering: bool = False
    """Exclude truncated responses (no end of sequence within the budget) from the loss."""

    use_dynamic_sampling: bool = False
    """DAPO's dynamic sampling: prompt groups whose responses all earn the same reward (no learning signal)
    are dropped, and further batches of ``batch_multiplier`` x ``num_prompts_per_step`` prompts are
    generated until ``num_prompts_per_step`` x ``num_generations_per_prompt`` responses remain (surplus
    groups are discarded)."""

    dynamic_sampling_max_gen_batches: int = Field(default=10, ge=1)
    """Most generation batches one step may draw under dynamic sampling; a step that still lacks responses
    with distinct rewards then fails (raise it, ``batch_multiplier`` or ``num_generations_per_prompt``)."""

    batch_multiplier: float = Field(default=1.0, ge=1.0)
    """Prompts per generation batch under dynamic sampling, as a multiple of ``num_prompts_per_step``
    (rounded down); must be 1 without it."""

    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    """DAPO's overlong reward shaping, applied after ``reward_scaling``."""

    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    """Linear reward scaling, applied before ``reward_shaping`` and advantages."""

    @model_validator(mode="after")
    def _check_batch_multiplier(self) -> Self:
        if self.batch_multiplier != 1 and not self.use_dynamic_sampling:
            raise ValueError(
                f"{self._SECTION}.batch_multiplier={self.batch_multiplier} over-generates prompts for dynamic sampling: set "
                f"{self._SECTION}.use_dynamic_sampling=true or {self._SECTION}.batch_multiplier=1"
            )
        return self

    @property
    def prompts_per_generation_batch(self) -> int:
        """Prompts the loader yields per generation batch: ``num_prompts_per_step``, times
        ``batch_multiplier`` under dynamic sampling."""
        return int(self.num_prompts_per_step * self.batch_multiplier)


class AsyncGRPOConfig(ConfigModel):
    """NeMo RL's ``grpo.async_grpo``: generation runs ahead of training on its own slots.

    The generation workers keep sampling prompt groups into a bounded buffer while the policy trains; each
    group carries the policy version (optimizer steps taken) of the weights that sampled it. A step trains on
    groups at most ``max_trajectory_age_steps`` versions older than the weights it updates and drops older
    ones. Needs non-colocated generation (``policy.generation.colocated.enabled=false``) and the
    importance-sampling correction of the loss (``loss_fn.use_importance_sampling_correction=true``); see
    ``docs/algorithms/grpo.md``."""

    enabled: bool = False
    """Overlap generation with training (asynchronous GRPO)."""

    max_trajectory_age_steps: int = Field(default=1, ge=1)
    """Oldest trajectories trained on, in optimizer steps between the weights that sampled them and the
    weights being updated; older groups are dropped (and counted). Also bounds how far generation runs ahead:
    the buffer holds ``max_trajectory_age_steps`` steps' worth of groups."""

    in_flight_weight_updates: bool = False
    """Apply new weights between decode steps of the requests already running, without draining them (the
    embedded engine and vLLM); otherwise they are applied at the next generation call, and each batch is
    sampled by a version fixed by its step, so that a run repeats exactly (in flight, timing decides)."""

    recompute_kv_cache_after_weight_updates: bool = False
    """After an in-flight update, recompute the running requests' KV cache with the new weights instead of
    keeping the keys and values the old weights computed. Needs ``in_flight_weight_updates``."""

    max_generation_failures: int = Field(default=0, ge=0)
    """Failed generation or scoring batches tolerated in a run; a failed batch's prompts are sampled again,
    and the failure after this many ends the run with its error."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.recompute_kv_cache_after_weight_updates and not self.in_flight_weight_updates:
            raise ValueError(
                "grpo.async_grpo.recompute_kv_cache_after_weight_updates applies to in-flight weight updates: "
                "set grpo.async_grpo.in_flight_weight_updates=true or recompute_kv_cache_after_weight_updates=false"
            )
        return self


class GRPOConfig(PolicyGradientLoopConfig):
    """The GRPO loop: sampling, scoring, advantage estimation and policy updates."""

    num_generations_per_prompt: int = Field(default=16, ge=2)
    """Responses sampled per prompt (at least 2: advantages compare responses within a prompt's group)."""

    deduplicate_multimodal_data: bool = False
    """Accepted, no effect here: a prompt's group always shares one copy of its images (the rows hold the same
    tensors, which Ray's pickling sends once per call); NeMo RL makes that sharing a transfer-size knob."""

    debug_payload_metrics: bool = False
    """Accepted, no effect here: debug telemetry of NeMo RL's Ray payload sizes."""

    normalize_rewards: bool = True
    """Divide advantages by the reward standard deviation of the prompt's group."""

    use_leave_one_out_baseline: bool = True
    """Baseline each response with the mean reward of the *other* responses to its prompt."""

    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)
    """Asynchronous GRPO: generation overlapping training, with a bound on the trained trajectories' age."""

    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Rollouts by external agent programs through an OpenAI-compatible endpoint serving the policy."""

    adv_estimator: AdvantageEstimatorConfig = Field(default_factory=AdvantageEstimatorConfig)
    """The advantage estimator (only ``grpo`` is built)."""

    val_start_at: Literal[-1] = -1
    """First step eligible for periodic validation; not built here: must be -1 (no delay)."""

    val_num_generations_per_prompt: Literal[1] = 1
    """Validation responses per prompt (pass@k); not built here: must be 1."""

    advantage_clip_low: None = None
    """Lower clip of advantages; not built here: must be null."""

    advantage_clip_high: None = None
    """Upper clip of advantages; not built here: must be null."""

    stop_at_validation_metric: None = None
    """Early stop on a validation metric; not built here: must be null."""

    stop_at_validation_threshold: None = None
    """Threshold of ``stop_at_validation_metric``; not built here: must be null."""

    seq_logprob_error_threshold: None = None
    """Drop sequences whose log-prob error exceeds this; not built here: must be null."""

    invalid_tool_call_advantage: None = None
    """Advantage of invalid tool-call tokens; not built here: must be null."""

    malformed_thinking_advantage: None = None
    """Advantage of malformed thinking tags; not built here: must be null."""

    @model_validator(mode="before")
    @classmethod
    def _null_sections_are_defaults(cls, data: Any) -> Any:
        # Some NeMo RL recipes write `async_grpo: null` for "off": the section's defaults.
        if isinstance(data, dict) and "async_grpo" in data and data["async_grpo"] is None:
            data = {**data, "async_grpo": {}}
        return data

    @model_validator(mode="after")
    def _check_async(self) -> Self:
        if self.async_grpo.enabled and self.agent.enabled:
            raise ValueError(
                "grpo.async_grpo.enabled=true and grpo.agent.enabled=true cannot be combined (the endpoint serves "
                "the weights of the step being rolled out): turn one of them off"
            )
        if self.async_grpo.enabled and self.use_dynamic_sampling:
            raise ValueError(
                "grpo.async_grpo.enabled=true and grpo.use_dynamic_sampling=true cannot be combined (a step's "
                "groups come from the trajectory buffer): turn one of them off"
            )
        return self

    @model_validator(mode="after")
    def _check_adv_estimator(self) -> Self:
        estimator = self.adv_estimator
        for key in ("normalize_rewards", "use_leave_one_out_baseline"):
            value = getattr(estimator, key)
            if value is not None and value != getattr(self, key):
                raise ValueError(
                    f"grpo.adv_estimator.{key}={value} differs from grpo.{key}={getattr(self, key)}: "
                    f"set both to the same value (or leave adv_estimator.{key} null)"
                )
        return self


class DistillationConfig(RolloutLoopConfig):
    """On-policy distillation (NeMo RL's ``distillation`` section): the student samples, the teacher scores.

    ``num_prompts_per_step`` x ``num_generations_per_prompt`` responses per step must be a multiple of
    ``policy.train_global_batch_size``.
    """

    topk_logits_k: int = Field(default=64, ge=1)
    """Teacher logits kept per position: the KL is taken on the teacher's ``k`` most likely next tokens."""


class DPOConfig(DPOLossConfig, PreferenceLoopConfig):
    """The DPO loop and its loss terms (NeMo RL's ``dpo`` section)."""


class RMConfig(PreferenceLoopConfig):
    """The Bradley-Terry reward-model loop (NeMo RL's ``rm`` section)."""
