"""Schema of the ``policy`` section: model, parallelism, optimisation and generation settings.

The backend and generation sub-sections live in their own modules (:mod:`nemo_rl.config.dtensor`,
:mod:`nemo_rl.config.megatron`, :mod:`nemo_rl.config.generation`); their models are importable from here too.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.compat import SequencePackingConfig
from nemo_rl.config.context_parallel import check_context_parallel
from nemo_rl.config.dtensor import DTensorConfig
from nemo_rl.config.generation import (
    VLLM_TEMPERATURE_RANGE,
    ColocatedConfig,
    ColocatedResources,
    EmbeddedEngineConfig,
    GenerationConfig,
    Precision,
    VllmConfig,
)
from nemo_rl.config.lora import VLLM_MAX_LORA_RANK, LoraConfig
from nemo_rl.config.megatron import MegatronConfig
from nemo_rl.config.model_arch import MOE_MODEL_TYPES, local_hf_config, local_model_type
from nemo_rl.config.no_effect import refusal
from nemo_rl.config.refit import RefitConfig
from nemo_rl.config.router_replay import RouterReplayConfig, check_router_replay

__all__ = [
    "VLLM_TEMPERATURE_RANGE",
    "ColocatedConfig",
    "ColocatedResources",
    "DTensorConfig",
    "DynamicBatchingConfig",
    "EmbeddedEngineConfig",
    "GenerationConfig",
    "LoraConfig",
    "MegatronConfig",
    "OptimizerConfig",
    "PolicyConfig",
    "Precision",
    "RefitConfig",
    "RewardModelConfig",
    "RouterReplayConfig",
    "SchedulerEntry",
    "SchedulerMilestones",
    "SequencePackingConfig",
    "SharedPrefixConfig",
    "TokenizerConfig",
    "VllmConfig",
]


class TokenizerConfig(ConfigModel):
    """Which tokenizer to load and how to format chats with it."""

    name: str | None = None
    """Hub name or local path of the tokenizer; ``None`` uses ``policy.model_name``."""

    chat_template: str | None = None
    """Jinja chat template overriding the tokenizer's own; ``None`` keeps the tokenizer's template.
    The special value ``"default"`` renders messages as plain ``role: content`` lines."""

    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables passed to the chat template on every call (e.g. ``{enable_thinking: true}``)."""

    use_fastokens: bool = False
    """Accepted, no effect here: a faster tokenizer implementation (a speed knob)."""


class RewardModelConfig(ConfigModel):
    """Load and train the model with a scalar head instead of the LM head: a reward model (one reward per
    sequence) or PPO's value model (one value per token); NeMo RL's ``policy.reward_model_cfg`` and
    ``value.reward_model_cfg``."""

    enabled: bool = False
    """Load ``model_name`` with ``AutoModelForSequenceClassification`` and one output (a checkpoint without
    that head gets a freshly initialised one); the workers then return the head's output instead of logits."""

    reward_model_type: Literal["bradley_terry", "regression"] = "bradley_terry"
    """What the head is trained as: ``bradley_terry``, a reward model read at each sequence's last token and
    trained on preference pairs with ``-log sigmoid(r_chosen - r_rejected)``; ``regression``, a value model
    read at every token and regressed onto PPO's returns (the critic of ``run_ppo.py``, whose ``value``
    section sets it)."""


class OptimizerConfig(ConfigModel):
    """A torch optimizer given by class path and keyword arguments."""

    name: str = "torch.optim.AdamW"
    """Import path of the optimizer class."""

    kwargs: dict[str, Any] = Field(default_factory=lambda: {"lr": 5.0e-6, "weight_decay": 0.01})
    """Keyword arguments passed to the optimizer class (``lr``, ``betas``, ``weight_decay``...)."""


class SchedulerEntry(ConfigModel):
    """One learning-rate scheduler in a chain, given by class path and keyword arguments."""

    name: str
    """Import path of the scheduler class, e.g. ``torch.optim.lr_scheduler.LinearLR``."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the scheduler (the optimizer is passed by the worker)."""


class SchedulerMilestones(ConfigModel):
    """Step milestones at which a chain of schedulers hands over to the next one (``SequentialLR``)."""

    milestones: list[int]
    """Optimizer steps at which to switch to the next scheduler of the list."""


