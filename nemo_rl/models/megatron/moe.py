"""megatron-core's mixture-of-experts layer in the Megatron policy: its router, and what one forward routed.

The MoE layers are megatron-core's own (``MoELayer``: a ``TopKRouter``, the token dispatcher of
``megatron_cfg.moe_token_dispatcher_type`` over the expert-parallel group, ``SequentialMLP`` experts), built
from the local layer spec with :class:`RecordingRouter` as the router. Each router appends what it chose to
the model's :class:`RoutingLog` while a record is open, so the worker computes the same load-balancing loss and
routing metrics as the DTensor backend (:func:`nemo_rl.models.policy.moe.moe_step_terms`) from them.

Megatron's activations are sequence-first: a router's rows are ``[T, B]`` flattened (row ``t * B + b``), so
the valid-token mask of a micro-batch is transposed before it is flattened (:func:`valid_rows`).

Tensor legend: N = token rows of a forward (T * B), E = experts, K = experts per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from torch import nn

from nemo_rl.models.policy.moe import RoutingRecord, router_distribution

if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
    # megatron-core 0.16 binds its Transformer Engine GEMM only when Transformer Engine imports, but the
    # router's linear reads the name either way (to fall back to torch.mm when it is None).
    moe_utils.te_general_gemm = None


class RoutingLog:
    """The routing of the forward in progress, shared by the routers of one model (``None``: not recording)."""

    def __init__(self) -> None:
        self.record: RoutingRecord | None = None


class RecordingRouter(TopKRouter):
    """megatron-core's top-k router, also appending its logits and chosen experts to :attr:`log`."""

    log: RoutingLog | None = None
    """Set by :func:`attach_routing_log` after the model is built."""

    def routing(
        self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's routing of ``logits`` ``[T, B, E]``; returns ``(probs, routing_map)``, both ``[N, E]``."""
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        record = self.log.record if self.log is not None else None
        if record is not None:
            record.logits_NE.append(logits.reshape(-1, logits.shape[-1]))
            # Without token dropping every row of the map has exactly top-k experts, in expert order.
            record.experts_NK.append(routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], self.topk))
        return probs, routing_map


def routers(model: nn.Module) -> list[RecordingRouter]:
    """The MoE routers of ``model`` in forward order."""
    return [module for module in model.modules() if isinstance(module, RecordingRouter)]


def attach_routing_log(model: nn.Module) -> RoutingLog | None:
    """Give every router of ``model`` one shared :class:`RoutingLog`; ``None`` for a dense model."""
    found = routers(model)
    if not found:
        return None
    log = RoutingLog()
    for router in found:
        router.log = log
    return log


