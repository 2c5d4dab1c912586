"""Loading a Hugging Face causal LM (or reward model) straight into its sharded layout, and exporting it back.

``policy.reward_model_cfg.enabled`` selects ``AutoModelForSequenceClassification`` with one output instead of
``AutoModelForCausalLM``: the same body with a scalar ``score`` head on the last token. A causal-LM checkpoint
loads into it with a freshly initialised head (seeded, so every run starts from the same head).

Loading never materialises the full model on more than one rank: rank 0 reads the checkpoint on the CPU,
every rank builds the model skeleton on the meta device, shards it (TP, then FSDP2), allocates only its own
shards and receives them from rank 0 (``broadcast_from_rank0``). Non-persistent buffers (rotary
``inv_freq``...) are not in the state dict and would be garbage after allocating meta tensors, so they are
copied from rank 0's loaded model and broadcast as well.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
from typing import Any, cast

import torch
import torch.distributed as dist
from huggingface_hub import save_torch_state_dict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemo_rl.config.lora import LoraConfig
from nemo_rl.config.model_arch import local_hf_config
from nemo_rl.config.policy import PolicyConfig, TokenizerConfig
from nemo_rl.models import hf_config as hf_config_io
from nemo_rl.models.dtypes import PRECISION_DTYPES
from nemo_rl.models.lora import (
    adapter_state,
    apply_lora,
    lora_targets,
    merged_weights,
    peft_target_modules,
    save_peft_adapter,
)
from nemo_rl.models.policy.context_parallel import fsdp_mesh
from nemo_rl.models.policy.optim import frozen_names
from nemo_rl.models.policy.parallelize import apply_fsdp, apply_tensor_parallel, needs_fsdp
from nemo_rl.models.tokenizer import get_tokenizer
from nemo_rl.models.vlm import check_vlm_policy, frozen_submodel_names, is_vision_language, vision_tower

logger = logging.getLogger(__name__)

# Seed of a reward head that the checkpoint lacks (HF initialises missing weights from the global RNG).
_NEW_HEAD_SEED = 0


def _non_persistent_buffers(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(module path, buffer name, module)`` of every non-persistent buffer, in a stable order."""
    found = []
    for module_name, module in model.named_modules():
        for buffer_name in sorted(module._non_persistent_buffers_set):
            if module._buffers.get(buffer_name) is not None:
                found.append((module_name, buffer_name, module))
    return found


@torch.no_grad()
def _sync_non_persistent_buffers(model: nn.Module, source: nn.Module | None) -> None:
    """Copy non-persistent buffers from rank 0's fully loaded ``source`` into ``model`` on every rank."""
    for module_name, buffer_name, module in _non_persistent_buffers(model):
        buffer = module._buffers[buffer_name]
        assert buffer is not None
        if source is not None:
            buffer.copy_(source.get_submodule(module_name)._buffers[buffer_name])  # type: ignore[arg-type]
        dist.broadcast(buffer, src=0)


def model_auto_class(cfg: PolicyConfig, hf_config: Any) -> Any:
    """``AutoModelForSequenceClassification`` for a reward model, ``AutoModelForImageTextToText`` for a
    vision-language model (transformers' own ``*ForConditionalGeneration`` class), ``AutoModelForCausalLM``
    otherwise."""
    # transformers' auto model classes (and torch.distributed.checkpoint below) are imported where they are
    # used: importing them costs seconds of CPU, and the driver imports this module without loading models.
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    if cfg.reward_model_cfg.enabled:
        return AutoModelForSequenceClassification
    return AutoModelForImageTextToText if is_vision_language(hf_config) else AutoModelForCausalLM


def load_hf_config(cfg: PolicyConfig) -> Any:
    """The model's Hugging Face config (``policy.hf_config_overrides`` applied); for a Bradley-Terry reward model with one output (``num_labels=1``)
    and a pad token id (HF's sequence-classification head scores the last token that is not padding)."""
    hf_config = hf_config_io.load_hf_config(
        cfg.model_name, trust_remote_code=cfg.trust_remote_code, overrides=cfg.hf_config_overrides
    )
    if cfg.reward_model_cfg.enabled:
        hf_config.num_labels = 1
        if hf_config.pad_token_id is None:
            tokenizer = get_tokenizer(
                cfg.tokenizer, model_name=cfg.model_name, trust_remote_code=cfg.trust_remote_code
            )
            hf_config.pad_token_id = tokenizer.pad_token_id
    return hf_config