class DynamicBatchingConfig(ConfigModel):
    """Group sequences of similar length into micro-batches bounded by a token budget."""

    enabled: bool = False
    """Use token-budget micro-batches instead of a fixed micro-batch size."""

    train_mb_tokens: int = Field(default=4096, ge=1)
    """Token budget of one training micro-batch."""

    logprob_mb_tokens: int = Field(default=8192, ge=1)
    """Token budget of one log-prob micro-batch."""

    sequence_length_round: int = Field(default=64, ge=1)
    """Padded sequence lengths are rounded up to a multiple of this."""


class SharedPrefixConfig(ConfigModel):
    """Shared-prompt forward ("prefix sharing", as in Prefix Grouper for GRPO): rows whose prompts are identical
    hold the prompt once, followed by every row's response, and a micro-batch's groups are packed end to end
    in one row (no padding).

    Position ids restart after the prompt for each response and attention runs in blocks (the prompt over
    itself, each response over the whole prompt and its own earlier tokens), so logits, log-probs, losses and
    gradients are those of the unshared forward (float rounding aside). Groups are found in the data
    (identical tokens before a row's first trained token, ``token_mask``), so any algorithm that sends several
    samples per prompt benefits; rows without a partner run as ordinary rows. Applies to training and to every
    log-prob pass (reference, previous policy, top-k) of the DTensor backend; token budgets
    (``dynamic_batching``) count a shared prompt once and keep a group's rows in one micro-batch unless the
    group alone exceeds the budget.

    It pays with groups of samples per prompt (GRPO's ``num_generations_per_prompt``) and prompts that are
    long relative to the responses: every layer but attention computes a prompt's tokens once instead of once
    per sample (about 1.3-1.6x training tokens/s on the tiny math GRPO batches, ``benchmarks/README.md``). With
    no shared prompts it costs only the grouping check. Needs Hugging Face's sdpa attention (the default) and
    no sliding-window layers. Exclusive with ``sequence_packing`` (it packs each micro-batch
    already, with no repeated prompt); refused on the Megatron backend. A reward model reads its scalar head
    at each row's last token of the shared forward, as its unshared forward does."""

    enabled: bool = False
    """Compute each shared prompt once per micro-batch (see the class docstring for when it pays)."""

    dedupe_rows: bool = False
    """Also compute rows that are identical in full (prompt, response and trained tokens) once per
    micro-batch, and hand every copy the same output (their gradients sum, as through separate copies).
    Pays where whole rows repeat: preference pairs served by prompt (``<algo>.group_pairs_by_prompt``) repeat
    a prompt's chosen response in each of its pairs. Off by default because the smaller batch rounds
    differently, which moves seeded results by float rounding."""


