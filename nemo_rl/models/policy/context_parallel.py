"""Context parallelism (``policy.dtensor_cfg.context_parallel_size``): each sequence split over the ranks of the
``cp`` mesh axis, applied to a Hugging Face model from outside its code.

Layout. A row of ``T`` tokens (a padded row, or a packed row of several documents) is cut into ``2N`` equal
chunks for ``N`` CP ranks; rank ``r`` holds chunks ``r`` and ``2N-1-r`` (:func:`chunk_indices`). Under the
causal mask chunk ``c`` attends ``c + 1`` chunks of keys, so every rank attends ``2N + 1`` chunk pairs: equal
work, no rank idles while another finishes the end of the sequence.

Forward. :func:`apply_context_parallel` installs three things on the model:

1. a pre-forward hook on the root that keeps this rank's tokens of ``input_ids`` and of the GLOBAL position ids
   (so the rotary embedding sees every token's true position), and passes the layout to every attention layer
   through Hugging Face's forward keywords (a placeholder 4D mask stops Hugging Face from building a mask of
   its own, which would be wrong for the split row);
2. a registered Hugging Face attention implementation (:func:`context_parallel_attention`): each layer
   all-gathers the keys and values of the CP ranks (with autograd: the backward sums every rank's gradient into
   the owner's keys and values) and attends each local chunk to the keys before it, masked by global positions
   and, in a packed row, by document (a new document starts wherever the position ids do not go on by one), so
   documents never attend across a pack boundary;
3. a forward hook on the output head (the LM head, or a value model's scalar head) that all-gathers its output
   back to full rows in token order. Every CP rank then computes the same loss on the same full rows, so its
   gradient is the same on every rank and the gather's backward keeps each rank's own slice of it, with no
   communication: log-probs, entropies, losses and gradients are those of the unsplit forward, and the loss
   contract (``loss_interface.py``) is unchanged.

Parameters are sharded by FSDP2 over ``dp x cp`` (:func:`fsdp_mesh`), as in NeMo RL and torchtitan: the CP
ranks of a data-parallel group see the same rows, so their gradients (each from its own tokens) sum to the
unsplit gradient in FSDP's reduce-scatter.

Memory. The decoder layers' activations shrink by the CP size; each layer also keeps the gathered keys and
values of the full rows (small with grouped-query attention), and the head's output is gathered back to full
rows, so the ``[T, V]`` logits are not split (``nemo_rl.config.memory_plan`` counts all three).

Tensor parallelism composes: the ``(dp, cp, tp)`` mesh gives every CP rank its own TP group, TP splits the
heads of the CP rank's tokens (so each TP rank gathers the keys and values of its own heads over its CP group),
and sequence parallelism splits the CP rank's tokens once more between the TP regions (every padded length is
then a multiple of ``CP x TP`` as well as of ``2 x CP``, :func:`sequence_multiple`). Mixture-of-experts models
compose through their routers' hooks (``nemo_rl.models.policy.moe``): routing replay takes this rank's rows of
the recorded routing (:meth:`ContextParallel.local_rows`), and the routing a forward recorded is gathered back
to full rows (:meth:`ContextParallel.gather_rows`), so the load-balancing loss and the routing metrics are those
of the unsplit forward.

Not combined with (the config refuses each in one line, ``nemo_rl.config.context_parallel``): the shared-prompt
forward and Bradley-Terry reward models. Megatron's ``context_parallel_size`` uses megatron-core's own attention
(Transformer Engine's, CUDA only) with this layout and :func:`gather_identical_output`
(``nemo_rl/models/megatron/context_parallel.py``).

Tensor legend: B = rows, T = tokens of a full row, S = tokens this rank holds (``T / N``), C = chunk length
(``T / 2N``), K = keys a chunk attends, H = heads, D = head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemo_rl.config.dtensor import DTensorConfig
from nemo_rl.models.policy.moe import RouterRecorder

ATTENTION = "nemo_rl_context_parallel"
"""The Hugging Face attention implementation name of :func:`context_parallel_attention`."""


def worker_mesh(device_type: str, world_size: int, dtensor_cfg: DTensorConfig) -> DeviceMesh:
    """A DTensor worker's ``(dp, cp, tp)`` mesh over ``world_size`` ranks, row-major: the ``CP x TP``
    consecutive ranks of a data-parallel group hold the same rows."""
    from torch.distributed.device_mesh import init_device_mesh

    tp_size, cp_size = dtensor_cfg.tensor_parallel_size, dtensor_cfg.context_parallel_size
    if world_size % (tp_size * cp_size) != 0:
        raise ValueError(
            f"the policy has {world_size} workers, not a multiple of policy.dtensor_cfg."
            f"tensor_parallel_size={tp_size} x context_parallel_size={cp_size}"
        )
    shape = (world_size // (tp_size * cp_size), cp_size, tp_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "cp", "tp"))


def sequence_multiple(make_divisible_by: int, dtensor_cfg: DTensorConfig) -> int:
    """What a worker pads sequence lengths to: ``make_divisible_by``, with CP a multiple of ``2 x CP`` (the
    load-balanced chunks), and with sequence parallelism a multiple of ``CP x TP`` (each CP rank's ``T / CP``
    tokens are split over the TP ranks)."""
    tp_size, cp_size = dtensor_cfg.tensor_parallel_size, dtensor_cfg.context_parallel_size
    sp_multiple = cp_size * tp_size if dtensor_cfg.sequence_parallel else 1
    return math.lcm(make_divisible_by, sp_multiple, 2 * cp_size if cp_size > 1 else 1)


def chunk_indices(
    seq_len: int, cp_size: int, cp_rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """[S] the positions of a ``seq_len`` row that CP rank ``cp_rank`` holds: chunks ``cp_rank`` and
    ``2 cp_size - 1 - cp_rank`` of ``2 cp_size`` equal chunks, in order."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"a row of {seq_len} tokens cannot be split into 2 x context_parallel_size={2 * cp_size} equal "
            "chunks: policy.make_sequence_length_divisible_by must be a multiple of that"
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = 2 * cp_size - 1 - cp_rank
    return torch.cat([first, torch.arange(last * chunk, (last + 1) * chunk, device=device)])