def check_model_settings(cfg: PolicyConfig) -> None:
    """Raise :class:`UserError`, before any worker starts, when the settings do not fit the model: a
    vision-language model with what it cannot run with (:func:`~nemo_rl.models.vlm.check_vlm_policy`), or
    ``policy.frozen_parameters`` / ``dtensor_cfg.freeze_config`` naming no parameter of the model (or all of
    them). The model is built on the meta device, so nothing is loaded."""
    # A local folder's config.json is read as JSON: the driver calls this, and resolving AutoConfig costs it
    # half a second of CPU (transformers indexes its model folders). A hub model is checked by the workers
    # when they load it (load_sharded_model), so the driver makes no hub call.
    local = local_hf_config(cfg.model_name, cfg.hf_config_overrides)
    if local is not None:
        check_vlm_policy(cfg, local)
    if not cfg.frozen_parameters and not any(on for _, on in cfg.dtensor_cfg.freeze_config):
        return
    hf_config = load_hf_config(cfg)
    with torch.device("meta"):
        model = model_auto_class(cfg, hf_config).from_config(
            hf_config, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code
        )
    frozen_names([name for name, _ in model.named_parameters()], frozen_patterns(model, cfg))


def frozen_patterns(model: nn.Module, cfg: PolicyConfig) -> list[str]:
    """``policy.frozen_parameters`` and the names of the sub-models ``dtensor_cfg.freeze_config`` freezes."""
    names = [name for name, _ in model.named_parameters()]
    return [*cfg.frozen_parameters, *frozen_submodel_names(names, cfg.dtensor_cfg.freeze_config)]


def trains_with_dropout(cfg: PolicyConfig) -> bool:
    """Whether the policy's training forward differs from its scoring forward: a DTensor policy whose Hugging
    Face config has a positive dropout probability (``*dropout*`` / ``*pdrop*``). The Megatron backend builds
    its models with dropout off."""
    if not cfg.dtensor_cfg.enabled:
        return False
    hf_config = hf_config_io.load_hf_config(
        cfg.model_name, trust_remote_code=cfg.trust_remote_code, overrides=cfg.hf_config_overrides
    )
    return config_has_dropout(hf_config)


def config_has_dropout(hf_config: Any) -> bool:
    """Whether a Hugging Face config sets a positive dropout probability (``*dropout*`` / ``*pdrop*``)."""
    return any(
        isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        for key, value in hf_config.to_dict().items()
        if "dropout" in key or "pdrop" in key
    )


