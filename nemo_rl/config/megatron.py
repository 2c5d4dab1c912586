"""Schema of ``policy.megatron_cfg``: the Megatron-core policy backend, with NeMo RL's key names.

Every key NeMo RL's ``megatron_cfg`` has is accepted here, so its recipes load. Keys fall in three groups:

- **Built**: parallel sizes (expert parallelism included), sequence parallelism, activation recomputation,
  the ``optimizer``, ``scheduler`` and ``distributed_data_parallel_config`` sections, ``transformer_impl``,
  ``env_vars``, the MoE router keys (:mod:`nemo_rl.config.megatron_moe`)... are honoured by the worker
  (``nemo_rl.models.policy.megatron_worker``).
- **Rejected when not neutral**: a key that selects behaviour this backend does not build (expert tensor
  parallelism, FP8, multi-token prediction, custom FSDP...; context parallelism where Transformer Engine is not
  installed) fails validation with a one-line message naming the key and the value to set
  (:meth:`MegatronConfig._reject_unbuilt`).
- **Accepted, no effect here**: pure performance and memory knobs (fusions, overlap flags, CUDA graphs,
  async checkpoint saves, MoE kernels...). Each field's
  docstring says so, with the reason (:mod:`nemo_rl.config.no_effect`, shared by every section);
  :data:`NO_EFFECT_KEYS` lists them and the scripts report the ones a config sets away from their default.
  None of them changes what is computed.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.lora import MegatronPeftConfig
from nemo_rl.config.megatron_moe import MegatronMoeKeys
from nemo_rl.config.no_effect import no_effect_keys
from nemo_rl.config.no_effect import no_effect_settings as find_no_effect_settings

MegatronPrecision = Literal["float32", "bfloat16", "float16"]


class MegatronOptimizerConfig(ConfigModel):
    """Megatron-core's optimizer (``megatron.core.optimizer.OptimizerConfig``), NeMo RL's keys."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """``adam`` (AdamW: decoupled weight decay) or ``sgd`` (with ``sgd_momentum``)."""

    lr: float = Field(default=5.0e-6, gt=0.0)
    """Peak learning rate (reached after ``scheduler.lr_warmup_iters`` steps)."""

    min_lr: float = Field(default=5.0e-7, ge=0.0)
    """Learning rate at the end of the decay (``scheduler.lr_decay_style`` other than ``constant``)."""

    weight_decay: float = Field(default=0.01, ge=0.0)
    """Weight decay; like Megatron, biases and normalisation weights are not decayed."""

    bf16: bool = False
    """Train in bfloat16 with float32 master weights; must be true exactly when ``policy.precision`` is
    ``bfloat16``."""

    fp16: bool = False
    """Train in float16; must be true exactly when ``policy.precision`` is ``float16``."""

    params_dtype: MegatronPrecision = "float32"
    """Accepted, no effect here: master weights and optimizer state are always float32."""

    adam_beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    """Adam's first-moment decay."""

    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    """Adam's second-moment decay."""

    adam_eps: float = Field(default=1.0e-8, gt=0.0)
    """Adam's epsilon."""

    sgd_momentum: float = Field(default=0.9, ge=0.0)
    """Momentum of ``sgd``."""

    use_distributed_optimizer: bool = False
    """Shard the optimizer state (and float32 master weights) over the data-parallel ranks (ZeRO-1)."""

    use_precision_aware_optimizer: bool = False
    """Accepted, no effect here: master weights and Adam moments stay float32."""

    clip_grad: float = Field(default=1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping. Must equal
    ``policy.max_grad_norm`` (0 for ``null``), as NeMo RL recipes write ``clip_grad: ${policy.max_grad_norm}``."""

    optimizer_cpu_offload: bool = False
    """Accepted, no effect here: the optimizer state stays on the training device during a step."""

    optimizer_offload_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    """Accepted, no effect here (see ``optimizer_cpu_offload``)."""

    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Accepted, no effect here (see ``optimizer_cpu_offload``)."""


class MegatronSchedulerConfig(ConfigModel):
    """Megatron-core's learning-rate and weight-decay schedule (``OptimizerParamScheduler``), in optimizer steps."""

    start_weight_decay: float | None = Field(default=None, ge=0.0)
    """Weight decay at step 0; ``None`` uses ``optimizer.weight_decay``."""

    end_weight_decay: float | None = Field(default=None, ge=0.0)
    """Weight decay at the end of ``lr_decay_iters``; ``None`` uses ``optimizer.weight_decay``."""

    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay moves from ``start_weight_decay`` to ``end_weight_decay``."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "constant"
    """Learning-rate decay after warm-up, from ``optimizer.lr`` down to ``optimizer.min_lr``."""

    lr_decay_iters: int | None = Field(default=None, ge=1)
    """Optimizer steps over which the learning rate decays (counted from step 0, warm-up included);
    ``None`` uses ``megatron_cfg.train_iters``. Needed unless ``lr_decay_style`` is ``constant``."""

    lr_warmup_iters: int = Field(default=0, ge=0)
    """Optimizer steps of linear warm-up from ``lr_warmup_init`` to ``optimizer.lr``."""

    lr_warmup_init: float = Field(default=0.0, ge=0.0)
    """Learning rate at step 0 of the warm-up."""

    override_opt_param_scheduler: bool = True
    """Accepted, no effect here: the schedule always comes from the config, and a checkpoint restores only
    the step count."""

    wsd_decay_steps: int | None = Field(default=None, ge=1)
    """Steps of the final decay of the ``WSD`` (warm-up, stable, decay) style."""

    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"
    """Shape of the ``WSD`` style's final decay."""


class MegatronDDPConfig(ConfigModel):
    """Megatron-core's data-parallel wrapper (``DistributedDataParallelConfig``)."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and all-reduce gradients in float32 even when training in bfloat16 / float16."""

    overlap_grad_reduce: bool = False
    """Accepted, no effect here: gradients are reduced after the last micro-batch."""

    overlap_param_gather: bool = False
    """Accepted, no effect here: with the distributed optimizer, parameters are gathered after the step."""

    average_in_collective: bool = False
    """Accepted, no effect here: losses are shares of the global batch (see docs/design.md), so
    gradients are always summed over data-parallel ranks."""

    use_custom_fsdp: bool = False
    """Megatron's FSDP; not built here: must be false."""

    data_parallel_sharding_strategy: str = "no_shard"
    """Accepted, no effect here (only read by Megatron's FSDP, which is not built)."""


class MegatronFp8Config(ConfigModel):
    """FP8 training (NeMo RL's ``megatron_cfg.fp8_cfg``); not built here."""

    enabled: bool = False
    """Train with FP8 GEMMs; not built here: must be false."""

    fp8: str | None = None
    """FP8 format, e.g. ``e4m3`` (unused while ``enabled`` is false)."""

    fp8_recipe: str | None = None
    """FP8 scaling recipe, e.g. ``blockwise`` (unused while ``enabled`` is false)."""

    fp8_param: bool = False
    """Keep parameters in FP8 (unused while ``enabled`` is false)."""

    force_clear_fp8_caches: bool = False
    """Clear FP8 workspaces before refit (unused while ``enabled`` is false)."""


class MegatronCheckpointConfig(ConfigModel):
    """Megatron-Bridge checkpoint knobs NeMo RL passes through; none changes what is saved."""

    async_save: bool = False
    """Accepted, no effect here: checkpoints are written synchronously."""

    ckpt_assume_constant_structure: bool = False
    """Accepted, no effect here (a save-speed knob)."""

    ckpt_fully_parallel_save_process_group: str = "dp"
    """Accepted, no effect here (a save-speed knob)."""

    ckpt_fully_parallel_load_process_group: str = "dp"
    """Accepted, no effect here (a load-speed knob)."""

    ckpt_fully_parallel_load_exchange_algo: str = "broadcast"
    """Accepted, no effect here (a load-speed knob)."""


class MegatronFreezeConfig(ConfigModel):
    """Which sub-models of a multimodal model stay frozen (NeMo RL's ``megatron_cfg.freeze_config``)."""

    freeze_language_model: bool = False
    """Freeze the language model; not built here: must be false."""

    freeze_vision_model: bool = False
    """Accepted, no effect here: the Megatron backend builds text models only (vision-language models run on
    the DTensor backend, whose ``dtensor_cfg.freeze_config`` freezes their vision tower)."""

    freeze_vision_projection: bool = False
    """Accepted, no effect here: the Megatron backend builds text models only (vision-language models run on
    the DTensor backend, whose ``dtensor_cfg.freeze_config`` freezes their projection)."""


class MegatronConfig(MegatronMoeKeys):
    """The Megatron-core policy backend (``mcore`` extra): NeMo RL's ``megatron_cfg`` keys.

    Only checked when ``enabled``: a DTensor recipe may carry any (valid-typed) Megatron section.
    """

    enabled: bool = False
    """Use the Megatron-core backend for the policy workers."""

    env_vars: dict[str, str] | None = None
    """Environment variables set in every Megatron worker before the model is built."""

    model_overrides: dict[str, Any] = Field(default_factory=dict)
    """Megatron-Bridge model-provider overrides; not built here: must be empty (the Megatron model is
    derived from the Hugging Face config)."""

    train_iters: int | None = Field(default=None, ge=1)
    """Total optimizer steps of the run; the default of ``scheduler.lr_decay_iters``."""

    converter_type: str | None = None
    """Hugging Face architecture of the model (e.g. ``Qwen2ForCausalLM``); when set, it must match the
    checkpoint's ``architectures``. The weight converter is always chosen from the checkpoint's config."""

    # ---------------------------------------------------------------------------------- parallelism
    tensor_model_parallel_size: int = Field(default=1, ge=1)
    """Megatron tensor-parallel degree (heads, KV heads, FFN size and vocabulary are split over it)."""

    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    """Megatron pipeline-parallel degree; micro-batches flow through the stages with Megatron's 1F1B
    schedule. The data-parallel degree is the worker count divided by TP x PP."""

    num_layers_in_first_pipeline_stage: int | None = Field(default=None, ge=1)
    """Decoder layers on the first pipeline stage; ``None`` splits the layers evenly."""

    num_layers_in_last_pipeline_stage: int | None = Field(default=None, ge=1)
    """Decoder layers on the last pipeline stage; ``None`` splits the layers evenly."""

    context_parallel_size: int = Field(default=1, ge=1)
    """Context-parallel degree (``2 x CP`` load-balanced chunks a row); its attention is Transformer Engine's
    (CUDA): refused where that is not installed (``policy.dtensor_cfg.context_parallel_size`` runs on CPU)."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations outside the tensor-parallel regions are split along the
    sequence (needs TP > 1; sequences are padded to a multiple of TP)."""

    pipeline_dtype: MegatronPrecision | None = None
    """Dtype of the activations sent between pipeline stages; ``None`` or ``policy.precision`` (other
    values are rejected: Megatron would send activations in a dtype the stages do not compute in)."""

    # ------------------------------------------------------------------------------- recomputation
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (``recompute_granularity``)."""

    recompute_granularity: Literal["full", "selective"] = "full"
    """``full``: recompute whole decoder layers; ``selective``: only ``recompute_modules``."""

    recompute_method: Literal["uniform", "block"] | None = None
    """How ``full`` recomputation groups layers; ``None`` means ``uniform``."""

    recompute_num_layers: int | None = Field(default=None, ge=1)
    """Layers per recomputed group with ``full`` recomputation; ``None`` means 1."""

    recompute_modules: list[str] | None = None
    """Modules recomputed with ``selective`` recomputation; ``None`` means ``["core_attn"]``."""

    # ----------------------------------------------------------------------------------- model build
    transformer_impl: Literal["transformer_engine", "local", "inference_optimized"] | None = None
    """Layer implementation: ``transformer_engine`` uses Transformer Engine's layers when it is installed
    (the local Megatron-core layers otherwise; always on CPU), ``local`` always uses the local layers;
    ``inference_optimized`` is not built here. ``None`` means ``transformer_engine``."""

    empty_unused_memory_level: int = Field(default=0, ge=0, le=2)
    """Release cached CUDA memory: 1 after each forward/backward pass, 2 also after each optimizer step."""

    # ------------------------------------------------------------------------------------- sections
    optimizer: MegatronOptimizerConfig = Field(default_factory=MegatronOptimizerConfig)
    """The optimizer (used instead of ``policy.optimizer``, which belongs to the DTensor backend)."""

    scheduler: MegatronSchedulerConfig = Field(default_factory=MegatronSchedulerConfig)
    """The learning-rate schedule (used instead of ``policy.scheduler``)."""

    distributed_data_parallel_config: MegatronDDPConfig = Field(default_factory=MegatronDDPConfig)
    """The data-parallel gradient reduction."""

    peft: MegatronPeftConfig = Field(default_factory=MegatronPeftConfig)
    """LoRA adapters on the decoder's linear layers (``nemo_rl.config.lora``); off by default (full
    fine-tuning)."""

    fp8_cfg: MegatronFp8Config = Field(default_factory=MegatronFp8Config)
    """FP8 training (not built here; ``enabled`` must be false)."""

    checkpoint: MegatronCheckpointConfig = Field(default_factory=MegatronCheckpointConfig)
    """Checkpoint I/O knobs (accepted, no effect here)."""

    freeze_config: MegatronFreezeConfig = Field(default_factory=MegatronFreezeConfig)
    """Frozen sub-models of multimodal models (``freeze_language_model`` must be false)."""

    # --------------------------------------------------------------- rejected unless neutral (more)
    mtp_num_layers: int = Field(default=0, ge=0)
    """Multi-token prediction layers; not built here: must be 0."""

    # ------------------------------------------------------------------ accepted, no effect here
    force_reconvert_from_hf: bool = False
    """Accepted, no effect here: the model is always converted from the Hugging Face checkpoint."""

    defer_fp32_logits: bool | None = None
    """Accepted, no effect here: logits are cast to float32 before log-probs and losses either way."""

    apply_rope_fusion: bool = False
    """Accepted, no effect here (a fused-kernel speed knob)."""

    bias_activation_fusion: bool = False
    """Accepted, no effect here (a fused-kernel speed knob)."""

    gradient_accumulation_fusion: bool = False
    """Accepted, no effect here (a fused-kernel speed knob)."""

    use_fused_weighted_squared_relu: bool = False
    """Accepted, no effect here (a fused-kernel speed knob)."""

    attention_backend: str | None = None
    """Accepted, no effect here: the attention kernel follows ``transformer_impl``."""

    use_fused_linear_logprobs: bool = False
    """Accepted, no effect here: log-probs are computed from the full logits (a memory knob)."""

    fused_linear_logprobs_chunk_size: int | None = None
    """Accepted, no effect here (see ``use_fused_linear_logprobs``)."""

    cuda_graph_impl: str = "none"
    """Accepted, no effect here: CUDA graphs are a speed knob and are not captured."""

    cuda_graph_modules: str | list[str] | None = None
    """Accepted, no effect here (see ``cuda_graph_impl``)."""

    cuda_graph_warmup_steps: int | None = None
    """Accepted, no effect here (see ``cuda_graph_impl``)."""

    fine_grained_activation_offloading: bool = False
    """Accepted, no effect here (a memory knob)."""

    offload_modules: list[str] | None = None
    """Accepted, no effect here (see ``fine_grained_activation_offloading``)."""

    clear_memory_caches_before_refit: bool = False
    """Accepted, no effect here (a memory knob)."""

    use_gloo_process_groups: bool | None = None
    """Accepted, no effect here: gloo groups are created when the machine has no GPU."""

    calculate_per_token_loss: bool | None = None
    """Accepted, no effect here: losses are always shares of the global batch's token or sequence count."""

    do_not_average_loss: bool | None = None
    """Accepted, no effect here (see ``calculate_per_token_loss``)."""

    scale_loss_by_dp_cp_size: bool | None = None
    """Accepted, no effect here (see ``calculate_per_token_loss``)."""

    cp_normalize: bool | None = None
    """Accepted, no effect here (every CP rank computes the loss on the gathered full rows: nothing to rescale)."""

    mtp_loss_scaling_factor: float | None = None
    """Accepted, no effect here (multi-token prediction is off)."""

    mtp_use_repeated_layer: bool | None = None
    """Accepted, no effect here (multi-token prediction is off)."""

    mtp_detach_heads: bool | None = None
    """Accepted, no effect here (multi-token prediction is off)."""

    radio_force_cpe_eval_mode: bool | None = None
    """Accepted, no effect here: the Megatron backend builds text models only (no RADIO vision encoder)."""

    freeze_vision_model: bool | None = None
    """Accepted, no effect here: the Megatron backend builds text models only (vision-language models run on
    the DTensor backend, whose ``dtensor_cfg.freeze_config`` freezes their vision tower)."""

    freeze_vision_projection: bool | None = None
    """Accepted, no effect here: the Megatron backend builds text models only (vision-language models run on
    the DTensor backend, whose ``dtensor_cfg.freeze_config`` freezes their projection)."""

    freeze_sound_encoder: bool | None = None
    """Accepted, no effect here: the supported model families have no audio encoder."""

    freeze_sound_projection: bool | None = None
    """Accepted, no effect here: the supported model families have no audio projection."""

    @model_validator(mode="before")
    @classmethod
    def _null_sections_are_defaults(cls, data: Any) -> Any:
        # NeMo RL's v0.4 / v0.5 recipes write `fp8_cfg: null` for "no FP8": the section's defaults.
        if isinstance(data, dict) and data.get("fp8_cfg", ...) is None:
            data = {**data, "fp8_cfg": {}}
        return data

    @model_validator(mode="after")
    def _reject_unbuilt(self) -> Self:
        """One-line errors for keys that select behaviour this backend does not build."""
        if not self.enabled:
            return self
        for key, bad, fix in _unbuilt_settings(self):
            if bad:
                raise ValueError(f"policy.megatron_cfg.{key} is not supported by this backend: {fix}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "policy.megatron_cfg.sequence_parallel=true needs tensor_model_parallel_size > 1; "
                "set sequence_parallel=false or raise the TP size"
            )
        if self.scheduler.lr_decay_style != "constant" and self.decay_iters is None:
            raise ValueError(
                f"policy.megatron_cfg.scheduler.lr_decay_style={self.scheduler.lr_decay_style!r} needs "
                "scheduler.lr_decay_iters (or megatron_cfg.train_iters): set the number of decay steps"
            )
        if self.scheduler.lr_decay_style == "WSD" and self.scheduler.wsd_decay_steps is None:
            raise ValueError(
                "policy.megatron_cfg.scheduler.lr_decay_style='WSD' needs scheduler.wsd_decay_steps"
            )
        return self

    @property
    def decay_iters(self) -> int | None:
        """Optimizer steps of the learning-rate decay: ``scheduler.lr_decay_iters`` or ``train_iters``."""
        return self.scheduler.lr_decay_iters or self.train_iters

    def check_with_policy(self, precision: str, max_grad_norm: float | None) -> None:
        """Cross-section checks against the ``policy`` section (called by ``PolicyConfig`` when enabled)."""
        optimizer = self.optimizer
        for flag, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
            if getattr(optimizer, flag) != (precision == dtype):
                raise ValueError(
                    f"policy.megatron_cfg.optimizer.{flag}={getattr(optimizer, flag)} does not match "
                    f"policy.precision={precision!r}: set optimizer.{flag}={precision == dtype}"
                )
        if self.pipeline_dtype is not None and self.pipeline_dtype != precision:
            raise ValueError(
                f"policy.megatron_cfg.pipeline_dtype={self.pipeline_dtype!r} differs from policy.precision="
                f"{precision!r}: set pipeline_dtype to {precision!r} (or null)"
            )
        self.peft.check_dtype(precision)
        clip = max_grad_norm or 0.0
        if optimizer.clip_grad != clip:
            raise ValueError(
                f"policy.megatron_cfg.optimizer.clip_grad={optimizer.clip_grad} differs from policy.max_grad_norm="
                f"{max_grad_norm}: the Megatron backend clips with clip_grad, so set both to the same value "
                "(0 / null disables clipping)"
            )