def gathered_order(seq_len: int, cp_size: int, device: torch.device | None = None) -> torch.Tensor:
    """[T] for each position of the row, its slot in the ranks' tokens gathered rank after rank (the inverse of
    :func:`chunk_indices` concatenated over the ranks): ``full = gathered.index_select(dim, order)``."""
    held = torch.cat([chunk_indices(seq_len, cp_size, r, device) for r in range(cp_size)])
    order = torch.empty_like(held)
    order[held] = torch.arange(seq_len, device=device)
    return order


def document_ids(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] the document of each token of a (packed) row: a new one starts wherever the position ids do not
    go on by one (packing restarts them at 0 for every sequence, and for the padding at the end)."""
    starts_BT = torch.ones_like(position_ids_BT, dtype=torch.long)
    starts_BT[:, 1:] = (position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1).long()
    return torch.cumsum(starts_BT, dim=1)


def allowed_keys(
    chunk: int, chunk_len: int, document_BT: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """bool ``[B or 1, 1, C, K]``: which of the first ``K = (chunk + 1) C`` tokens of the row each query of global
    chunk ``chunk`` may attend: the causal mask by global positions, within the query's document."""
    query_C = chunk * chunk_len + torch.arange(chunk_len, device=device)
    key_K = torch.arange((chunk + 1) * chunk_len, device=device)
    allowed_CK = key_K[None, :] <= query_C[:, None]
    if document_BT is None:
        return allowed_CK[None, None]
    same_BCK = document_BT[:, query_C, None] == document_BT[:, None, : key_K.numel()]
    return (allowed_CK[None] & same_BCK)[:, None]


