"""megatron-core's ``aux_loss`` as the Megatron worker computes it from the recorded routing, against
megatron-core's own functions (``compute_routing_scores_for_aux_loss`` + ``switch_load_balancing_loss_func``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
pytestmark = pytest.mark.mcore


@pytest.mark.parametrize("sigmoid", [False, True])
def test_megatron_aux_loss_is_megatron_cores(sigmoid: bool) -> None:
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    from nemo_rl.models.megatron.moe import RouterScores, megatron_aux_loss
    from nemo_rl.models.policy.moe import RoutingRecord

    g = torch.Generator().manual_seed(0)
    num_tokens, num_experts, top_k = 24, 8, 2
    layers = [torch.randn(num_tokens, num_experts, generator=g) for _ in range(2)]
    valid_N = torch.arange(num_tokens) < 19  # the last rows are padding
    record = RoutingRecord(logits_NE=layers, experts_NK=[])
    got = megatron_aux_loss(RouterScores(sigmoid, 0.0), record, valid_N, top_k)
    expected = torch.zeros(())
    for logits in layers:
        kept = logits[valid_N]
        routing_map, scores = compute_routing_scores_for_aux_loss(
            kept, top_k, "sigmoid" if sigmoid else "softmax"
        )
        expected = expected + switch_load_balancing_loss_func(
            probs=scores,
            tokens_per_expert=routing_map.sum(dim=0).float(),
            total_num_tokens=kept.shape[0],
            topk=top_k,
            num_experts=num_experts,
            moe_aux_loss_coeff=1.0,
        )
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
