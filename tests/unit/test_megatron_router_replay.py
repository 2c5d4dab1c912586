"""Routing replay in megatron-core's router (``policy.router_replay`` on the Megatron backend): the
:class:`~nemo_rl.models.megatron.moe.ReplayTopK` hook inside megatron-core's own
``topk_routing_with_score_function``, for the softmax router (Qwen3-MoE) and the grouped sigmoid router with
correction bias and scaling (GLM-4-MoE); and the sequence-first row order of the Megatron routers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
pytestmark = pytest.mark.mcore

ROUTERS: dict[str, dict[str, Any]] = {
    "softmax": {"use_pre_softmax": True, "score_function": "softmax"},
    "sigmoid": {
        "score_function": "sigmoid",
        "num_groups": 2,
        "group_topk": 1,
        "scaling_factor": 2.5,
        "expert_bias": torch.linspace(-0.1, 0.1, 8),
    },
}


@pytest.mark.parametrize("router", list(ROUTERS))
def test_replay_in_megatron_cores_routing(router: str) -> None:
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from nemo_rl.models.megatron.moe import ReplayTopK

    logits = torch.randn(16, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    own_probs, own_map = topk_routing_with_score_function(logits, 2, **ROUTERS[router])
    replay = ReplayTopK()

    def route(target: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        replay.target_NK = target
        return topk_routing_with_score_function(logits, 2, router_replay=replay, **ROUTERS[router])

    own_NK = own_map.nonzero()[:, 1].view(16, 2)
    probs, routing_map = route(own_NK)
    assert torch.equal(probs, own_probs) and torch.equal(routing_map, own_map)  # own routing: exact
    other_NK = (own_NK + 3) % 8
    other_NK[:4] = -1  # rows without a record keep the router's choice
    probs, routing_map = route(other_NK)
    assert torch.equal(routing_map[:4], own_map[:4])
    assert torch.equal(routing_map[4:].nonzero()[:, 1].view(12, 2), other_NK[4:].sort(dim=-1)[0])
    probs.sum().backward()  # the router's logits still get gradients through the replayed experts' scores
    assert logits.grad is not None and float(logits.grad.abs().sum()) > 0


def test_megatron_rows_are_sequence_first() -> None:
    from nemo_rl.models.megatron.moe import megatron_rows

    routed_BTLK = torch.arange(2 * 3 * 2 * 2).view(2, 3, 2, 2)
    rows = megatron_rows(routed_BTLK, torch.tensor([3, 1]))
    assert torch.equal(rows[0 * 2 + 1], routed_BTLK[1, 0]) and torch.equal(rows[2 * 2 + 0], routed_BTLK[0, 2])
    assert bool((rows[1 * 2 + 1] == -1).all()) and bool((rows[2 * 2 + 1] == -1).all())  # row 1's padding
