"""LoRA adapters on a model's linear layers (``policy.dtensor_cfg.lora_cfg``, :mod:`nemo_rl.config.lora`).

:func:`apply_lora` turns each chosen ``nn.Linear`` into a :class:`LoRALinear` in place: the same module (its
``weight`` and ``bias`` keep their names, so checkpoints, refits and tensor-parallel plans of the base model
apply unchanged) with two more parameters, ``lora_A`` [r, in] and ``lora_B`` [out, r], and the forward
``x W^T + b + (alpha / r) * B A x``. Every other parameter is frozen.

Names: an adapter parameter is ``<module>.lora_A`` / ``<module>.lora_B`` in the model;
:func:`peft_name` gives PEFT's ``base_model.model.<module>.lora_A.weight`` for exports.

Because the module stays an ``nn.Linear``, a TP plan's ``ColwiseParallel`` / ``RowwiseParallel`` shards the
adapter parameters with the weight (dim 0 or 1 of each), and DTensor computes the adapter path on whatever
layouts result. FSDP2 shards them like any parameter of the layer.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from nemo_rl.config.lora import LoraConfig, select_lora_targets

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
"""Endings of the adapter parameters' names."""

LORA_METADATA_FILE = "lora.json"
"""Written next to an adapter-only checkpoint: the base model and the adapters' config."""

_T = TypeVar("_T")

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA update; made by :func:`apply_lora` from an existing layer."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scale: float
    lora_dropout: float
    lora_dropout_position: str
    lora_enabled: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return out
        dropout = self.lora_dropout if self.training else 0.0
        if self.lora_dropout_position == "pre" and dropout > 0:
            x = F.dropout(x, dropout, training=True)
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)
        if self.lora_dropout_position == "post" and dropout > 0:
            update = F.dropout(update, dropout, training=True)
        return out + update * self.lora_scale


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (``<module>.lora_A`` / ``<module>.lora_B``)."""
    return name.endswith(ADAPTER_SUFFIXES)


def lora_targets(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Names of the linear layers ``cfg`` adapts, in module order; raises ``ValueError`` when there are none.

    The output head (``get_output_embeddings()``, or a reward model's ``score``) is never adapted.
    """
    heads = {id(m) for m in (_output_embeddings(model), getattr(model, "score", None)) if m is not None}
    linears = [
        name for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in heads and name
    ]
    return select_lora_targets(linears, cfg)


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    return getter() if callable(getter) else None


def _init_lora_A(weight: torch.Tensor, method: str) -> None:
    if method == "xavier":
        nn.init.xavier_normal_(weight)
    else:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Add adapters to the layers :func:`lora_targets` picks, freeze everything else; returns those names.

    The new ``lora_A`` start as ``cfg.lora_A_init`` draws from torch's global RNG (seed it first for
    reproducible adapters) and ``lora_B`` at zero, on the layer's device and dtype: on a ``meta`` model they
    are meta tensors too, to be filled by a state-dict load.
    """
    targets = lora_targets(model, cfg)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in targets:
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear)
        weight = module.weight
        lora_A = torch.empty(cfg.dim, module.in_features, device=weight.device, dtype=weight.dtype)
        lora_B = torch.zeros(module.out_features, cfg.dim, device=weight.device, dtype=weight.dtype)
        if weight.device.type != "meta":
            _init_lora_A(lora_A, cfg.lora_A_init)
        module.__class__ = LoRALinear
        adapted = cast(LoRALinear, module)
        adapted.register_parameter("lora_A", nn.Parameter(lora_A))
        adapted.register_parameter("lora_B", nn.Parameter(lora_B))
        adapted.lora_scale = cfg.alpha / cfg.dim
        adapted.lora_dropout = cfg.dropout
        adapted.lora_dropout_position = cfg.dropout_position
        adapted.lora_enabled = True
    return targets


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """The model's :class:`LoRALinear` layers with their names."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run the block with every adapter switched off: the model computes as the frozen base model.

    Every module with a ``lora_enabled`` switch counts: :class:`LoRALinear`, and the Megatron backend's
    adapters (``nemo_rl.models.megatron.lora``)."""
    modules = [module for module in model.modules() if hasattr(module, "lora_enabled")]
    for module in modules:
        setattr(module, "lora_enabled", False)  # noqa: B010 (a plain attribute, not an nn.Module field)
    try:
        yield
    finally:
        for module in modules:
            setattr(module, "lora_enabled", True)  # noqa: B010


def merge_lora(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float
) -> torch.Tensor:
    """``weight + scale * B @ A``, computed in float32 and returned in ``weight``'s dtype."""
    delta = (lora_B.float() @ lora_A.float()) * scale
    return (weight.float() + delta).to(weight.dtype)


