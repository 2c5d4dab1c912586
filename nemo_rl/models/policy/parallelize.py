"""Parallelisation plans applied to Hugging Face causal LMs (and their reward-model variants, whose scalar
``score`` head replaces the LM head) from outside the model code.

Two independent steps, applied in this order to a model (usually still on the meta device):

1. :func:`apply_tensor_parallel` shards the linear layers of each decoder layer over the ``tp`` mesh axis
   (Megatron-style: column-parallel q/k/v/gate/up, row-parallel o/down), shards the embedding and the LM head
   over the vocabulary, and, with sequence parallelism, shards the activations between those regions (the
   RMSNorms) along the sequence dim. The LM head's output is all-gathered, so callers always see full-vocab
   logits as a plain tensor; a reward head is split over its input and its partial scores summed.
2. :func:`apply_fsdp` wraps every decoder layer and then the root with FSDP2 ``fully_shard`` over the ``dp``
   mesh axis and makes gradient reduction a plain SUM (see the function for why). A one-rank float32 policy
   skips it (:func:`needs_fsdp`) and trains as a plain module.

Tensor legend: B = batch, T = sequence, H = hidden, V = vocabulary.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemo_rl.models.vlm import LANGUAGE_MODEL, is_vision_language

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.parallel import ParallelStyle

# FSDP2 and DTensor (torch.distributed.fsdp / .tensor) are imported inside the functions that use them: they
# cost seconds of CPU to import, and the driver imports this module (through the policy worker's) without
# ever sharding a model.

# Model families whose decoder layers use the Llama module names (self_attn.{q,k,v,o}_proj,
# mlp.{gate,up,down}_proj, input_layernorm / post_attention_layernorm, model.norm, lm_head).
LLAMA_LIKE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})

CustomPlanFn = Callable[[nn.Module, DeviceMesh, bool], None]


REWARD_HEAD = "score"
"""Module name of the scalar head of Hugging Face ``*ForSequenceClassification`` models."""


def _head_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of the model's output head: the LM head of a causal LM, or the scalar reward head.

    The LM head is sharded over the vocabulary and its logits all-gathered. A reward head has one output,
    which cannot be split, so it is split over its input (the hidden size) and the partial scores are summed.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    head_input = Shard(1) if sequence_parallel else Replicate()
    if isinstance(getattr(model, REWARD_HEAD, None), nn.Linear):
        return {
            REWARD_HEAD: RowwiseParallel(
                input_layouts=head_input, output_layouts=Replicate(), use_local_output=True
            )
        }
    return {
        "lm_head": ColwiseParallel(
            input_layouts=head_input, output_layouts=Replicate(), use_local_output=True
        )
    }


def _llama_like_plan(
    model_type: str, sequence_parallel: bool, body: str = "model"
) -> dict[str, ParallelStyle]:
    """The TP (and optionally SP) plan of a Llama-like model's body (the module at ``body``: ``model``, or a
    vision-language model's ``model.language_model``), keyed by module path pattern."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    layer = f"{body}.layers.*"
    plan: dict[str, ParallelStyle] = {
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
    }
    if model_type == "qwen3":
        # Qwen3 normalises q and k per head after the projection, on [B, T, heads, head_dim] views whose
        # heads dim is sharded here. Each TP rank sees different heads, so the norm weights' gradients are
        # partial sums: treating the heads dim as a sharded "sequence" dim makes DTensor all-reduce them.
        plan[f"{layer}.self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan[f"{layer}.self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sequence_parallel:
        plan.update(
            {
                f"{body}.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                f"{layer}.self_attn.o_proj": RowwiseParallel(),
                f"{layer}.mlp.down_proj": RowwiseParallel(),
            }
        )
        return plan
    # Sequence parallel: the residual stream stays a DTensor sharded on the sequence dim (Shard(1)) from the
    # embedding to the final norm, so the HF model code's residual additions see two DTensors of the same
    # layout. Attention and MLP inputs are all-gathered to full sequences, their outputs reduce-scattered.
    plan.update(
        {
            f"{body}.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            f"{layer}.input_layernorm": SequenceParallel(),
            f"{layer}.post_attention_layernorm": SequenceParallel(),
            f"{layer}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            ),
            f"{layer}.mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
            f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"{body}.norm": SequenceParallel(),
        }
    )
    return plan


def _check_divisible(config: Any, tp_size: int) -> None:
    """Raise when the model's heads or KV heads cannot be split evenly over ``tp_size`` ranks."""
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    for what, count in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads)):
        if count % tp_size != 0:
            raise ValueError(
                f"the model's {what} ({count}) is not divisible by "
                f"policy.dtensor_cfg.tensor_parallel_size ({tp_size}); choose a TP size that divides it"
            )


