"""Master configs: one per algorithm, composing the sections its driver script reads."""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import Field, model_validator

from nemo_rl.config.algorithms import DistillationConfig, DPOConfig, GRPOConfig, RMConfig, SFTConfig
from nemo_rl.config.base import ConfigModel
from nemo_rl.config.checkpointing import CheckpointingConfig
from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.compat import DataPlaneConfig, RewardPenaltiesConfig
from nemo_rl.config.data import PREFERENCE_DATASETS, DataConfig
from nemo_rl.config.env import EnvConfig
from nemo_rl.config.eval import EvalConfig, EvalDataConfig, EvalGenerationConfig
from nemo_rl.config.logger import LoggerConfig
from nemo_rl.config.loss import ClippedPGLossConfig, DistillationLossConfig, ValueLossConfig
from nemo_rl.config.no_effect import refusal
from nemo_rl.config.policy import PolicyConfig, RewardModelConfig, TokenizerConfig
from nemo_rl.config.ppo import PPOConfig
from nemo_rl.config.router_replay import refuse_router_replay


class TrainingRunConfig(ConfigModel):
    """The sections every training script reads besides its own: logging, checkpointing (of the trained
    policy: the student, in distillation) and the cluster."""

    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    """Metric logging backends."""

    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    """Checkpoint saving, retention and resume."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Worker slots (GPUs, or CPU slots without CUDA) and nodes."""

    @model_validator(mode="after")
    def _system_prompt_flag_reaches_the_chat_template(self) -> Self:
        # `data.add_system_prompt` is NeMo RL's flag for templates that add a default system prompt; every
        # chat-template call here reads `policy.tokenizer.chat_template_kwargs`, so the flag goes there.
        data, policy = getattr(self, "data", None), getattr(self, "policy", None)
        if (
            not isinstance(data, DataConfig)
            or not isinstance(policy, PolicyConfig)
            or not data.add_system_prompt
        ):
            return self
        kwargs = dict(policy.tokenizer.chat_template_kwargs or {})
        if kwargs.get("add_system_prompt", True) is not True:
            raise ValueError(
                "data.add_system_prompt=true but policy.tokenizer.chat_template_kwargs.add_system_prompt="
                f"{kwargs['add_system_prompt']}: set one of them"
            )
        policy.tokenizer.chat_template_kwargs = {**kwargs, "add_system_prompt": True}
        return self


