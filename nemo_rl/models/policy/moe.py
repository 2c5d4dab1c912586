"""Mixture-of-experts terms of a policy's training step: the load-balancing loss and the routing metrics.

:class:`RouterRecorder` hooks every MoE router of a Hugging Face model (the ``mlp.gate`` module of a layer
that has ``mlp.experts``; in ``transformers`` 5 it returns ``(router_logits, weights, experts)``) and keeps
what one forward routed. :func:`moe_step_terms` turns that into

- the load-balancing loss with ``transformers``' semantics (``load_balancing_loss_func``, Switch
  Transformer's eqs. 4-6 over all MoE layers at once, padding excluded as by an attention mask), added to the
  training loss times ``router_aux_loss_coef`` when the model config's ``output_router_logits`` is true
  (set both through ``policy.hf_config_overrides``, as NeMo RL's recipes do);
- the metrics ``moe_aux_loss`` (that loss, whether trained on or not), ``moe_router_entropy`` (mean entropy
  of the router's distribution over experts per token and layer, in nats) and, per MoE layer ``i``,
  ``moe_expert_load_layer{i}_max``: the most tokens any expert got divided by the mean per expert (1 is
  perfectly balanced, ``E / K`` all on ``K`` experts), the worst micro-batch of the step.

A sigmoid router (GLM-4-MoE / DeepSeek-V3 style, which balances with its correction bias instead of a loss)
gets the same metrics over its scores normalised to sum to 1; ``transformers`` defines no auxiliary loss
for it, so asking for one is refused.

Tensor legend: N = token rows of the forward (B * T, or a packed row), E = experts, K = experts per token.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from nemo_rl.models.policy.utils import valid_token_mask


@dataclass
class RoutingRecord:
    """What the routers of one forward chose, one entry per MoE layer in forward order."""

    logits_NE: list[torch.Tensor] = field(default_factory=list)
    experts_NK: list[torch.Tensor] = field(default_factory=list)


def aux_loss_coef_of(config: Any) -> float:
    """The load-balancing loss coefficient a Hugging Face model config asks for: ``router_aux_loss_coef`` when
    ``output_router_logits`` is true, else 0 (a model without such a loss refuses the switch)."""
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    if not hasattr(config, "router_aux_loss_coef"):
        raise ValueError(
            f"output_router_logits=true, but transformers defines no load-balancing loss for "
            f"{config.model_type} (its router balances with a correction bias): remove it from "
            "policy.hf_config_overrides"
        )
    return float(config.router_aux_loss_coef)


class RouterScores(Protocol):
    """What :func:`moe_step_terms` needs of a backend's routers."""

    aux_loss_coef: float
    """Coefficient of the trained load-balancing loss (0: logged only)."""

    def router_probs(self, logits_NE: torch.Tensor) -> torch.Tensor:
        """The router's distribution over experts ``[N, E]`` (float32) from its logits."""
        ...


class SequenceSplit(Protocol):
    """How context parallelism splits a forward's token rows (``ContextParallel``): the routers of a CP rank
    see its own tokens only."""

    def local_rows(self, rows_N: torch.Tensor) -> torch.Tensor:
        """Full rows' per-token rows ``[B * T, ...]`` -> this rank's ``[B * S, ...]``."""
        ...

    def gather_rows(self, rows_N: torch.Tensor) -> torch.Tensor:
        """This rank's per-token rows ``[B * S, ...]`` -> the full rows' ``[B * T, ...]`` (with autograd)."""
        ...


