"""The worker slots of a run's groups: the policy first on every node, then extra policies with slots of their
own, then non-colocated generation."""

from __future__ import annotations

import pytest

from nemo_rl.algorithms.placement import placement
from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig


def _policy(gen_per_node: int | None = None) -> PolicyConfig:
    colocated = {"enabled": gen_per_node is None, "resources": {"gpus_per_node": gen_per_node}}
    return PolicyConfig.model_validate({"model_name": "m", "generation": {"colocated": colocated}})


def test_everything_shares_every_slot_by_default() -> None:
    slots = placement(_policy(), ClusterConfig(gpus_per_node=2, num_nodes=2), samples=True)
    assert slots.policy == slots.generation == [0, 1, 2, 3] and slots.of_extra("value") == [0, 1, 2, 3]
    supervised = placement(_policy(), ClusterConfig(gpus_per_node=2), samples=False)
    assert supervised.policy == [0, 1] and supervised.generation == []


def test_own_slots_come_after_the_policy_and_before_generation_on_every_node() -> None:
    cluster = ClusterConfig(gpus_per_node=4, num_nodes=2)
    slots = placement(_policy(1), cluster, samples=True, own_slots_per_node={"value": 1, "teacher": 0})
    assert slots.policy == [0, 1, 4, 5]
    assert slots.own == {"value": [2, 6]} and slots.of_extra("teacher") == [0, 1, 4, 5]
    assert slots.generation == [3, 7]
    # Colocated generation shares the policy's slots, not the critic's.
    colocated = placement(_policy(), cluster, samples=True, own_slots_per_node={"value": 2})
    assert colocated.policy == colocated.generation == [0, 1, 4, 5] and colocated.own["value"] == [2, 3, 6, 7]


def test_slots_left_for_the_policy_are_checked() -> None:
    with pytest.raises(
        UserError, match=r"value's 1 and generation's 1 .* leave none of cluster.gpus_per_node=2"
    ):
        placement(_policy(1), ClusterConfig(gpus_per_node=2), samples=True, own_slots_per_node={"value": 1})