class PolicyConfig(ConfigModel):
    """The trained model, how it is parallelised and optimised, and how it samples."""

    model_name: str
    """Hub name or local path of a Hugging Face causal LM."""

    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    """Tokenizer settings."""

    trust_remote_code: bool = False
    """Allow the model and tokenizer repositories to run their own code."""

    train_global_batch_size: int = Field(default=32, ge=1)
    """Sequences per optimizer step, summed over all data-parallel ranks."""

    train_micro_batch_size: int = Field(default=4, ge=1)
    """Sequences per forward/backward pass on one rank (gradients accumulate over micro-batches)."""

    logprob_batch_size: int | None = Field(default=None, ge=1)
    """Sequences per forward pass when computing log-probs; ``None`` uses ``train_micro_batch_size``."""

    generation_batch_size: int | None = Field(default=None, ge=1)
    """Sequences per generation call on one engine replica; ``None`` generates the whole shard at once."""

    max_total_sequence_length: int = Field(default=512, ge=2)
    """Longest prompt + response, in tokens."""

    precision: Precision = "float32"
    """Dtype of the training weights and activations (``float32`` on CPU; ``bfloat16`` on GPU)."""

    max_grad_norm: float | None = Field(default=1.0, gt=0.0)
    """Clip the global gradient norm to this value; ``None`` disables clipping."""

    max_nonfinite_steps: int = Field(default=3, ge=0)
    """Stop the run (with a message, keeping the last checkpoint) after this many optimizer steps in a row
    whose loss or gradient norm is NaN or infinite; each such step is skipped (no optimizer or scheduler
    update) and counted. 0 never stops."""

    make_sequence_length_divisible_by: int = Field(default=1, ge=1)
    """Pad batches so the sequence length is a multiple of this (e.g. the TP size with sequence parallel)."""

    refit_buffer_size_mb: int = Field(default=256, ge=1)
    """Size of one refit bucket in MiB; a parameter larger than a bucket is sent alone."""

    refit: RefitConfig = Field(default_factory=RefitConfig)
    """Weight transfer from the policy to the generation workers."""

    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig)
    """DTensor backend settings."""

    megatron_cfg: MegatronConfig = Field(default_factory=MegatronConfig)
    """Megatron-core backend settings."""

    reward_model_cfg: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """Reward-model head instead of the language-model head (reward-model training and scoring)."""

    frozen_parameters: list[str] = Field(default_factory=list)
    """Glob patterns (``fnmatch``) of parameter names, as the Hugging Face checkpoint names them, that are not
    trained (e.g. ``["model.embed_tokens.*", "model.layers.[0-3].*"]``): they get no gradient and no optimizer
    state, and are exported unchanged. A pattern that matches nothing is an error. DTensor backend only."""

    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    """Token-budget micro-batching."""

    optimizer: OptimizerConfig | None = Field(default_factory=OptimizerConfig)
    """Optimizer class and arguments of the DTensor backend (required with it); the Megatron backend uses
    ``megatron_cfg.optimizer`` and NeMo RL's Megatron recipes set this to ``null``."""

    scheduler: list[SchedulerEntry | SchedulerMilestones] | None = Field(default_factory=list)
    """Learning-rate schedulers of the DTensor backend, chained with ``SequentialLR`` when a ``milestones``
    entry is given; empty or ``null`` means a constant learning rate. The Megatron backend uses
    ``megatron_cfg.scheduler``."""

    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """Sampling settings and backend (used by GRPO, distillation and evaluation)."""

    hf_config_overrides: dict[str, Any] = Field(default_factory=dict)
    """Hugging Face model-config attributes replaced when the model is built, by the policy workers and by
    generation alike (e.g. ``{max_position_embeddings: 4096}``); an attribute the model's config lacks is an
    error when the model loads."""

    logprob_chunk_size: int | None = None
    """Accepted, no effect here: log-probs are computed per micro-batch over the whole sequence (a memory
    knob)."""

    offload_optimizer_for_logprob: bool = False
    """Accepted, no effect here: a memory knob of non-colocated generation."""

    activation_checkpointing_enabled: bool = False
    """Accepted, no effect here: NeMo RL's reward-model recipes' spelling; recomputation is a memory knob
    (``dtensor_cfg.activation_checkpointing`` turns it on here)."""

    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    """Packed micro-batches: several sequences per row, no compute spent on padding (DTensor backend)."""

    shared_prefix: SharedPrefixConfig = Field(default_factory=SharedPrefixConfig)
    """Compute each prompt shared by several rows once (DTensor backend; exact, see ``SharedPrefixConfig``)."""

    router_replay: RouterReplayConfig = Field(default_factory=RouterReplayConfig)
    """Routing replay ("R3") for mixture-of-experts models: the policy's forwards use the experts the sampler
    chose (see ``RouterReplayConfig``)."""

    draft: dict[str, Any] | None = None
    """Speculative-decoding draft model; not built here: must be null or have ``enabled: false``."""

    @model_validator(mode="after")
    def _refuse_unbuilt_policy_keys(self) -> Self:
        if self.draft is not None and self.draft.get("enabled"):
            raise refusal("policy.draft.enabled", "set policy.draft.enabled=false")
        return self

    CONDITIONAL_NO_EFFECT: ClassVar[dict[str, str]] = {
        "sequence_packing.enabled": "on the DTensor backend, without sequence parallelism, for a language model",
    }

    @property
    def packs_sequences(self) -> bool:
        """Whether micro-batches are packed: ``sequence_packing.enabled`` on the DTensor backend with a
        language-model head or a value model's per-token head, and no sequence parallelism. Elsewhere sequences
        are padded, so that NeMo RL's recipes that enable packing for every backend still load, and the key is
        reported as having no effect (:meth:`settings_without_effect`)."""
        reads_last_token = (
            self.reward_model_cfg.enabled and self.reward_model_cfg.reward_model_type != "regression"
        )
        return (
            self.sequence_packing.enabled
            and self.dtensor_cfg.enabled
            and not self.dtensor_cfg.sequence_parallel
            and not reads_last_token
        )

    def settings_without_effect(self) -> dict[str, str]:
        """``sequence_packing.enabled`` where micro-batches are padded instead (see :attr:`packs_sequences`)."""
        if not self.sequence_packing.enabled or self.packs_sequences:
            return {}
        if self.megatron_cfg.enabled:
            why = "the Megatron backend pads its micro-batches; packing is built on the DTensor backend"
        elif self.dtensor_cfg.sequence_parallel:
            why = (
                "sequence parallelism pads its micro-batches; set dtensor_cfg.sequence_parallel=false to pack"
            )
        else:
            why = "a reward model's micro-batches are padded (its head reads each row's last token)"
        return {"sequence_packing.enabled": why}

    @model_validator(mode="after")
    def _check_in_policy_generation(self) -> Self:
        generation = self.generation
        if not generation.embedded_cfg.in_policy_workers:
            return self
        key = "policy.generation.embedded_cfg.in_policy_workers=true"
        if generation.backend != "embedded":
            raise ValueError(
                f"{key} hosts the embedded engine, but the backend is {generation.backend}: set it false"
            )
        if not generation.colocated.enabled:
            raise ValueError(
                f"{key} needs colocated generation: set policy.generation.colocated.enabled=true or set it false"
            )
        if not self.dtensor_cfg.enabled:
            raise ValueError(
                f"{key} is built for the DTensor policy workers only: set it false for the Megatron backend"
            )
        if generation.embedded_cfg.data_parallel_size is not None:
            raise ValueError(
                f"{key} runs one replica per policy data-parallel group: unset "
                "policy.generation.embedded_cfg.data_parallel_size"
            )
        if self.reward_model_cfg.enabled:
            raise ValueError(
                f"{key} needs a language model: a reward model has no head to sample from; set it false"
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> Self:
        if not self.dtensor_cfg.lora_cfg.enabled:
            return self
        key = "policy.dtensor_cfg.lora_cfg.enabled=true"
        if not self.dtensor_cfg.enabled:
            raise ValueError(
                f"{key} adapts the DTensor policy: on the Megatron backend set policy.megatron_cfg.peft.enabled"
                "=true instead"
            )
        if self.reward_model_cfg.enabled:
            raise ValueError(
                f"{key} with a reward model would leave its new scalar head untrained: set it false (train the "
                "reward model fully)"
            )
        dim = self.dtensor_cfg.lora_cfg.dim
        if self.generation.backend == "vllm" and dim > VLLM_MAX_LORA_RANK:
            raise ValueError(
                f"policy.dtensor_cfg.lora_cfg.dim={dim}, but vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANK}: "
                f"set a dim of at most {VLLM_MAX_LORA_RANK} or policy.generation.backend=embedded"
            )
        return self

    @model_validator(mode="after")
    def _check(self) -> PolicyConfig:
        self._check_backend()
        if self.megatron_cfg.enabled:
            self._check_megatron()
        if self.shared_prefix.enabled:
            self._check_shared_prefix()
        check_router_replay(self)
        check_context_parallel(self)
        self._check_batching()
        self._check_scheduler()
        return self

    def _check_backend(self) -> None:
        if self.dtensor_cfg.enabled == self.megatron_cfg.enabled:
            raise ValueError(
                "exactly one of policy.dtensor_cfg.enabled and policy.megatron_cfg.enabled must be true"
            )
        if not self.dtensor_cfg.enabled:
            return
        if self.optimizer is None:
            raise ValueError(
                "policy.optimizer is null but the DTensor backend needs it: set policy.optimizer"
            )
        if self.dtensor_cfg.data_parallel_mode == "replicate" and self.precision != "float32":
            raise ValueError(
                f"policy.dtensor_cfg.data_parallel_mode=replicate trains in float32, not policy.precision="
                f"{self.precision}: set policy.precision=float32 or data_parallel_mode=fsdp"
            )
        self._check_moe_tensor_parallel()

    def _check_megatron(self) -> None:
        megatron = self.megatron_cfg
        megatron.check_with_policy(self.precision, self.max_grad_norm)
        megatron.check_moe_checkpoint(
            local_hf_config(self.model_name, self.hf_config_overrides),
            megatron.tensor_model_parallel_size,
            megatron.pipeline_model_parallel_size,
            megatron.peft.enabled,
        )
        if self.frozen_parameters:
            raise ValueError(
                "policy.frozen_parameters is implemented by the DTensor backend only: remove it or set "
                "policy.dtensor_cfg.enabled=true and policy.megatron_cfg.enabled=false"
            )
        if self.reward_model_cfg.enabled and self.reward_model_cfg.reward_model_type != "regression":
            raise ValueError(
                "policy.reward_model_cfg.enabled=true needs the DTensor backend (the Megatron backend builds "
                "causal LMs and value models only): set policy.dtensor_cfg.enabled=true and "
                "policy.megatron_cfg.enabled=false"
            )
        if self.reward_model_cfg.enabled and megatron.peft.enabled:
            raise ValueError(
                "policy.megatron_cfg.peft.enabled=true with a value model would leave its new scalar head "
                "untrained: set it false (train the value model fully)"
            )

    def _check_batching(self) -> None:
        if self.sequence_packing.enabled and self.dynamic_batching.enabled:
            raise ValueError(
                "policy.sequence_packing and policy.dynamic_batching are both enabled: pick one (packing "
                "computes no padding at all)"
            )
        # Token-budget micro-batches (dynamic batching, packing) need no whole number of micro-batches.
        fixed_micro_batches = not self.dynamic_batching.enabled and not self.packs_sequences
        if fixed_micro_batches and self.train_global_batch_size % self.train_micro_batch_size != 0:
            raise ValueError(
                f"policy.train_global_batch_size ({self.train_global_batch_size}) must be a multiple of "
                f"policy.train_micro_batch_size ({self.train_micro_batch_size})"
            )

    def _check_scheduler(self) -> None:
        entries = [s for s in self.scheduler or [] if isinstance(s, SchedulerEntry)]
        milestones = [s for s in self.scheduler or [] if isinstance(s, SchedulerMilestones)]
        if len(milestones) > 1:
            raise ValueError("policy.scheduler may hold at most one `milestones` entry")
        if milestones and len(milestones[0].milestones) != len(entries) - 1:
            raise ValueError(
                f"policy.scheduler has {len(entries)} schedulers, so its `milestones` needs "
                f"{len(entries) - 1} steps, got {milestones[0].milestones}"
            )
        if len(entries) > 1 and not milestones:
            raise ValueError("policy.scheduler chains several schedulers: add a `milestones: [...]` entry")

    def _check_moe_tensor_parallel(self) -> None:
        dtensor = self.dtensor_cfg
        if dtensor.tensor_parallel_size == 1 or dtensor.custom_parallel_plan is not None:
            return
        model_type = local_model_type(self.model_name)
        if model_type in MOE_MODEL_TYPES:
            raise ValueError(
                f"policy.dtensor_cfg.tensor_parallel_size={dtensor.tensor_parallel_size}: the built-in TP plan does "
                f"not cover the experts of this {model_type} model; set tensor_parallel_size=1 (FSDP2 shards them)"
            )

    def _check_shared_prefix(self) -> None:
        if self.megatron_cfg.enabled:
            raise ValueError(
                "policy.shared_prefix.enabled=true is implemented by the DTensor backend only: set "
                "policy.shared_prefix.enabled=false or use policy.dtensor_cfg.enabled=true"
            )
        if self.sequence_packing.enabled:
            raise ValueError(
                "policy.shared_prefix and policy.sequence_packing are both enabled: pick one (with groups of "
                "samples per prompt, shared_prefix saves the repeated prompts; packing saves padding)"
            )

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer to load: ``tokenizer.name`` or else the model itself."""
        return self.tokenizer.name or self.model_name

    @property
    def max_new_tokens(self) -> int:
        """Most tokens sampled per response."""
        return self.generation.max_new_tokens or self.max_total_sequence_length