def merged_weights(
    named: Iterable[tuple[str, torch.Tensor]], scale: float, adapted: Collection[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full weights with the adapters folded in: the ``<module>.weight`` of each module in ``adapted`` becomes
    ``weight + scale * B A`` once its ``lora_A`` and ``lora_B`` have arrived too (in ``named_parameters``
    order the three are close together); the adapter tensors themselves are not yielded."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        module, _, leaf = name.rpartition(".")
        if module not in adapted or leaf not in ("weight", "lora_A", "lora_B"):
            yield name, tensor
            continue
        parts = held.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) == 3:
            del held[module]
            yield f"{module}.weight", merge_lora(parts["weight"], parts["lora_A"], parts["lora_B"], scale)
    if held:
        raise ValueError(f"incomplete adapted layers in the weight stream: {sorted(held)}")


def adapter_state(named: Iterable[tuple[str, _T]]) -> dict[str, _T]:
    """The adapter entries of a ``(name, tensor)`` stream (or of a state dict's items), by name."""
    return {name: tensor for name, tensor in named if is_adapter_name(name)}


def peft_name(name: str) -> str:
    """PEFT's name of an adapter parameter: ``a.b.lora_A`` -> ``base_model.model.a.b.lora_A.weight``."""
    return f"base_model.model.{name}.weight"


def peft_target_modules(targets: list[str], all_linear: list[str]) -> list[str]:
    """PEFT's ``target_modules`` for the adapted layers: their last names where those pick exactly these
    layers among ``all_linear`` (the usual case, e.g. ``[q_proj, v_proj]``), else their full paths."""
    leaves = sorted({name.rsplit(".", 1)[-1] for name in targets})
    by_leaf = [name for name in all_linear if name.rsplit(".", 1)[-1] in leaves]
    return leaves if sorted(by_leaf) == sorted(targets) else sorted(targets)


def peft_adapter_config(cfg: LoraConfig, base_model: str, target_modules: list[str]) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT LoRA adapter with these settings."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.dim,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def save_peft_adapter(
    path: str | Path,
    adapters: dict[str, torch.Tensor],
    cfg: LoraConfig,
    base_model: str,
    target_modules: list[str],
) -> None:
    """Write ``adapters`` (model names -> full tensors) as a PEFT adapter folder at ``path``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {peft_name(name): tensor.detach().contiguous().cpu() for name, tensor in adapters.items()}
    save_file(tensors, str(out / PEFT_WEIGHTS_FILE), metadata={"format": "pt"})
    config = peft_adapter_config(cfg, base_model, target_modules)
    (out / PEFT_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def write_lora_metadata(path: str | Path, cfg: LoraConfig, base_model: str) -> None:
    """Record, next to an adapter-only checkpoint, which base model and adapter settings it needs."""
    payload = {"base_model": base_model, "lora_cfg": cfg.model_dump()}
    (Path(path) / LORA_METADATA_FILE).write_text(json.dumps(payload, indent=2) + "\n")


def read_lora_metadata(path: str | Path) -> dict[str, Any] | None:
    """What :func:`write_lora_metadata` wrote in ``path``, or None for a full checkpoint."""
    file = Path(path) / LORA_METADATA_FILE
    return json.loads(file.read_text()) if file.is_file() else None


def check_checkpoint_kind(weights_path: str | Path, has_lora: bool, setting: str) -> None:
    """Refuse to load a full checkpoint into a LoRA policy or adapters into a full one (a clear error instead
    of a missing-weight report); ``setting`` is the config key that enables LoRA on the policy's backend."""
    metadata = read_lora_metadata(weights_path)
    if bool(metadata) != has_lora:
        kind = "LoRA adapters" if metadata else "a full model"
        raise ValueError(
            f"{weights_path} holds {kind}, but this policy has {setting}={has_lora}: resume with the setting "
            "the checkpoint was written with"
        )


@torch.no_grad()
def merge_and_unload(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer's weight and turn the layer back into a plain ``nn.Linear``, in place
    (a model any Hugging Face tool loads); returns ``model``."""
    for _, module in list(lora_modules(model)):
        module.weight.copy_(merge_lora(module.weight, module.lora_A, module.lora_B, module.lora_scale))
        del module.lora_A, module.lora_B
        cast(nn.Module, module).__class__ = nn.Linear
    for param in model.parameters():
        param.requires_grad_(True)
    return model