class ContextParallelLayout:
    """One forward's split: what every attention layer and the head gather need (built by the root's hook).

    A plain class, not a dataclass: FSDP2 rebuilds the dataclasses and dicts among a unit's forward inputs
    (to cast their tensors), which would give every decoder layer its own copy and its own masks.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        cp_rank: int,
        local_index_S: torch.Tensor,
        order_T: torch.Tensor,
        document_BT: torch.Tensor | None,
    ) -> None:
        self.group = group
        self.cp_rank = cp_rank
        self.cp_size = dist.get_world_size(group)
        self.seq_len = order_T.numel()
        """T: the full row length."""
        self.local_index_S = local_index_S
        """The row positions this rank holds (:func:`chunk_indices`)."""
        self.order_T = order_T
        """:func:`gathered_order`: gathered slots back to row order."""
        self.document_BT = document_BT
        """Documents of a packed row (:func:`document_ids`); None for ordinary rows (one sequence each)."""
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        """Additive masks by (chunk, dtype), built by the first layer and shared by the others: a boolean mask
        would be turned into a new float one by every layer's attention, each kept for its backward pass."""

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.cp_size)

    @property
    def chunks(self) -> tuple[int, int]:
        """The global chunk numbers this rank holds, in order."""
        return self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank

    def additive_mask(self, chunk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[B or 1, 1, C, K]``: 0 where :func:`allowed_keys` allows, ``-inf`` elsewhere (built once per forward)."""
        key = (chunk, dtype)
        if key not in self._masks:
            allowed = allowed_keys(chunk, self.chunk_len, self.document_BT, device)
            zeros = torch.zeros(allowed.shape, dtype=dtype, device=device)
            self._masks[key] = zeros.masked_fill(~allowed, float("-inf"))
        return self._masks[key]


class _GatherSumGradient(torch.autograd.Function):
    """All-gather along the sequence dim whose backward sums every rank's gradient of the gathered tensor and
    keeps this rank's slice: for keys and values, which every rank's queries read."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: ContextParallelLayout, dim: int) -> torch.Tensor:
        ctx.layout, ctx.dim = layout, dim
        return _all_gather_rows(x, layout, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout: ContextParallelLayout = ctx.layout
        # An all-reduce rather than a reduce-scatter: gloo has no reduce-scatter.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=layout.group)
        return grad.index_select(ctx.dim, layout.local_index_S.to(grad.device)), None, None


def _all_gather_rows(x: torch.Tensor, layout: ContextParallelLayout, dim: int) -> torch.Tensor:
    """Every rank's ``x`` (its tokens along ``dim``) gathered into full rows in row order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(layout.cp_size)]
    dist.all_gather(parts, x, group=layout.group)
    return torch.cat(parts, dim=dim).index_select(dim, layout.order_T.to(x.device))


def gather_sequence(x: torch.Tensor, layout: ContextParallelLayout, dim: int) -> torch.Tensor:
    """Every rank's ``x`` (its tokens along ``dim``) gathered into full rows in row order, with autograd: the
    backward sums each rank's gradient of the gathered tensor into the owner's ``x`` (keys and values)."""
    out = _GatherSumGradient.apply(x, layout, dim)
    assert isinstance(out, torch.Tensor)
    return out


class _GatherSameGradient(torch.autograd.Function):
    """All-gather along the sequence dim whose backward keeps this rank's slice of the gradient: for outputs
    every CP rank reads identically (the same loss on the same full rows), whose gradients are equal on all."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layout: ContextParallelLayout, dim: int) -> torch.Tensor:
        ctx.layout, ctx.dim = layout, dim
        return _all_gather_rows(x, layout, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        layout: ContextParallelLayout = ctx.layout
        return grad.index_select(ctx.dim, layout.local_index_S.to(grad.device)), None, None


def gather_identical_output(x: torch.Tensor, layout: ContextParallelLayout) -> torch.Tensor:
    """``[B, S, ...]`` head outputs back to full rows ``[B, T, ...]`` (see :class:`_GatherSameGradient`)."""
    out = _GatherSameGradient.apply(x, layout, 1)
    assert isinstance(out, torch.Tensor)
    return out


def context_parallel_attention(
    module: nn.Module,
    query_BHSD: torch.Tensor,
    key_BHSD: torch.Tensor,
    value_BHSD: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cp_layout: ContextParallelLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A Hugging Face attention implementation: this rank's queries against every CP rank's keys and values
    given ``cp_layout`` (the model's forward keyword), else plain sdpa attention. Returns ``[B, S, H, D]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cp_layout is None:
        return sdpa_attention_forward(
            module,
            query_BHSD,
            key_BHSD,
            value_BHSD,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )
    layout = cp_layout
    # Keys and values travel in one collective: [2, B, Hkv, T, D] once gathered.
    kv_2BHTD = gather_sequence(torch.stack([key_BHSD, value_BHSD]), layout, dim=3)
    chunk_len = layout.chunk_len
    outputs = []
    for position, chunk in enumerate(layout.chunks):
        keys = (chunk + 1) * chunk_len  # causal: nothing after the chunk is attended
        query = query_BHSD[:, :, position * chunk_len : (position + 1) * chunk_len]
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query,
                kv_2BHTD[0, :, :, :keys],
                kv_2BHTD[1, :, :, :keys],
                attn_mask=layout.additive_mask(chunk, query.dtype, query.device),
                dropout_p=dropout if module.training else 0.0,
                scale=scaling,
                enable_gqa=query.shape[1] != key_BHSD.shape[1],
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


class ContextParallel:
    """The hooks that split a Hugging Face model's forward over a CP group (see the module docstring)."""

    def __init__(self, model: nn.Module, cp_mesh: DeviceMesh) -> None:
        self.group = cp_mesh.get_group()
        self.cp_size = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
        self.layout: ContextParallelLayout | None = None
        """The layout of the forward running now (set by the root's pre-forward hook)."""
        # transformers' own load-balancing loss would read the placeholder mask as [B, T]; the worker computes
        # that loss itself from the gathered routing (moe_step_terms).
        self._router_logits_off = bool(getattr(model.config, "output_router_logits", False))
        self._use_attention(model)
        model.register_forward_pre_hook(self._split_inputs, with_kwargs=True)
        head = _output_head(model)
        head.register_forward_hook(self._gather_head_output)

    @staticmethod
    def _use_attention(model: nn.Module) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        config: Any = model.config
        sliding = [kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"]
        if config._attn_implementation not in ("sdpa", "eager", ATTENTION) or sliding:
            raise ValueError(
                "policy.dtensor_cfg.context_parallel_size > 1 needs full causal attention, but this model uses "
                f"{config._attn_implementation!r} attention"
                + (f" and {sorted(set(sliding))} layers" if sliding else "")
                + ": set policy.dtensor_cfg.context_parallel_size=1"
            )
        AttentionInterface.register(ATTENTION, context_parallel_attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        config._attn_implementation = ATTENTION

    def _split_inputs(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Keep this rank's tokens and global positions; hand the layout to the attention layers."""
        if args or "input_ids" not in kwargs or kwargs.get("attention_mask") is not None:
            raise ValueError("a context-parallel forward takes input_ids (and position_ids) as keywords only")
        ids_BT = kwargs["input_ids"]
        num_rows, seq_len = ids_BT.shape
        device = ids_BT.device
        position_ids_BT = kwargs.get("position_ids")
        if position_ids_BT is None:
            position_ids_BT = torch.arange(seq_len, device=device).expand(num_rows, -1)
            document_BT = None
        else:
            document_BT = document_ids(position_ids_BT)
        local_index_S = chunk_indices(seq_len, self.cp_size, self.cp_rank, device)
        self.layout = ContextParallelLayout(
            self.group,
            self.cp_rank,
            local_index_S,
            gathered_order(seq_len, self.cp_size, device),
            document_BT,
        )
        return args, {
            **kwargs,
            "input_ids": ids_BT[:, local_index_S],
            "position_ids": position_ids_BT[:, local_index_S],
            # Passed as-is by Hugging Face (a 4D mask) and ignored by the attention: the mask is built per
            # chunk from the layout.
            "attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
            "cp_layout": self.layout,
            **({"output_router_logits": False} if self._router_logits_off else {}),
        }

    def _gather_head_output(self, _module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
        return gather_identical_output(output, self._running_layout())

    def _running_layout(self) -> ContextParallelLayout:
        assert self.layout is not None, "a hooked module ran outside a context-parallel forward"
        return self.layout

    def local_rows(self, rows_N: torch.Tensor) -> torch.Tensor:
        """``[B * T, ...]`` per-token rows of the full rows (a MoE router's replayed experts) -> this rank's
        ``[B * S, ...]``, in the order its routers see its tokens."""
        layout = self._running_layout()
        rows_BT = rows_N.reshape(-1, layout.seq_len, *rows_N.shape[1:])
        local_BS = rows_BT.index_select(1, layout.local_index_S.to(rows_N.device))
        return local_BS.reshape(-1, *rows_N.shape[1:])

    def gather_rows(self, rows_N: torch.Tensor) -> torch.Tensor:
        """This rank's ``[B * S, ...]`` per-token rows (a router's logits or experts) -> every rank's, as full
        rows ``[B * T, ...]``. Every CP rank then computes the same load-balancing loss from them, so the
        gather's backward keeps this rank's slice of the gradient (:func:`gather_identical_output`)."""
        layout = self._running_layout()
        rows_BS = rows_N.reshape(-1, layout.local_index_S.numel(), *rows_N.shape[1:])
        return gather_identical_output(rows_BS, layout).reshape(-1, *rows_N.shape[1:])


def _output_head(model: nn.Module) -> nn.Module:
    """The module whose per-token output the losses read: a value model's scalar ``score`` head (read at every
    token, ``DTensorPolicyWorker._values``), else the LM head."""
    score = getattr(model, "score", None)
    head = score if isinstance(score, nn.Module) else model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Module):
        raise ValueError(f"{type(model).__name__} has no output head for context parallelism to gather")
    return head


def apply_context_parallel(
    model: nn.Module, cp_mesh: DeviceMesh, routing: RouterRecorder
) -> ContextParallel | None:
    """Split ``model``'s forwards over ``cp_mesh`` (a 1-D mesh) and hand the split to ``routing`` (the model's
    MoE routers, if any); None (nothing installed) for one rank."""
    if cp_mesh.size() == 1:
        return None
    split = ContextParallel(model, cp_mesh)
    routing.sequence_split = split
    return split


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``dp``, or with context parallelism ``dp x cp`` flattened (the CP ranks of a
    data-parallel group hold different tokens of the same rows, so their gradients sum like dp ranks')."""
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten("dp_cp")
