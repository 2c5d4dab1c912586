"""Building a Megatron policy rank: process groups, ``GPTModel``, the DDP wrapper, optimizer and schedule.

Everything here is driven by ``policy.megatron_cfg`` (:mod:`nemo_rl.config.megatron`) and the Hugging Face
config (:class:`~nemo_rl.config.model_arch.ModelArch`); the weights come in and go out through
:mod:`nemo_rl.models.megatron.weights`. Callers on a machine without CUDA run these functions inside
:func:`nemo_rl.models.megatron.cpu_compat.device_redirect`.

Ranks are laid out tensor-parallel fastest, then pipeline, then data parallel (Megatron order
``tp-cp-ep-pp-dp``): rank = ``tp_rank + TP * (pp_rank + PP * dp_rank)``, so the ranks of one data-parallel
replica are consecutive, as ``RayWorkerGroup`` deals data shards.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_rl.config.megatron import MegatronConfig
from nemo_rl.config.model_arch import ModelArch
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.device import cuda_available, get_device
from nemo_rl.models.dtypes import PRECISION_DTYPES
from nemo_rl.models.hf_decoder import rope_inv_freq
from nemo_rl.models.megatron import value_head
from nemo_rl.models.megatron.convert import pad_vocab
from nemo_rl.models.megatron.families import DecoderFamily
from nemo_rl.models.megatron.moe import RecordingRouter

RANK_ORDER = "tp-cp-ep-pp-dp"
"""Megatron's rank order: the ranks of one data-parallel replica are consecutive."""

SEED = 1234
"""Seed of Megatron's RNG states (initialisation before the checkpoint is loaded; dropout is off)."""


def init_model_parallel(cfg: MegatronConfig) -> None:
    """Create Megatron's tensor / pipeline / context / data / expert-parallel groups over the default process
    group.

    The expert tensor-parallel size is Megatron's default, the TP size: MoE models run with TP = 1 (checked at
    config load), so experts are whole, and a dense model keeps its data-parallel groups."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        order=RANK_ORDER,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)


def check_divisibility(arch: ModelArch, cfg: MegatronConfig) -> None:
    """Raise ``ValueError`` when the model cannot be split over the configured TP / PP sizes."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    for what, size in (
        ("num_attention_heads", arch.num_heads),
        ("num_key_value_heads", arch.num_kv_heads),
        ("intermediate_size", arch.intermediate_size),
    ):
        if size % tp:
            raise ValueError(
                f"the model's {what} ({size}) is not divisible by policy.megatron_cfg.tensor_model_parallel_size "
                f"({tp}); choose a TP size that divides it"
            )
    first, last = cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage
    middle_layers = arch.num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        raise ValueError(
            f"num_layers_in_first/last_pipeline_stage ({first}, {last}) do not add up to the model's "
            f"{arch.num_layers} layers over {pp} pipeline stages"
        )
    if middle_stages and middle_layers % middle_stages:
        raise ValueError(
            f"the model's {arch.num_layers} layers do not split evenly over {pp} pipeline stages; set "
            "policy.megatron_cfg.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
        )


def uses_transformer_engine(cfg: MegatronConfig, arch: ModelArch) -> bool:
    """Whether to build Transformer Engine layers: on CUDA, with ``te`` installed, unless ``local`` is asked,
    LoRA is on (its adapters need the normalised input, which Transformer Engine's fused norm-linear
    layers keep to themselves) or the model is a mixture of experts (built from the local spec, whose
    routers record their routing)."""
    return (
        cfg.transformer_impl != "local"
        and not cfg.peft.enabled
        and arch.moe is None
        and cuda_available()
        and importlib.util.find_spec("transformer_engine") is not None
    )


_SAME_NAMED_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "sequence_parallel",
    "expert_model_parallel_size",
    "moe_router_dtype",
)
"""``policy.megatron_cfg`` keys passed to megatron-core's ``TransformerConfig`` as they are (NeMo RL names them
after it)."""


