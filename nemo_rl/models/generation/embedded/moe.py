"""The embedded engine's mixture-of-experts block: routing and experts exactly as ``transformers`` runs them.

One MoE layer's weights keep their Hugging Face names: ``mlp.gate.weight`` ``[E, H]`` (the router),
``mlp.gate.e_score_correction_bias`` ``[E]`` (sigmoid router only, kept in float32 as ``transformers`` keeps
it), ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]`` and, with a shared
expert, ``mlp.shared_experts.{gate,up,down}_proj.weight`` (gate and up fused as the dense MLP's are).

The order of operations follows ``Qwen3MoeTopKRouter`` / ``Glm4MoeTopkRouter`` and their ``*Experts`` loops
(per hit expert: gather its tokens, gated MLP, scale by the routing weight, ``index_add_``), so the experts
chosen and the float32 outputs agree with ``transformers`` to rounding.

Tensor legend: M = token rows, H = hidden size, E = experts, K = experts per token, I = expert width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemo_rl.config.model_arch import MoeArch

AddBuffer = Callable[..., None]
"""``DecoderLM._add``: declare a storage buffer (optionally split among Hugging Face names, or float32)."""


@dataclass(frozen=True)
class MoeWeights:
    """One MoE layer's weights as the forward pass reads them (views into the model's storage)."""

    router: torch.Tensor
    """``[E, H]``."""
    correction_bias: torch.Tensor | None
    """``[E]`` float32; sigmoid router only."""
    gate_up: torch.Tensor
    """``[E, 2I, H]``."""
    down: torch.Tensor
    """``[E, H, I]``."""
    shared_gate_up_t: torch.Tensor | None
    """``[H, 2S]`` (transposed); None without a shared expert."""
    shared_down_t: torch.Tensor | None
    """``[S, H]`` (transposed)."""


def plan_moe_storage(add: AddBuffer, mlp: str, hidden_size: int, moe: MoeArch) -> None:
    """Declare the buffers of the MoE block under ``mlp`` (``model.layers.{i}.mlp.``)."""
    e, i, s = moe.num_experts, moe.expert_intermediate_size, moe.shared_intermediate_size
    add(mlp + "gate.weight", (e, hidden_size))
    if moe.router == "sigmoid":
        add(mlp + "gate.e_score_correction_bias", (e,), float32=True)
    add(mlp + "experts.gate_up_proj", (e, 2 * i, hidden_size))
    add(mlp + "experts.down_proj", (e, hidden_size, i))
    if s:
        shared = mlp + "shared_experts."
        add(
            shared + "gate_up_proj.weight",
            (2 * s, hidden_size),
            [(shared + "gate_proj.weight", s), (shared + "up_proj.weight", s)],
        )
        add(shared + "down_proj.weight", (hidden_size, s))


def bind_moe_weights(buffers: dict[str, torch.Tensor], mlp: str) -> MoeWeights:
    """The :class:`MoeWeights` of the MoE block under ``mlp`` from the model's storage buffers."""
    shared = mlp + "shared_experts."
    gate_up = buffers.get(shared + "gate_up_proj.weight")
    down = buffers.get(shared + "down_proj.weight")
    return MoeWeights(
        router=buffers[mlp + "gate.weight"],
        correction_bias=buffers.get(mlp + "gate.e_score_correction_bias"),
        gate_up=buffers[mlp + "experts.gate_up_proj"],
        down=buffers[mlp + "experts.down_proj"],
        shared_gate_up_t=gate_up.t() if gate_up is not None else None,
        shared_down_t=down.t() if down is not None else None,
    )


def route(x_MH: torch.Tensor, w: MoeWeights, moe: MoeArch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [M, K], experts [M, K])`` the router gives each token row."""
    if moe.router == "softmax":
        logits_ME = F.linear(x_MH, w.router)
        probs_ME = torch.softmax(logits_ME, dim=-1, dtype=torch.float)
        top_MK, experts_MK = torch.topk(probs_ME, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            top_MK /= top_MK.sum(dim=-1, keepdim=True)
        return top_MK.to(logits_ME.dtype), experts_MK
    assert w.correction_bias is not None
    scores_ME = F.linear(x_MH.float(), w.router.float()).sigmoid()
    choice_ME = scores_ME + w.correction_bias
    per_group = moe.num_experts // moe.num_groups
    group_scores = choice_ME.view(-1, moe.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, moe.num_groups, per_group).reshape(-1, moe.num_experts)
    choice_ME = choice_ME.masked_fill(~expert_mask.bool(), float("-inf"))
    experts_MK = torch.topk(choice_ME, k=moe.top_k, dim=-1, sorted=False)[1]
    weights_MK = scores_ME.gather(1, experts_MK)
    if moe.norm_topk_prob:
        weights_MK /= weights_MK.sum(dim=-1, keepdim=True) + 1e-20
    return weights_MK * moe.routed_scaling_factor, experts_MK


def moe_mlp(
    x_MH: torch.Tensor, w: MoeWeights, moe: MoeArch, sink: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """The MoE block's output ``[M, H]`` for normalised token rows ``x_MH`` (no residual); ``sink``, when
    given, receives the experts ``[M, K]`` each row was routed to (routing replay records them)."""
    weights_MK, experts_MK = route(x_MH, w, moe)
    if sink is not None:
        sink.append(experts_MK)
    out_MH = torch.zeros_like(x_MH)
    # One pass per expert some token chose, as transformers loops (a sort-free loop: the tiny and decode-sized
    # batches the engine runs on CPU hit few experts).
    for expert in torch.unique(experts_MK).tolist():
        rows, slot = torch.where(experts_MK == expert)
        gate, up = F.linear(x_MH[rows], w.gate_up[expert]).chunk(2, dim=-1)
        hidden = F.linear(F.silu(gate) * up, w.down[expert])
        out_MH.index_add_(0, rows, (hidden * weights_MK[rows, slot, None]).to(out_MH.dtype))
    if w.shared_gate_up_t is not None and w.shared_down_t is not None:
        gate_up = torch.mm(x_MH, w.shared_gate_up_t)
        s = moe.shared_intermediate_size
        out_MH = out_MH + torch.mm(F.silu(gate_up[:, :s]) * gate_up[:, s:], w.shared_down_t)
    return out_MH