class SFTMasterConfig(TrainingRunConfig):
    """Everything ``examples/run_sft.py`` reads."""

    sft: SFTConfig = Field(default_factory=SFTConfig)
    """The SFT loop."""

    policy: PolicyConfig
    """The trained model."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation data."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        refuse_router_replay("SFT", self.policy)
        return self


class GRPOMasterConfig(TrainingRunConfig):
    """Everything ``examples/run_grpo_math.py`` reads."""

    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    """The GRPO loop."""

    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    """The clipped policy-gradient loss."""

    policy: PolicyConfig
    """The trained model and its generation settings."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation prompts."""

    env: EnvConfig = Field(default_factory=EnvConfig)
    """Environments that score responses."""

    reward_penalties: RewardPenaltiesConfig = Field(default_factory=RewardPenaltiesConfig)
    """NeMo RL's reward zeroing for NeMo-Gym rollouts (not built here; every penalty must be false)."""

    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    """NeMo RL's TransferQueue data plane (not built here; ``enabled`` must be false)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_null_on_policy_distillation(cls, data: Any) -> Any:
        # NeMo RL's recipes carry `on_policy_distillation: null` (multi-teacher distillation inside GRPO, not
        # built here). Only null is accepted, and it is dropped: every top-level key here is a section.
        if isinstance(data, dict) and "on_policy_distillation" in data:
            if data["on_policy_distillation"] is not None:
                raise refusal("on_policy_distillation", "set on_policy_distillation=null")
            data = {k: v for k, v in data.items() if k != "on_policy_distillation"}
        return data

    @model_validator(mode="after")
    def _check(self) -> GRPOMasterConfig:
        _check_generation_placement(self.policy, self.cluster)
        _check_async_grpo(self)
        self.env.check_tool_turns(self.grpo.max_rollout_turns, "grpo.max_rollout_turns")
        if self.grpo.agent.enabled and self.policy.router_replay.enabled:
            raise ValueError(
                "policy.router_replay.enabled=true needs the sampler's routing, which external agents' turns "
                "(grpo.agent.enabled) do not carry: set one of them false"
            )
        if self.grpo.agent.enabled and self.env.tool_sections():
            name = sorted(self.env.tool_sections())[0]
            raise ValueError(
                f"env.{name}.tools would never run: with grpo.agent.enabled external agents roll the samples out "
                f"and call their own tools; set env.{name}.tools=[] or grpo.agent.enabled=false"
            )
        _check_reward_model_env(self.data, self.env)
        return self


def _check_reward_model_env(data: DataConfig, env: EnvConfig) -> None:
    if data.env_name == "reward_model" and not env.reward_model.enabled:
        raise ValueError(
            "data.env_name=reward_model scores the prompts with a reward model: set "
            "env.reward_model.enabled=true and env.reward_model.model_name (e.g. the export of run_rm.py)"
        )


def _check_async_grpo(config: GRPOMasterConfig) -> None:
    """Asynchronous GRPO needs generation slots of its own and the loss's correction for stale samples."""
    if not config.grpo.async_grpo.enabled:
        return
    generation = config.policy.generation
    if generation.colocated.enabled or generation.embedded_cfg.in_policy_workers:
        raise ValueError(
            "grpo.async_grpo.enabled=true overlaps generation with training, which colocated generation cannot "
            "do: set policy.generation.colocated.enabled=false (and its resources.gpus_per_node) and "
            "policy.generation.embedded_cfg.in_policy_workers=false"
        )
    if not config.loss_fn.use_importance_sampling_correction:
        raise ValueError(
            "grpo.async_grpo.enabled=true trains on responses sampled by older weights: set "
            "loss_fn.use_importance_sampling_correction=true"
        )
    async_cfg = config.grpo.async_grpo
    if generation.backend == "vllm" and async_cfg.recompute_kv_cache_after_weight_updates:
        raise ValueError(
            "grpo.async_grpo.recompute_kv_cache_after_weight_updates is built for the embedded engine: with "
            "policy.generation.backend=vllm set it false"
        )
    if (
        generation.backend == "vllm"
        and async_cfg.in_flight_weight_updates
        and generation.vllm_cfg.tensor_parallel_size > 1
    ):
        raise ValueError(
            "grpo.async_grpo.in_flight_weight_updates with policy.generation.vllm_cfg.tensor_parallel_size > 1 "
            "could load new weights at different steps on the ranks of one engine: set "
            "in_flight_weight_updates=false or tensor_parallel_size=1"
        )


