"""LoRA adapters on a Megatron ``GPTModel``, equal to the Hugging Face side's (``policy.megatron_cfg.peft``).

An adapted Megatron linear layer carries one adapter per Hugging Face layer it fuses
(:data:`~nemo_rl.models.megatron.families.ADAPTED_LINEARS`): ``linear_qkv`` three (``q_proj``, ``k_proj``,
``v_proj``, each with its own ``A`` and ``B``), ``linear_fc1`` two (``gate_proj``, ``up_proj``), ``linear_proj``
and ``linear_fc2`` one. Each update ``(alpha / r) B A x`` lands in the rows of the fused output that hold its
Hugging Face layer, so the Megatron model computes exactly what the Hugging Face model adapted by
:func:`nemo_rl.models.lora.apply_lora` computes, gradients included, and its adapters ARE the Hugging Face
adapters: checkpoints, refits and PEFT exports use their names (``model.layers.0.self_attn.q_proj.lora_A``).

Tensor parallelism (TP ranks r; x is the layer's input, SP = sequence parallelism):

- column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` replicated, ``B`` split by output rows like the fused
  weight (query groups for qkv, gate / up blocks for fc1). ``h = A x`` goes through
  ``copy_to_tensor_model_parallel_region`` (its gradient is summed over TP in the backward pass, so ``A``'s
  gradient is whole on every rank); with SP, ``h`` is computed on the rank's sequence slice and all-gathered,
  and ``A``'s gradient is summed over TP by Megatron's gradient finalisation (``sequence_parallel``).
- row-parallel (``linear_proj``, ``linear_fc2``): ``A`` split by input columns like the weight, ``B``
  replicated. The partial ``A x`` are summed over TP (reduce-scattered along the sequence with SP, where
  ``B``'s gradient is then summed over TP too).

The adapter is a child module ``lora`` of the Megatron linear layer, added to its output by a forward hook:
the layer's own parameters keep their names and its class (local or Transformer Engine) does not matter.
Every other parameter is frozen: only the adapters have gradients and optimizer state.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    get_cuda_rng_tracker,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from nemo_rl.config.lora import MEGATRON_LINEARS, LoraConfig, MegatronPeftConfig
from nemo_rl.config.model_arch import ModelArch
from nemo_rl.models.lora import merged_weights, peft_target_modules, save_peft_adapter
from nemo_rl.models.megatron.families import ADAPTED_LINEARS, AdaptedLinear

REPLICATED_DROPOUT_RNG = "nemo-rl-lora-replicated"
"""Megatron RNG tracker state for dropout on activations every tensor-parallel rank holds whole (the same
mask on each); dropout on split activations draws from Megatron's tensor-parallel state."""

assert tuple(ADAPTED_LINEARS) == MEGATRON_LINEARS


def _matches(path: str, key: str, patterns: Iterable[str]) -> bool:
    return any(
        fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(path, pattern) for pattern in patterns
    )


def select_linears(cfg: MegatronPeftConfig, num_layers: int) -> dict[int, list[str]]:
    """``{global layer: [adapted linear names]}`` of ``cfg`` on a ``num_layers``-layer decoder.

    A pattern (a glob) matches a name of :data:`~nemo_rl.config.lora.MEGATRON_LINEARS` or the path
    ``decoder.layers.<i>.<module>``; one that matches no layer raises ``ValueError``.
    """
    paths = [
        (layer, key, f"decoder.layers.{layer}.{linear.megatron}")
        for layer in range(num_layers)
        for key, linear in ADAPTED_LINEARS.items()
    ]
    for pattern in [*cfg.target_modules, *cfg.exclude_modules]:
        if not any(_matches(path, key, [pattern]) for _, key, path in paths):
            raise ValueError(
                f"policy.megatron_cfg.peft pattern {pattern!r} matches no layer of the model (paths like "
                f"{paths[0][2]!r}, layers 0 to {num_layers - 1})"
            )
    selected: dict[int, list[str]] = {}
    for layer, key, path in paths:
        chosen = _matches(path, key, cfg.target_modules) if cfg.target_modules else True
        if chosen and not _matches(path, key, cfg.exclude_modules):
            selected.setdefault(layer, []).append(key)
    if not selected:
        raise ValueError("policy.megatron_cfg.peft.exclude_modules excludes every linear layer: adapt some")
    return selected