def import_by_path(path: str) -> Any:
    """Import ``package.module.attr`` and return ``attr``; the error names the path when it fails."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"expected an import path like `package.module.name`, got {path!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from import path {path!r})")
    return getattr(module, attr)


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, custom_parallel_plan: str | None
) -> None:
    """Shard ``model`` in place over ``tp_mesh`` (a 1-D mesh); a no-op when the mesh has one rank.

    Uses ``custom_parallel_plan`` (import path of a ``(model, tp_mesh, sequence_parallel) -> None`` function)
    when given, else the built-in plan of the model's family. Tied input/output embeddings stay tied: both
    modules shard the same ``[V, H]`` weight along V.
    """
    if tp_mesh.size() == 1:
        if sequence_parallel:
            raise ValueError(
                "policy.dtensor_cfg.sequence_parallel needs tensor_parallel_size > 1; disable it or raise TP"
            )
        return
    config: Any = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # A vision-language model's language model is a Qwen2 decoder under model.language_model; its vision
    # tower is left whole (replicated, see nemo_rl.models.vlm).
    vlm = is_vision_language(config)
    config = config.text_config if vlm else config
    _check_divisible(config, tp_mesh.size())
    if custom_parallel_plan is not None:
        plan_fn: CustomPlanFn = import_by_path(custom_parallel_plan)
        plan_fn(model, tp_mesh, sequence_parallel)
    else:
        model_type = "qwen2" if vlm else config.model_type
        if model_type not in LLAMA_LIKE_MODEL_TYPES:
            raise ValueError(
                f"no built-in tensor-parallel plan for model type {model_type!r} (known: "
                f"{sorted(LLAMA_LIKE_MODEL_TYPES)}); set policy.dtensor_cfg.custom_parallel_plan to the import "
                "path of a function (model, tp_mesh, sequence_parallel) -> None, or use tensor_parallel_size=1"
            )
        from torch.distributed.tensor.parallel import parallelize_module

        body = LANGUAGE_MODEL if vlm else "model"
        plan = _llama_like_plan(model_type, sequence_parallel, body) | _head_plan(model, sequence_parallel)
        parallelize_module(model, tp_mesh, plan)
    output_embeddings = model.get_output_embeddings()  # type: ignore[operator]
    if tied and output_embeddings is not None:
        # parallelize_module registers a new Parameter on each module, which unties them; both are Shard(0)
        # DTensors of the same global weight, so sharing the embedding's parameter restores the tie exactly.
        # (A reward model has no output embedding: its scalar head replaces the LM head.)
        output_embeddings.weight = model.get_input_embeddings().weight  # type: ignore[operator]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: modules whose class HF lists in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__}: it declares no `_no_split_modules`"
        )
    return layers


def needs_fsdp(mesh: DeviceMesh, param_dtype: torch.dtype, cpu_offload: bool) -> bool:
    """Whether :func:`apply_fsdp` must wrap the model: more than one rank, compute in a dtype other than the
    float32 master weights (FSDP's mixed precision casts them), or CPU offload.

    On a one-rank mesh in float32 FSDP2 only turns every parameter into a DTensor and "all-gathers" it to the
    same rank: per-op DTensor dispatch and the hooks cost about an eighth of a small model's step on CPU, and
    the plain module computes the same numbers. Everything downstream takes either kind of parameter:
    checkpoints (``torch.distributed.checkpoint`` saves plain tensors as whole ones and loads them into any
    later layout), the refit (:meth:`iter_hf_weights` copies plain parameters), the reference snapshot and
    gradient clipping.
    """
    return mesh.size() > 1 or param_dtype != torch.float32 or cpu_offload


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    cpu_offload: bool,
    reshard_after_forward: bool = True,
    replicated: nn.Module | None = None,
) -> FSDPModule:
    """Wrap every decoder layer, then the root, with FSDP2 over ``dp_mesh``; returns the root.

    ``replicated`` (a vision-language model's vision tower) is left out: its parameters stay plain tensors,
    whole on every rank, and the worker sums their gradients itself (see ``nemo_rl.models.vlm``).

    Parameters stay in float32 (the master copy the optimizer updates); ``param_dtype`` is the dtype they
    are all-gathered in for forward and backward. Gradients are reduced in float32.

    FSDP averages gradients over the dp ranks by default. Our losses are already normalised by the
    *global* token/sequence counts (each rank returns its share of the global loss), so the step's gradient
    is the SUM of the ranks' gradients; the reduction is set to a plain sum with no division.

    ``reshard_after_forward=False`` keeps each layer's gathered parameters from its forward to its backward
    (one all-gather per layer instead of two), for devices whose memory holds the full model.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if cpu_offload else None
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    left_out = set(replicated.modules()) if replicated is not None else set()
    for layer in decoder_layers(model):
        if layer not in left_out:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    ignored = {p for m in left_out for p in m.parameters(recurse=False)}
    root = fully_shard(model, ignored_params=ignored or None, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Pre/post-scaling by 1 with SUM collectives: PREMUL_SUM is NCCL-only, this works on gloo too.
            module.set_force_sum_reduction_for_comms(True)
    return root


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a (possibly DTensor) tensor, sharing its storage."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def reshard_all(model: nn.Module) -> None:
    """Return every FSDP unit to its sharded state (the root stays unsharded after a forward otherwise)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp_units_of_parameters(model: nn.Module) -> dict[str, FSDPModule]:
    """The FSDP unit (the innermost ``fully_shard``-ed module) that holds each parameter, by parameter name."""
    from torch.distributed.fsdp import FSDPModule

    owners: dict[str, FSDPModule] = {}
    # Parents come before their children, so an inner unit overrides the root for its own parameters.
    for module_name, module in model.named_modules():
        names = [name for name, _ in module.named_parameters(prefix=module_name)]
        if isinstance(module, FSDPModule):
            owners.update(dict.fromkeys(names, module))
    return owners


def fsdp_dim0_sharded(params: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether every parameter is a DTensor sharded along dim 0 over one 1-D mesh (FSDP2 with no TP), the
    layout :func:`gather_dim0_shards` reassembles."""
    from torch.distributed.tensor import DTensor, Shard

    if not params:
        return False
    mesh = None
    for _, p in params:
        if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
            return False
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            return False
    return True


@torch.no_grad()
def gather_dim0_shards(
    params: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of dim-0-sharded DTensors (see :func:`fsdp_dim0_sharded`), cast to ``dtype``, with ONE
    all-gather for all of them: every rank packs its local shards, each padded to the largest rank's row count,
    into one flat buffer, and each full tensor is cut back out of the gathered ``[world, ...]`` buffer.

    Bit for bit what ``full_tensor().to(dtype)`` per parameter (or FSDP's per-unit all-gather) gives: a cast
    is element-wise, so casting the shards first commutes with gathering, and the rows are only moved. One
    collective instead of one per FSDP unit (a dozen for a small decoder), and no unshard/reshard of the
    modules. The all-gather runs before this returns; the full tensors are cut out as they are iterated.
    The gathered buffer holds the whole model once, in ``dtype``, on ``device``.
    """
    from torch.distributed.tensor import DTensor

    first = params[0][1]
    assert isinstance(first, DTensor)
    mesh = first.device_mesh
    group = mesh.get_group()
    world = mesh.size()
    rank = mesh.get_local_rank()
    # FSDP2 splits dim 0 as torch.chunk does: ceil(n / world) rows per rank, the last ranks possibly fewer
    # (or none).
    layout: list[
        tuple[str, torch.Size, int, int, int]
    ] = []  # name, full shape, rows per rank, row numel, offset
    total = 0
    for name, p in params:
        rows = -(-p.shape[0] // world) if p.shape[0] else 0
        row_numel = math.prod(p.shape[1:])
        layout.append((name, p.shape, rows, row_numel, total))
        total += rows * row_numel
    flat = torch.zeros(total, dtype=dtype, device=device)
    for (_, p), (_, shape, rows, _row_numel, offset) in zip(params, layout, strict=True):
        assert isinstance(p, DTensor)
        local = p.to_local()
        assert local.shape[0] == max(0, min(rows, shape[0] - rank * rows)), "not a torch.chunk dim-0 shard"
        flat[offset : offset + local.numel()].copy_(local.reshape(-1))
    gathered = torch.empty(world * total, dtype=dtype, device=device)
    torch.distributed.all_gather(list(gathered.chunk(world)), flat, group=group)
    per_rank = gathered.view(world, total)

    def cut() -> Iterator[tuple[str, torch.Tensor]]:
        # One full tensor at a time, so the model is held once more only in the gathered buffer.
        for name, shape, rows, row_numel, offset in layout:
            parts = [
                per_rank[r, offset : offset + n * row_numel]
                for r in range(world)
                if (n := max(0, min(rows, shape[0] - r * rows))) > 0
            ]
            yield name, torch.cat(parts).view(shape) if parts else flat.new_empty(shape)

    return cut()