class PPOMasterConfig(TrainingRunConfig):
    """Everything ``examples/run_ppo.py`` reads: GRPO's sections plus the critic (``value``) and its loss."""

    ppo: PPOConfig = Field(default_factory=PPOConfig)
    """The PPO loop."""

    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    """The policy's clipped policy-gradient loss."""

    value_loss_fn: ValueLossConfig = Field(default_factory=ValueLossConfig)
    """The critic's clipped value loss."""

    policy: PolicyConfig
    """The trained model and its generation settings."""

    value: PolicyConfig
    """The critic: the policy's architecture with a scalar head per token (Hugging Face
    ``AutoModelForSequenceClassification``, one output), on its own workers placed on the policy's slots, with
    its own optimizer, scheduler, layout and checkpoints. ``value.model_name`` is the policy's checkpoint (the
    head starts fresh) or a value model's. Its ``reward_model_cfg`` is always a regression head."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation prompts."""

    env: EnvConfig = Field(default_factory=EnvConfig)
    """Environments that score responses."""

    @model_validator(mode="before")
    @classmethod
    def _critic_is_a_value_model(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        value = data.get("value")
        if not isinstance(value, dict) or not value.get("model_name"):
            raise ValueError(
                "PPO needs a critic: add a value section with value.model_name (the policy's checkpoint, "
                "e.g. value.model_name=${policy.model_name}), as in examples/configs/ppo_math_1B.yaml"
            )
        head = value.get("reward_model_cfg") or {}
        if head.get("reward_model_type", "regression") != "regression":
            raise ValueError(
                f"value.reward_model_cfg.reward_model_type={head['reward_model_type']}: the critic is a "
                "regression head; set it to regression (or leave it out)"
            )
        # NeMo RL's Megatron recipe sets enabled=false ("only used for the DTensor value worker"): the critic
        # has its scalar head on either backend here, so the section is the same on both.
        value = {**value, "reward_model_cfg": RewardModelConfig(enabled=True, reward_model_type="regression")}
        return {**data, "value": value}

    @model_validator(mode="after")
    def _check(self) -> Self:
        _check_generation_placement(self.policy, self.cluster)
        refuse_router_replay("PPO", self.value, "value")
        self.env.check_tool_turns(self.ppo.max_rollout_turns, "ppo.max_rollout_turns")
        _check_reward_model_env(self.data, self.env)
        if (
            self.ppo.skip_reference_policy_logprobs_calculation
            and self.loss_fn.reference_policy_kl_penalty > 0
        ):
            raise ValueError(
                "ppo.skip_reference_policy_logprobs_calculation=true but loss_fn.reference_policy_kl_penalty="
                f"{self.loss_fn.reference_policy_kl_penalty} needs them: set one of them off"
            )
        if self.value.max_total_sequence_length < self.policy.max_total_sequence_length:
            raise ValueError(
                f"value.max_total_sequence_length={self.value.max_total_sequence_length} is shorter than the "
                f"policy's {self.policy.max_total_sequence_length}: the critic values every sampled sequence; "
                "set value.max_total_sequence_length=${policy.max_total_sequence_length}"
            )
        samples = self.ppo.samples_per_step
        for section, cfg in (("policy", self.policy), ("value", self.value)):
            if samples % cfg.train_global_batch_size != 0:
                raise ValueError(
                    f"ppo.num_prompts_per_step x ppo.num_generations_per_prompt = {samples} responses per step "
                    f"must be a multiple of {section}.train_global_batch_size={cfg.train_global_batch_size}"
                )
        return self


def _check_generation_placement(policy: PolicyConfig, cluster: ClusterConfig) -> None:
    """Non-colocated generation names its slots, and spans several nodes only on a multi-node cluster."""
    resources = policy.generation.colocated.resources
    if not policy.generation.colocated.enabled:
        if resources.gpus_per_node is None:
            raise ValueError(
                "policy.generation.colocated.enabled=false needs "
                "policy.generation.colocated.resources.gpus_per_node (slots reserved for generation)"
            )
        if (resources.num_nodes or 1) > 1 and cluster.num_nodes == 1:
            raise ValueError("non-colocated generation on several nodes needs cluster.num_nodes > 1")


class DistillationMasterConfig(TrainingRunConfig):
    """Everything ``examples/run_distillation_math.py`` reads."""

    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    """The on-policy distillation loop."""

    loss_fn: DistillationLossConfig = Field(default_factory=DistillationLossConfig)
    """The KL between teacher and student on the teacher's top-k tokens."""

    policy: PolicyConfig
    """The student: the trained model and its generation settings."""

    teacher: PolicyConfig
    """The teacher: a frozen model on its own workers, placed on the student's slots, that scores the
    student's samples (only its model, parallelism, batch sizes and precision are used). It must share the
    student's tokenizer and vocabulary."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation prompts."""

    env: EnvConfig = Field(default_factory=EnvConfig)
    """Environments that score responses (for the logged rewards and validation accuracy; the loss does not
    use them)."""

    @model_validator(mode="after")
    def _check(self) -> DistillationMasterConfig:
        _check_generation_placement(self.policy, self.cluster)
        refuse_router_replay("distillation", self.policy)
        refuse_router_replay("distillation", self.teacher, "teacher")
        self.env.check_tool_turns(self.distillation.max_rollout_turns, "distillation.max_rollout_turns")
        for section, cfg in (("policy", self.policy), ("teacher", self.teacher)):
            if cfg.generation.top_k is not None or cfg.generation.top_p < 1.0:
                # The workers score under the sampling distribution: top-k / top-p would put -inf on tokens
                # of the other model's top-k, and the KL would be infinite.
                raise ValueError(
                    f"{section}.generation.top_k={cfg.generation.top_k}, top_p={cfg.generation.top_p}: "
                    "distillation compares full next-token distributions; set top_k=null and top_p=1.0"
                )
        if self.teacher.generation.temperature != self.policy.generation.temperature:
            # Both models score at their generation temperature; different ones would distil a reshaped
            # teacher into a student trained at another scale.
            raise ValueError(
                f"teacher.generation.temperature={self.teacher.generation.temperature} differs from "
                f"policy.generation.temperature={self.policy.generation.temperature}: the teacher's logits and "
                "the student's are divided by these before the KL; set them equal"
            )
        samples = self.distillation.samples_per_step
        if samples % self.policy.train_global_batch_size != 0:
            raise ValueError(
                f"distillation.num_prompts_per_step x distillation.num_generations_per_prompt = {samples} "
                f"responses per step must be a multiple of policy.train_global_batch_size="
                f"{self.policy.train_global_batch_size}"
            )
        return self


def _check_preference_run(algorithm: str, policy: PolicyConfig, data: DataConfig, reward_model: bool) -> None:
    """Checks DPO and reward-model training share: preference data, pairs kept whole, the right head."""
    if data.dataset_name not in PREFERENCE_DATASETS:
        raise ValueError(
            f"{algorithm} trains on preference pairs: set data.dataset_name to one of "
            f"{', '.join(PREFERENCE_DATASETS)} (got {data.dataset_name})"
        )
    for section in ("dynamic_batching", "sequence_packing"):
        if getattr(policy, section).enabled:
            raise ValueError(
                f"{algorithm} keeps each pair's chosen and rejected responses in one micro-batch, which "
                f"token-budget micro-batches would split: set policy.{section}.enabled=false"
            )
    refuse_router_replay(algorithm, policy)
    if policy.reward_model_cfg.enabled != reward_model:
        raise ValueError(
            f"{algorithm} needs policy.reward_model_cfg.enabled={str(reward_model).lower()}"
            + (
                " (it trains a scalar reward head)"
                if reward_model
                else " (it trains the language-model head)"
            )
        )
    if reward_model and policy.reward_model_cfg.reward_model_type != "bradley_terry":
        raise ValueError(
            f"{algorithm} trains a Bradley-Terry reward model on preference pairs: set "
            "policy.reward_model_cfg.reward_model_type=bradley_terry (regression is PPO's value model)"
        )


class PreferenceMasterConfig(TrainingRunConfig):
    """What DPO and reward-model training both read: a policy trained on preference pairs.

    :class:`DPOMasterConfig` and :class:`RMMasterConfig` add their loop's section (``dpo`` / ``rm``) and name
    the head the policy trains (``_REWARD_MODEL``).
    """

    _ALGORITHM: ClassVar[str] = "Preference training"
    _REWARD_MODEL: ClassVar[bool] = False

    policy: PolicyConfig
    """The trained model; its batch sizes count preference pairs."""

    data: DataConfig = Field(default_factory=lambda: DataConfig(dataset_name="HelpSteer3"))
    """Preference pairs for training and validation."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        _check_preference_run(self._ALGORITHM, self.policy, self.data, reward_model=self._REWARD_MODEL)
        return self


class DPOMasterConfig(PreferenceMasterConfig):
    """Everything ``examples/run_dpo.py`` reads."""

    _ALGORITHM: ClassVar[str] = "DPO"

    dpo: DPOConfig = Field(default_factory=DPOConfig)
    """The DPO loop and its loss."""


class RMMasterConfig(PreferenceMasterConfig):
    """Everything ``examples/run_rm.py`` reads; the policy is the trained reward model
    (``policy.reward_model_cfg.enabled: true``)."""

    _ALGORITHM: ClassVar[str] = "Reward-model training"
    _REWARD_MODEL: ClassVar[bool] = True

    rm: RMConfig = Field(default_factory=RMConfig)
    """The reward-model loop."""


class EvalMasterConfig(ConfigModel):
    """Everything ``examples/run_eval.py`` reads (NeMo RL's eval config layout)."""

    eval: EvalConfig = Field(default_factory=EvalConfig)
    """What is measured and where the results go."""

    generation: EvalGenerationConfig = Field(default_factory=EvalGenerationConfig)
    """The evaluated model, its generation backend and sampling settings."""

    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    """Tokenizer and chat template; ``tokenizer.name: null`` uses the evaluated model's (for a training
    checkpoint, the tokenizer and chat template its run was trained with)."""

    data: EvalDataConfig = Field(default_factory=EvalDataConfig)
    """The benchmark."""

    env: EnvConfig = Field(default_factory=EnvConfig)
    """Environments that score responses."""

    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    """Metric logging backends (the metrics are logged as ``eval/*`` at step 0)."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Worker slots (GPUs, or CPU slots without CUDA) and nodes for the generation workers."""

    @model_validator(mode="after")
    def _check(self) -> EvalMasterConfig:
        self.env.check_tool_turns(self.eval.max_rollout_turns, "eval.max_rollout_turns")
        if self.generation.temperature == 0.0 and self.eval.num_tests_per_prompt > 1:
            raise ValueError(
                f"generation.temperature=0 decodes greedily, so all eval.num_tests_per_prompt="
                f"{self.eval.num_tests_per_prompt} responses would be the same: set a temperature > 0 to sample, "
                "or eval.num_tests_per_prompt=1"
            )
        if not self.generation.colocated.enabled:
            raise ValueError(
                "evaluation runs generation only: generation.colocated.enabled=false has nothing to be apart "
                "from; leave it true"
            )
        return self