def hf_modules(selected: dict[int, list[str]]) -> list[str]:
    """The Hugging Face layers (module paths) whose adapters the ``selected`` Megatron layers carry."""
    return [
        f"model.layers.{layer}.{hf}"
        for layer, keys in sorted(selected.items())
        for key in keys
        for hf in ADAPTED_LINEARS[key].hf
    ]


class LoRAPair(nn.Module):
    """One Hugging Face layer's adapter: this rank's slices of ``lora_A`` [r, in] and ``lora_B`` [out, r]."""

    def __init__(
        self, shape_A: tuple[int, int], shape_B: tuple[int, int], dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(shape_A, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(shape_B, dtype=dtype, device=device))


class ParallelLoRA(nn.Module):
    """The adapters of one Megatron linear layer; ``forward(x)`` is their update in the layer's local output
    layout (see the module docstring)."""

    def __init__(
        self,
        linear: AdaptedLinear,
        shapes: dict[str, tuple[int, int]],
        cfg: MegatronPeftConfig,
        config: TransformerConfig,
        num_groups: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        tp = config.tensor_model_parallel_size
        self.column_parallel = linear.column_parallel
        self.sequence_parallel = config.sequence_parallel
        self.num_groups = num_groups
        """Output blocks each part owns a slice of, interleaved: the local query groups of qkv, else 1."""
        self.scale = cfg.alpha / cfg.dim
        self.dropout = cfg.dropout
        self.dropout_position = cfg.dropout_position
        self.lora_enabled = True
        self.parts = [hf.rsplit(".", 1)[-1] for hf in linear.hf]
        """The Hugging Face layers' last names (``q_proj``...), each the name of its :class:`LoRAPair` child."""
        for hf in linear.hf:
            out_features, in_features = shapes[hf.rsplit(".", 1)[-1]]
            if linear.column_parallel:
                pair = LoRAPair(
                    (cfg.dim, in_features), (out_features // tp, cfg.dim), config.params_dtype, device
                )
                set_tensor_model_parallel_attributes(pair.lora_B, True, 0, 1)
                # With SP, A sees one sequence slice per rank: its gradient is summed over TP.
                pair.lora_A.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
            else:
                pair = LoRAPair(
                    (cfg.dim, in_features // tp), (out_features, cfg.dim), config.params_dtype, device
                )
                set_tensor_model_parallel_attributes(pair.lora_A, True, 1, 1)
                pair.lora_B.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
            self.add_module(hf.rsplit(".", 1)[-1], pair)

    def _dropout(self, x: torch.Tensor, whole: bool) -> torch.Tensor:
        """Dropout with the same mask on every TP rank for an activation each rank holds ``whole``."""
        with get_cuda_rng_tracker().fork(
            REPLICATED_DROPOUT_RNG if whole else _MODEL_PARALLEL_RNG_TRACKER_NAME
        ):
            return F.dropout(x, self.dropout, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update ``scale * B A x`` of every part, laid out as the layer's local output."""
        dropout = self.dropout > 0 and self.training
        # The input of a column-parallel layer is whole on every rank (without SP), a row-parallel one's split.
        if dropout and self.dropout_position == "pre":
            x = self._dropout(x, whole=self.column_parallel and not self.sequence_parallel)
        pairs = [cast(LoRAPair, self.get_submodule(part)) for part in self.parts]
        if self.column_parallel:
            updates = []
            for pair in pairs:
                h = F.linear(x, pair.lora_A)
                if self.sequence_parallel:
                    h = gather_from_sequence_parallel_region(h)
                else:
                    h = copy_to_tensor_model_parallel_region(h)
                updates.append(F.linear(h, pair.lora_B).unflatten(-1, (self.num_groups, -1)))
            update = torch.cat(updates, dim=-1).flatten(-2)
        else:
            h = F.linear(x, pairs[0].lora_A)
            if self.sequence_parallel:
                h = reduce_scatter_to_sequence_parallel_region(h)
            else:
                h = reduce_from_tensor_model_parallel_region(h)
            update = F.linear(h, pairs[0].lora_B)
        if dropout and self.dropout_position == "post":
            update = self._dropout(update, whole=not self.column_parallel and not self.sequence_parallel)
        return update * self.scale


def _add_update(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook of an adapted linear layer: its ``(output, bias)`` plus the adapters' update."""
    adapter = cast(ParallelLoRA, module.lora)
    if not adapter.lora_enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x), bias


def _hf_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each Hugging Face linear layer of a decoder layer, by its last name."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, f = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "down_proj": (h, f),
    }


@dataclass(frozen=True)
class MegatronLoRA:
    """The adapters of a Megatron policy: which layers, their settings, and the Hugging Face view of them."""

    cfg: MegatronPeftConfig
    selected: dict[int, list[str]]
    """Adapted linear layers (:data:`ADAPTED_LINEARS` names) by global decoder layer."""
    num_layers: int

    @classmethod
    def from_config(cls, cfg: MegatronPeftConfig, num_layers: int) -> MegatronLoRA:
        """The adapters ``cfg`` selects on a ``num_layers``-layer decoder (``ValueError`` for a bad pattern)."""
        return cls(cfg, select_linears(cfg, num_layers), num_layers)

    @property
    def hf_targets(self) -> list[str]:
        """The adapted Hugging Face layers' module paths."""
        return hf_modules(self.selected)

    @property
    def all_hf_linears(self) -> list[str]:
        """Every adaptable Hugging Face layer of the decoder (for PEFT's ``target_modules``)."""
        return hf_modules({layer: list(ADAPTED_LINEARS) for layer in range(self.num_layers)})

    @property
    def lora_config(self) -> LoraConfig:
        """The Hugging Face side's config of these adapters (drawing, merging, metadata, PEFT export)."""
        return self.cfg.lora_config(self.hf_targets)

    def num_params(self, arch: ModelArch) -> int:
        """Parameters of all the adapters, full (unsharded): ``dim * (in + out)`` per adapted layer."""
        shapes = _hf_shapes(arch)
        return sum(self.cfg.dim * sum(shapes[module.rsplit(".", 1)[-1]]) for module in self.hf_targets)

    def merged(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """A Hugging Face weight stream with the adapters folded into their layers' weights (and dropped)."""
        return merged_weights(named, self.cfg.alpha / self.cfg.dim, set(self.hf_targets))

    def save_peft(self, path: str, stage_adapters: dict[str, torch.Tensor], base_model: str) -> None:
        """Write the adapters as a PEFT folder at ``path``: a collective; each stage's writer passes its
        stage's adapters (full tensors), the other ranks nothing, and global rank 0 writes them all."""
        gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {name: t.detach().cpu() for name, t in stage_adapters.items()})
        if dist.get_rank() == 0:
            adapters = {name: t for part in gathered if part for name, t in part.items()}
            targets = peft_target_modules(self.hf_targets, self.all_hf_linears)
            save_peft_adapter(path, adapters, self.lora_config, base_model, targets)

    def attach(self, gpt: nn.Module, arch: ModelArch, config: TransformerConfig) -> None:
        """Add the adapters of this rank's stage to ``gpt`` (before loading and wrapping it) and freeze the rest.

        ``A`` starts empty and ``B`` at zero: load the initial adapters with the stage's weight rules.
        """
        for param in gpt.parameters():
            param.requires_grad_(False)
        tracker = get_cuda_rng_tracker()
        if REPLICATED_DROPOUT_RNG not in tracker.get_states():
            # One stream per data-parallel replica and stage, the same on the ranks of a TP group.
            seed = 7919 + 1000 * parallel_state.get_pipeline_model_parallel_rank()
            tracker.add(REPLICATED_DROPOUT_RNG, seed + parallel_state.get_data_parallel_rank())
        shapes = _hf_shapes(arch)
        query_groups = arch.num_kv_heads // config.tensor_model_parallel_size
        decoder: Any = gpt.decoder
        for layer in decoder.layers:
            for key in self.selected.get(int(layer.layer_number) - 1, ()):
                linear = ADAPTED_LINEARS[key]
                module = layer.get_submodule(linear.megatron)
                groups = query_groups if key == "linear_qkv" else 1
                module.lora = ParallelLoRA(linear, shapes, self.cfg, config, groups, module.weight.device)
                module.register_forward_hook(_add_update, with_kwargs=True)