def transformer_config(arch: ModelArch, family: DecoderFamily, policy: PolicyConfig) -> TransformerConfig:
    """The ``TransformerConfig`` of ``arch`` with the parallelism, precision and recomputation of ``policy``."""
    cfg = policy.megatron_cfg
    dtype = PRECISION_DTYPES[policy.precision]
    recompute: dict[str, Any] = {}
    if cfg.activation_checkpointing:
        recompute = {"recompute_granularity": cfg.recompute_granularity}
        if cfg.recompute_granularity == "full":
            recompute |= {
                "recompute_method": cfg.recompute_method or "uniform",
                "recompute_num_layers": cfg.recompute_num_layers or 1,
            }
        elif cfg.recompute_modules is not None:
            recompute["recompute_modules"] = cfg.recompute_modules
    return TransformerConfig(
        **family.model_options(arch),
        activation_func=F.silu,
        # Dropout stays off, as in the DTensor backend (Hugging Face models train in eval-dropout mode).
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        **{key: getattr(cfg, key) for key in _SAME_NAMED_KEYS},
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Each micro-batch may have its own length and row count (the last one of a batch, dynamic batching):
        # pipeline stages exchange shapes before each send.
        variable_seq_lengths=cfg.pipeline_model_parallel_size > 1,
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type or "alltoall",
        moe_router_bias_update_rate=cfg.moe_router_bias_update_rate or 0.0,
        # The load-balancing loss is transformers' (nemo_rl.models.megatron.moe), not Megatron's.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        batch_p2p_sync=cuda_available(),
        # Losses are shares of the global batch already (see docs/design.md): Megatron must not rescale them.
        calculate_per_token_loss=True,
        perform_initialization=True,  # sets the tensor-parallel attributes the grad norm relies on
        use_cpu_initialization=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        **recompute,
    )


def build_model(arch: ModelArch, policy: PolicyConfig, config: TransformerConfig) -> GPTModel:
    """This rank's pipeline stage of the model, randomly initialised (load the weights, then
    :func:`wrap_for_training`); a value model's last stage ends in its scalar head
    (:mod:`nemo_rl.models.megatron.value_head`), with no embedding tied to it."""
    value_model = value_head.builds_value_head(policy)
    spec: ModuleSpec | TransformerBlockSubmodules
    if uses_transformer_engine(policy.megatron_cfg, arch):
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    else:
        spec = _local_block_spec(arch, config)
    gpt = GPTModel(
        config,
        spec,
        vocab_size=pad_vocab(arch.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=policy.max_total_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not value_model,
        position_embedding_type="rope",
        rotary_base=int(float(arch.rope_parameters["rope_theta"])),
    )
    # Hugging Face's rotary frequencies (with its linear / llama3 scaling) replace Megatron's own.
    inv_freq, _ = rope_inv_freq(arch)
    gpt.rotary_pos_emb.inv_freq = inv_freq.to(gpt.rotary_pos_emb.inv_freq.device)
    if value_model and gpt.post_process:
        value_head.attach(gpt, config, parallel_state.get_tensor_model_parallel_group())
    # Plain torch modules (the norms) are created on the host; Megatron's own layers already are on the device.
    return gpt.to(get_device())


class RMSNorm(torch.nn.Module):
    """RMSNorm as the Hugging Face Llama / Qwen models compute it (normalised in float32, then scaled in the
    input dtype), usable in Megatron's sequence-parallel regions.

    Megatron's torch fallback norm refuses sequence parallelism: each rank normalises only its slice of the
    sequence there, so the weight's gradient must be summed over the tensor-parallel group, which Megatron's
    gradient finalisation does for parameters marked ``sequence_parallel``.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim of ``hidden``."""
        normed = hidden.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(hidden.dtype)


def _local_block_spec(arch: ModelArch, config: TransformerConfig) -> TransformerBlockSubmodules:
    """megatron-core's local layers with :class:`RMSNorm` as every norm (decoder layers and the final norm)."""
    dense = _local_layer_spec(arch, None)
    if arch.moe is None:
        return TransformerBlockSubmodules(
            layer_specs=[dense] * get_num_layers_to_build(config), layer_norm=RMSNorm
        )
    # MoE models build one pipeline stage (checked at config load), so the stage holds every layer.
    sparse = _local_layer_spec(arch, arch.moe.num_experts)
    specs = [sparse if is_moe else dense for is_moe in arch.moe.sparse_layers]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)