def _unbuilt_settings(cfg: MegatronConfig) -> list[tuple[str, bool, str]]:
    """``(key, set to a non-neutral value, what to set)`` for every key selecting unbuilt behaviour."""
    ddp = cfg.distributed_data_parallel_config
    return [
        (
            "context_parallel_size",
            cfg.context_parallel_size != 1 and importlib.util.find_spec("transformer_engine") is None,
            "set context_parallel_size=1 (megatron-core's context-parallel attention needs Transformer Engine, "
            "not installed here; policy.dtensor_cfg.context_parallel_size splits long sequences instead)",
        ),
        *cfg.moe_unbuilt_settings(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size),
        ("fp8_cfg.enabled", cfg.fp8_cfg.enabled, "set fp8_cfg.enabled=false (train in bfloat16 or float32)"),
        ("mtp_num_layers", cfg.mtp_num_layers != 0, "set mtp_num_layers=0"),
        (
            "distributed_data_parallel_config.use_custom_fsdp",
            ddp.use_custom_fsdp,
            "set use_custom_fsdp=false (data parallelism with optional use_distributed_optimizer)",
        ),
        (
            "model_overrides",
            bool(cfg.model_overrides),
            "the model is derived from the Hugging Face config; set model_overrides={}",
        ),
        (
            "transformer_impl",
            cfg.transformer_impl == "inference_optimized",
            "set transformer_impl=transformer_engine or local",
        ),
        (
            "freeze_config.freeze_language_model",
            cfg.freeze_config.freeze_language_model,
            "set freeze_config.freeze_language_model=false",
        ),
    ]


NO_EFFECT_KEYS: dict[str, str] = no_effect_keys(MegatronConfig)
"""Keys of ``policy.megatron_cfg`` accepted for NeMo RL recipes that change nothing this backend computes
(speed and memory knobs, MoE-only and multimodal-only keys), each with the reason; dotted below
``megatron_cfg``. Derived from the fields' docstrings (:mod:`nemo_rl.config.no_effect`), the one registry."""


def no_effect_settings(cfg: MegatronConfig) -> list[str]:
    """``key=value (reason)`` for every :data:`NO_EFFECT_KEYS` key set away from its schema default."""
    return [str(setting) for setting in find_no_effect_settings(cfg)]