def _from_pretrained(auto_class: Any, model_name: str, hf_config: Any, trust_remote_code: bool) -> nn.Module:
    """``auto_class.from_pretrained`` with transformers' multi-line load report (a table per worker, with
    terminal colours) replaced by one line per kind of key: weights the checkpoint lacks start fresh (a reward
    model's head, layers ``hf_config_overrides`` adds), weights it has that the model does not are dropped.
    transformers' check of its own tensor-parallel plan (models that declare one, e.g. Qwen2.5-VL) is silenced
    too: that plan is not used here (``parallelize`` shards the model)."""
    loggers = [
        logging.getLogger(f"transformers.{name}")
        for name in ("modeling_utils", "distributed.tensor_parallel")
    ]
    levels = [report_logger.level for report_logger in loggers]
    for report_logger in loggers:
        report_logger.setLevel(logging.ERROR)
    try:
        model, info = auto_class.from_pretrained(
            model_name,
            config=hf_config,
            dtype=torch.float32,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    finally:
        for report_logger, level in zip(loggers, levels, strict=True):
            report_logger.setLevel(level)
    for key, what in (("missing_keys", "start fresh (seeded)"), ("unexpected_keys", "are not used")):
        if info.get(key):
            logger.warning(
                "%d weights of %s %s: %s", len(info[key]), model_name, what, _weight_groups(info[key])
            )
    return model


def _weight_groups(names: list[str]) -> str:
    """``model.layers.4.mlp.up_proj.weight, ...`` as ``model.layers.4, model.layers.5, score.weight``."""
    groups = {re.sub(r"(\.layers\.\d+)\..*", r"\1", name) for name in names}
    return ", ".join(sorted(groups))


def _load_full_model(cfg: PolicyConfig, hf_config: Any, auto_class: Any, lora_cfg: LoraConfig) -> nn.Module:
    """``cfg.model_name`` whole on the host in float32, with ``lora_cfg``'s adapters when enabled: weights the
    checkpoint lacks, then the adapters' ``A``, are drawn from an RNG seeded with ``_NEW_HEAD_SEED``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_NEW_HEAD_SEED)
        model = _from_pretrained(auto_class, cfg.model_name, hf_config, cfg.trust_remote_code)
        if lora_cfg.enabled:
            apply_lora(model, lora_cfg)
    return model


def initial_lora_adapters(cfg: PolicyConfig, lora_cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """The adapters ``lora_cfg`` starts ``cfg.model_name`` with (full tensors by Hugging Face name, e.g.
    ``model.layers.0.self_attn.q_proj.lora_A``): the same draws as :func:`load_sharded_model`'s, so every
    backend given the same adapters starts from the same ones. Loads the model on the host (call on one rank)."""
    hf_config = load_hf_config(cfg)
    model = _load_full_model(cfg, hf_config, model_auto_class(cfg, hf_config), lora_cfg)
    return adapter_state((name, param.detach()) for name, param in model.named_parameters())


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def load_sharded_model(cfg: PolicyConfig, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Load ``cfg.model_name`` (local path or hub name), sharded over ``mesh`` (axes ``dp``, ``cp``, ``tp``;
    FSDP2 over ``dp x cp``).

    Master weights are float32 whatever ``cfg.precision`` is; FSDP computes in ``cfg.precision``.
    """
    trust = cfg.trust_remote_code
    hf_config = load_hf_config(cfg)
    check_vlm_policy(cfg, hf_config)
    auto_class = model_auto_class(cfg, hf_config)
    full_model: nn.Module | None = None
    lora_cfg = cfg.dtensor_cfg.lora_cfg
    if dist.get_rank() == 0:
        # The adapters are drawn here and broadcast with the base weights below.
        full_model = _load_full_model(cfg, hf_config, auto_class, lora_cfg)
    with torch.device("meta"):
        model = auto_class.from_config(hf_config, dtype=torch.float32, trust_remote_code=trust)
        if lora_cfg.enabled:
            apply_lora(model, lora_cfg)
    # What HF's own save_pretrained records, so an export names the class it was trained as.
    model.config.architectures = [type(model).__name__]
    dtensor_cfg = cfg.dtensor_cfg
    if dtensor_cfg.activation_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2's per-layer all-gathers.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_tensor_parallel(model, mesh["tp"], dtensor_cfg.sequence_parallel, dtensor_cfg.custom_parallel_plan)
    # On CPU the "device" is host memory, which holds the full model: gather each layer once per pass (see
    # apply_fsdp), since on CPU every collective costs compute time the ranks share with the gloo threads.
    fsdp = needs_fsdp(mesh, PRECISION_DTYPES[cfg.precision], dtensor_cfg.cpu_offload)
    if dtensor_cfg.data_parallel_mode == "replicate":  # float32, TP 1, no offload (checked by the schema)
        fsdp = False
    if fsdp:
        apply_fsdp(
            model,
            fsdp_mesh(mesh),
            PRECISION_DTYPES[cfg.precision],
            dtensor_cfg.cpu_offload,
            reshard_after_forward=device.type != "cpu",
            replicated=vision_tower(model),
        )
    # With CPU offload FSDP keeps the sharded parameters on the host; only buffers go to the device.
    model.to_empty(device="cpu" if dtensor_cfg.cpu_offload else device)
    if not fsdp:
        # to_empty gives each module its own tensor; FSDP keeps a tied parameter one, a plain module re-ties.
        model.tie_weights()
    if dtensor_cfg.cpu_offload:
        _buffers_to(model, device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full_state = full_model.state_dict() if full_model is not None else {}
    set_model_state_dict(
        model,
        full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    _sync_non_persistent_buffers(model, full_model)
    del full_model, full_state
    return model


LORA_ADAPTER_SUBDIR = "lora_adapter"
"""Where, inside a LoRA run's Hugging Face export, the PEFT adapter folder goes."""


@dataclasses.dataclass(frozen=True)
class LoraExport:
    """What an export of a LoRA-adapted model needs besides the model: the adapters' settings and layers."""

    cfg: LoraConfig
    targets: list[str]
    """The adapted layers' module names."""
    base_model: str
    """``policy.model_name``, recorded as the PEFT adapter's base model."""

    def save_adapter(self, model: nn.Module, state: dict[str, Any], path: str) -> None:
        """Write the adapters in ``state`` (full tensors) as a PEFT folder at ``path``."""
        adapters = adapter_state(state.items())
        all_linear = lora_targets(model, LoraConfig(match_all_linear=True))
        save_peft_adapter(
            path, adapters, self.cfg, self.base_model, peft_target_modules(self.targets, all_linear)
        )


def _hf_weight_names(model: nn.Module) -> set[str]:
    """Names a HF checkpoint stores: parameters (tied duplicates removed) and persistent buffers."""
    names = {name for name, _ in model.named_parameters()}
    non_persistent = {f"{m}.{b}" if m else b for m, b, _ in _non_persistent_buffers(model)}
    names |= {name for name, _ in model.named_buffers() if name not in non_persistent}
    return names


def _save_processor(tokenizer_cfg: TokenizerConfig, path: str, trust_remote_code: bool) -> None:
    """Copy the Hugging Face processor of ``tokenizer_cfg.name`` (a vision-language model's) into ``path``."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tokenizer_cfg.name, trust_remote_code=trust_remote_code)
    processor.save_pretrained(path)


def export_hf_checkpoint(
    model: nn.Module,
    path: str,
    dtype: torch.dtype,
    tokenizer_cfg: TokenizerConfig | None,
    trust_remote_code: bool,
    lora: LoraExport | None = None,
) -> None:
    """Write ``model`` as a HF checkpoint at ``path``; a collective, rank 0 writes.

    With ``lora`` (a model :func:`~nemo_rl.models.lora.apply_lora` adapted) the checkpoint holds the merged
    weights (``W + (alpha / r) B A``), and ``path``/:data:`LORA_ADAPTER_SUBDIR` the adapters alone as a PEFT
    folder (``peft.PeftModel.from_pretrained(base_model, that_folder)``).

    The full state dict is gathered to rank 0's CPU, cast to ``dtype`` and saved as (sharded) safetensors
    with the model's config and generation config, and the tokenizer ``tokenizer_cfg`` names (with its chat
    template override) if given; for a vision-language model with its processor too.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        keep = _hf_weight_names(model)
        if lora is not None:
            lora.save_adapter(model, state, os.path.join(path, LORA_ADAPTER_SUBDIR))
            tensors_in = ((name, cast(torch.Tensor, value)) for name, value in state.items())
            state = dict(merged_weights(tensors_in, lora.cfg.alpha / lora.cfg.dim, set(lora.targets)))
        tensors: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            if name in keep:
                assert isinstance(value, torch.Tensor), f"{name} is a {type(value).__name__}, not a tensor"
                value = value.to(dtype) if value.is_floating_point() else value
                if value.untyped_storage().nbytes() > value.numel() * value.element_size():
                    # A view into a larger gathered buffer (a reward model's head under FSDP): safetensors
                    # writes whole storages and refuses one the tensor does not cover.
                    value = value.clone()
                tensors[name] = value
        os.makedirs(path, exist_ok=True)
        save_torch_state_dict(tensors, path, metadata={"format": "pt"})
        hf_config: Any = copy.deepcopy(model.config)
        hf_config.dtype = dtype
        hf_config.save_pretrained(path)
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(path)
        if tokenizer_cfg is not None and is_vision_language(hf_config):
            # The image processor (and the processor's own settings) go first; the tokenizer below then
            # replaces the processor's copy of it with the one the run used (its chat-template override).
            _save_processor(tokenizer_cfg, path, trust_remote_code)
        if tokenizer_cfg is not None:
            # Through get_tokenizer, not AutoTokenizer: AutoTokenizer swaps in the model family's tokenizer
            # class (e.g. Qwen2Tokenizer for qwen2 checkpoints), which silently mangles custom tokenizers.
            tokenizer = get_tokenizer(tokenizer_cfg, model_name=None, trust_remote_code=trust_remote_code)
            tokenizer.save_pretrained(path)
        logger.info("exported a Hugging Face checkpoint with %d tensors to %s", len(tensors), path)
    del state
    dist.barrier()