def _local_layer_spec(arch: ModelArch, num_experts: int | None) -> ModuleSpec:
    """megatron-core's local decoder layer (a MoE layer with ``num_experts``) with :class:`RMSNorm` norms and,
    in a MoE layer, :class:`~nemo_rl.models.megatron.moe.RecordingRouter` as the router."""
    layer = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    )
    submodules = layer.submodules
    submodules.input_layernorm = RMSNorm
    submodules.pre_mlp_layernorm = RMSNorm
    if arch.qk_norm:
        submodules.self_attention.submodules.q_layernorm = RMSNorm
        submodules.self_attention.submodules.k_layernorm = RMSNorm
    if num_experts is not None:
        submodules.mlp.submodules.router = RecordingRouter
    return layer


def wrap_for_training(
    gpt: GPTModel, policy: PolicyConfig, config: TransformerConfig
) -> DistributedDataParallel:
    """``gpt`` in the float16 wrapper (bfloat16 / float16 training) inside Megatron's data-parallel wrapper.

    Gradients are summed over data-parallel ranks (the losses are shares of the global batch), and
    :func:`finalize_grads` finishes their reduction after the last micro-batch.
    """
    cfg = policy.megatron_cfg
    module: torch.nn.Module = gpt
    if config.bf16 or config.fp16:
        module = Float16Module(config, gpt)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.distributed_data_parallel_config.grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        average_in_collective=False,
        check_for_nan_in_grad=False,
    )
    model = DistributedDataParallel(config, ddp_config, module)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_grads
    return model


def finalize_grads(
    model: list[torch.nn.Module], num_tokens: torch.Tensor | None = None, **kwargs: Any
) -> None:
    """Megatron's gradient finalisation (data-parallel reduction, tied-embedding and sequence-parallel norm
    all-reduces) without its per-token rescaling: the losses are already global shares."""
    del num_tokens
    finalize_model_grads(model, None, **kwargs)


def build_optimizer(policy: PolicyConfig, model: DistributedDataParallel) -> MegatronOptimizer:
    """Megatron's optimizer of ``policy.megatron_cfg.optimizer`` over ``model`` (biases and norms undecayed)."""
    cfg = policy.megatron_cfg.optimizer
    config = OptimizerConfig(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        params_dtype=torch.float32,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        sgd_momentum=cfg.sgd_momentum,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        clip_grad=cfg.clip_grad,
    )
    return get_megatron_optimizer(config, [model], use_gloo_process_groups=not cuda_available())


def build_scheduler(policy: PolicyConfig, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Megatron's learning-rate / weight-decay schedule of ``policy.megatron_cfg.scheduler``, in optimizer steps."""
    cfg = policy.megatron_cfg
    scheduler, optim = cfg.scheduler, cfg.optimizer
    warmup = scheduler.lr_warmup_iters
    # A constant schedule never reads the decay length; Megatron only needs it to exceed the warm-up.
    decay = cfg.decay_iters or warmup + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=scheduler.lr_warmup_init,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=scheduler.lr_decay_style,
        start_wd=optim.weight_decay if scheduler.start_weight_decay is None else scheduler.start_weight_decay,
        end_wd=optim.weight_decay if scheduler.end_weight_decay is None else scheduler.end_weight_decay,
        wd_incr_steps=decay,
        wd_incr_style=scheduler.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
        wsd_decay_steps=scheduler.wsd_decay_steps,
        lr_wsd_decay_style=scheduler.lr_wsd_decay_style,
    )


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    grad_norm: float
    """Global gradient norm before clipping."""

    stepped: bool
    """False when the norm was not finite and the update was skipped."""


@torch.no_grad()
def optimizer_step(optimizer: MegatronOptimizer, clip_grad: float) -> StepResult:
    """Clip to ``clip_grad`` (0: no clipping) and update, unless the gradient norm is not finite.

    Megatron's own ``step()`` would apply a NaN update in bfloat16 (its overflow check is fp16-only); this
    skips it, as the DTensor backend does.
    """
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm):
        optimizer.zero_grad()
        return StepResult(grad_norm if not found_inf else math.inf, False)
    if clip_grad > 0.0:
        for part in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = part.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=clip_grad, total_norm=grad_norm)
    return StepResult(grad_norm, optimizer.step_with_ready_grads())