class RouterRecorder:
    """Forward hooks on a model's MoE routers; :meth:`record` yields what one forward routed."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = [
            module
            for name, module in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(model.get_submodule(name.rsplit(".", 1)[0]), "experts")
        ]
        self.sigmoid = any(hasattr(r, "e_score_correction_bias") for r in self.routers)
        self.aux_loss_coef = aux_loss_coef_of(getattr(model, "config", None))
        self._record: RoutingRecord | None = None
        self._layer_of = {id(router): layer for layer, router in enumerate(self.routers)}
        self._replay_NLK: torch.Tensor | None = None
        self.sequence_split: SequenceSplit | None = None
        """Context parallelism's split of the rows (set by ``apply_context_parallel``): replay then routes this
        rank's rows, and a record holds every rank's routing gathered to full rows, so the load-balancing loss
        and the metrics are those of the unsplit forward."""
        for router in self.routers:
            router.register_forward_hook(self._hook)

    @property
    def is_moe(self) -> bool:
        """Whether the model has MoE routers at all."""
        return bool(self.routers)

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, tuple) or len(output) < 3:
            return None
        if self._replay_NLK is not None:
            replay_NK = self._replay_NLK[:, self._layer_of[id(module)]]
            if self.sequence_split is not None:
                replay_NK = self.sequence_split.local_rows(replay_NK)
            output = replayed_routing(module, output, replay_NK)
        if self._record is not None:
            self._append(output)
        return output

    def _append(self, output: tuple[torch.Tensor, ...]) -> None:
        assert self._record is not None
        logits = output[0]
        from torch.distributed.tensor import DTensor

        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        logits_NE, experts_NK = (
            logits.reshape(-1, logits.shape[-1]),
            output[2].reshape(-1, output[2].shape[-1]),
        )
        if self.sequence_split is not None:
            logits_NE = self.sequence_split.gather_rows(logits_NE)
            experts_NK = self.sequence_split.gather_rows(experts_NK)
        self._record.logits_NE.append(logits_NE)
        self._record.experts_NK.append(experts_NK)

    @contextmanager
    def record(self) -> Iterator[RoutingRecord]:
        """Record the routing of the forward passes run inside the block (activation checkpointing's
        recomputation in the backward, after the block, is not recorded)."""
        self._record = RoutingRecord()
        try:
            yield self._record
        finally:
            self._record = None

    @contextmanager
    def replaying(self, experts_NLK: torch.Tensor | None) -> Iterator[None]:
        """Route the forward passes run inside the block to ``experts_NLK`` (``[N, MoE layers, K]``, one row per
        token row the routers see; a row whose first entry is negative keeps the router's own choice). None
        replays nothing."""
        self._replay_NLK = experts_NLK
        try:
            yield
        finally:
            self._replay_NLK = None

    def router_probs(self, logits_NE: torch.Tensor) -> torch.Tensor:
        """The router's distribution over experts ``[N, E]`` (float32) from its logits."""
        return router_distribution(logits_NE, self.sigmoid)


class PackedLayout(Protocol):
    """Where the rows of a micro-batch went in a packed forward (``PackedRows``, ``SharedPrefixRows``)."""

    @property
    def input_ids_1L(self) -> torch.Tensor:
        """The packed row's tokens ``[1, L]``."""
        ...

    @property
    def index_BT(self) -> torch.Tensor:
        """Position in the packed row of each row's token."""
        ...

    @property
    def valid_BT(self) -> torch.Tensor:
        """Whether the row has a token there."""
        ...


def replay_rows(mb: Mapping[str, Any], layout: PackedLayout | None) -> torch.Tensor | None:
    """The micro-batch's ``routed_experts`` ``[B, T, L, K]`` as one row per token row of its forward ``[N, L, K]``
    (``B * T`` rows, or the packed row's ``L``), -1 at padding; None when the batch carries no routing."""
    routed_BTLK = mb.get("routed_experts")
    if routed_BTLK is None:
        return None
    seq_len = routed_BTLK.shape[1]
    if layout is None:
        valid_BT = valid_token_mask(mb["input_lengths"].to(routed_BTLK.device), seq_len)
        return torch.where(valid_BT[:, :, None, None], routed_BTLK, -1).flatten(0, 1)
    rows_NLK = routed_BTLK.new_full((layout.input_ids_1L.shape[1], *routed_BTLK.shape[2:]), -1)
    valid_BT = layout.valid_BT.to(routed_BTLK.device)
    rows_NLK[layout.index_BT.to(routed_BTLK.device)[valid_BT]] = routed_BTLK[valid_BT]
    return rows_NLK


def replayed_routing(
    router: nn.Module, output: tuple[torch.Tensor, ...], replay_NK: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """A ``transformers`` 5 router's ``(logits, weights, experts)`` with the experts of the rows ``replay_NK``
    records (its non-negative rows) in place of its own top-k, their weights recomputed from the router's own
    logits as its forward computes them for its own choice (so replaying a router's own routing changes
    nothing, and the router still gets gradients through the weights)."""
    logits_NE, weights_NK, experts_NK = output[:3]
    replay_NK = replay_NK.to(device=experts_NK.device, dtype=experts_NK.dtype)
    if replay_NK.shape != experts_NK.shape:
        raise ValueError(
            f"routing replay got {tuple(replay_NK.shape)} experts for a router that routed "
            f"{tuple(experts_NK.shape)}: the batch's routed_experts must cover every token of the forward"
        )
    chosen_NK = torch.where(replay_NK[:, :1] >= 0, replay_NK, experts_NK)
    if getattr(router, "e_score_correction_bias", None) is not None:  # sigmoid router (glm4_moe)
        replayed_NK = logits_NE.sigmoid().gather(1, chosen_NK)
        if router.norm_topk_prob:
            replayed_NK = replayed_NK / (replayed_NK.sum(dim=-1, keepdim=True) + 1e-20)
        replayed_NK = replayed_NK * cast(float, router.routed_scaling_factor)
    else:  # softmax router (qwen3_moe)
        replayed_NK = torch.softmax(logits_NE, dtype=torch.float, dim=-1).gather(1, chosen_NK)
        if router.norm_topk_prob:
            replayed_NK = replayed_NK / replayed_NK.sum(dim=-1, keepdim=True)
        replayed_NK = replayed_NK.to(logits_NE.dtype)
    return (logits_NE, replayed_NK.to(weights_NK.dtype), chosen_NK, *output[3:])


def router_distribution(logits_NE: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """A router's distribution over experts ``[N, E]`` (float32) from its logits: the softmax, or a sigmoid
    router's scores normalised to sum to 1."""
    if sigmoid:
        scores = logits_NE.float().sigmoid()
        return scores / scores.sum(dim=-1, keepdim=True)
    return torch.softmax(logits_NE.float(), dim=-1)


def moe_step_terms(
    recorder: RouterScores, record: RoutingRecord, valid_N: torch.Tensor, share: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """``(loss term, metrics)`` of one micro-batch's routing: the load-balancing loss times its coefficient
    (0 unless the config asks for it) and the metrics, both as this micro-batch's ``share`` of the step
    (its valid tokens over the global batch's), except the ``_max`` loads.

    ``valid_N`` marks the forward's rows that are real tokens (not padding).
    """
    mask_N = valid_N.reshape(-1).float()
    num_valid = mask_N.sum().clamp(min=1.0)
    num_experts = record.logits_NE[0].shape[-1]
    tokens_per_expert = torch.zeros(num_experts, device=mask_N.device)
    prob_per_expert = torch.zeros(num_experts, device=mask_N.device)
    entropy = torch.zeros((), device=mask_N.device)
    metrics: dict[str, float] = {}
    for layer, (logits_NE, experts_NK) in enumerate(zip(record.logits_NE, record.experts_NK, strict=True)):
        probs_NE = recorder.router_probs(logits_NE)
        counts_E = torch.zeros_like(tokens_per_expert).scatter_add_(
            0, experts_NK.reshape(-1), mask_N.repeat_interleave(experts_NK.shape[1])
        )
        tokens_per_expert = tokens_per_expert + counts_E
        prob_per_expert = prob_per_expert + (probs_NE * mask_N[:, None]).sum(dim=0)
        token_entropy_N = -(probs_NE * probs_NE.clamp(min=1e-30).log()).sum(dim=-1)
        entropy = entropy + (token_entropy_N * mask_N).sum().detach() / num_valid
        metrics[f"moe_expert_load_layer{layer}_max"] = float(
            counts_E.max() / counts_E.mean().clamp(min=1e-30)
        )
    num_layers = max(len(record.logits_NE), 1)
    rows = num_valid * num_layers
    aux_loss = num_experts * torch.sum((tokens_per_expert / rows) * (prob_per_expert / rows))
    metrics["moe_aux_loss"] = float(aux_loss.detach()) * share
    metrics["moe_router_entropy"] = float(entropy) / num_layers * share
    return recorder.aux_loss_coef * share * aux_loss, metrics