class ReplayTopK:
    """A router's routing replay, in megatron-core's ``router_replay`` hook (what ``moe_enable_routing_replay``
    installs, ``RouterReplay.get_replay_topk``): the router computes its own top-k, then the rows of
    :attr:`target_NK` that hold experts (non-negative) take those, their scores gathered from the router's own
    (so a router's own routing replays exactly, and the router trains through the scores). Unlike
    megatron-core's ``RouterReplay`` a row without a record keeps the router's choice."""

    def __init__(self) -> None:
        self.target_NK: torch.Tensor | None = None
        """Experts ``[N, K]`` per router row for the forward in progress; None replays nothing."""

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None,
        group_topk: int | None,
        default_compute_topk: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top-k scores, top-k experts)`` of ``scores`` ``[N, E]``, the recorded rows replayed."""
        values_NK, experts_NK = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        if self.target_NK is None:
            return values_NK, experts_NK
        target_NK = self.target_NK.to(device=experts_NK.device, dtype=experts_NK.dtype)
        chosen_NK = torch.where(target_NK[:, :1] >= 0, target_NK, experts_NK)
        return scores.gather(1, chosen_NK), chosen_NK


def install_replay(model: nn.Module) -> list[ReplayTopK]:
    """Give every MoE router of ``model`` a :class:`ReplayTopK` (``policy.router_replay``), in forward order."""
    replays = []
    for router in routers(model):
        router.router_replay = ReplayTopK()
        replays.append(router.router_replay)
    return replays


@contextmanager
def replaying(replays: list[ReplayTopK], rows_NLK: torch.Tensor | None) -> Iterator[None]:
    """Route the forwards run inside the block to ``rows_NLK`` (``[N, MoE layers, K]`` in the routers' row
    order, see :func:`megatron_rows`); None (or no routers) replays nothing."""
    if rows_NLK is None or not replays:
        yield
        return
    for layer, replay in enumerate(replays):
        replay.target_NK = rows_NLK[:, layer]
    try:
        yield
    finally:
        for replay in replays:
            replay.target_NK = None


def megatron_rows(routed_BTLK: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """A micro-batch's ``routed_experts`` ``[B, T, L, K]`` in the routers' sequence-first row order ``[T * B, L,
    K]``, -1 at padding."""
    valid_BT = torch.arange(routed_BTLK.shape[1], device=routed_BTLK.device)[None, :] < lengths_B[:, None].to(
        routed_BTLK.device
    )
    return torch.where(valid_BT[:, :, None, None], routed_BTLK, -1).transpose(0, 1).flatten(0, 1)


def freeze_routers(model: nn.Module) -> int:
    """Stop training the routers' weights (``megatron_cfg.freeze_moe_router``); returns how many were frozen."""
    found = routers(model)
    for router in found:
        for param in router.parameters():
            param.requires_grad_(False)
    return len(found)


@contextmanager
def recording(log: RoutingLog | None) -> Iterator[RoutingRecord | None]:
    """Record the routing of the forwards run inside the block (nothing for a dense model)."""
    if log is None:
        yield None
        return
    log.record = RoutingRecord()
    try:
        yield log.record
    finally:
        log.record = None


def valid_rows(valid_BT: torch.Tensor) -> torch.Tensor:
    """``[N]`` mask of a router's rows that are real tokens, from the micro-batch's ``[B, T]`` mask."""
    return valid_BT.t().reshape(-1)


class RouterScores:
    """What :func:`~nemo_rl.models.policy.moe.moe_step_terms` needs of the model's routers: their distribution
    over experts and the load-balancing loss coefficient (``transformers``' keys of the model config)."""

    def __init__(self, sigmoid: bool, aux_loss_coef: float) -> None:
        self.sigmoid = sigmoid
        self.aux_loss_coef = aux_loss_coef

    def router_probs(self, logits_NE: torch.Tensor) -> torch.Tensor:
        """The routers' distribution over experts ``[N, E]`` (float32)."""
        return router_distribution(logits_NE, self.sigmoid)


def megatron_aux_loss(
    scores: RouterScores, record: RoutingRecord, valid_N: torch.Tensor, top_k: int
) -> torch.Tensor:
    """megatron-core's ``aux_loss`` (``moe_router_load_balancing_type: aux_loss``) of one micro-batch, summed
    over its MoE layers, padding excluded: per layer ``E / (K * N^2) * sum_e c_e * p_e``, with ``N`` the valid
    tokens, ``p_e`` the summed router probabilities of expert ``e`` (a sigmoid router's scores normalised) and
    ``c_e`` how many tokens have ``e`` among the top-k of those probabilities (megatron-core's
    ``switch_load_balancing_loss_func`` on ``compute_routing_scores_for_aux_loss``)."""
    mask_N = valid_N.reshape(-1).float()
    num_tokens = mask_N.sum().clamp(min=1.0)
    total = torch.zeros((), device=mask_N.device)
    for logits_NE in record.logits_NE:
        probs_NE = scores.router_probs(logits_NE) * mask_N[:, None]
        top_NK = probs_NE.topk(top_k, dim=-1).indices
        counts_E = torch.zeros(probs_NE.shape[-1], device=mask_N.device).scatter_add_(
            0, top_NK.reshape(-1), mask_N.repeat_interleave(top_k)
        )
        total = total + probs_NE.shape[-1] / (top_k * num_tokens**2) * (probs_NE.sum(dim=0) * counts_E).sum()
    return total
