"""RayVirtualCluster on the session's local Ray: placement on CPU slots, locations, ports, timeouts."""

from __future__ import annotations

import os
import time

import pytest
import ray
from ray.util import placement_group_table

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.distributed.ray_start import init_ray, worker_pythonpath
from nemo_rl.distributed.virtual_cluster import PlacementTimeoutError, RayVirtualCluster

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _skip_without_two_slots(resources: dict[str, float]) -> None:
    if 0 < resources.get("GPU", 0.0) < 2:
        pytest.skip("the session's Ray has a single GPU; these placements need two slots")


def _wait_for_cpus(expected: float, timeout_s: float = 20.0) -> float:
    """Available CPUs once they reach ``expected`` (Ray frees removed placement groups asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while (available := ray.available_resources().get("CPU", 0.0)) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return available


def test_cluster_config_defaults_and_validation() -> None:
    cfg = ClusterConfig()
    assert (cfg.gpus_per_node, cfg.num_nodes, cfg.placement_timeout_s) == (1, 1, 180.0)
    assert ClusterConfig(gpus_per_node=2, num_nodes=3).world_size == 6
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ClusterConfig(gpus_per_node=0)
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        ClusterConfig.model_validate({"gpus_per_nodes": 2})


def test_init_ray_is_idempotent(ray_cluster: dict[str, float]) -> None:
    init_ray(ClusterConfig(gpus_per_node=64))
    assert ray.is_initialized()
    assert ray.cluster_resources()["CPU"] == ray_cluster["CPU"]


def test_worker_pythonpath_carries_test_directories() -> None:
    assert os.path.dirname(os.path.realpath(__file__)) in worker_pythonpath().split(os.pathsep)


def test_placement_on_cpu_slots(ray_cluster: dict[str, float]) -> None:
    _skip_without_two_slots(ray_cluster)
    cpus_before = _wait_for_cpus(
        ray_cluster["CPU"], timeout_s=5.0
    )  # earlier tests free theirs asynchronously
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=2, placement_timeout_s=60), name="placement_test")
    try:
        assert cluster.world_size == 2
        expected_bundle = {"GPU": 1.0, "CPU": 1.0} if cluster.use_gpus else {"CPU": 1.0}
        assert cluster.bundle_resources == expected_bundle
        table = placement_group_table(cluster.placement_groups[0])
        assert table["strategy"] == "STRICT_PACK"
        assert list(table["bundles"].values()) == [expected_bundle, expected_bundle]

        locations = cluster.bundle_locations()
        assert [loc.bundle_index for loc in locations] == [0, 1]
        assert [loc.pg_bundle_index for loc in locations] == [0, 1]
        alive = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        for loc in locations:
            assert alive[loc.node_id] == loc.node_ip

        address, port = cluster.get_master_address_and_port(1)
        assert address == locations[1].node_ip
        assert 1024 <= port <= 65535
        # Colocated actors take half a bundle each by default.
        assert cluster.actor_resources()["num_cpus"] == pytest.approx(0.5)
        with pytest.raises(IndexError, match="outside cluster"):
            cluster.get_master_address_and_port(2)
    finally:
        cluster.shutdown()
    cluster.shutdown()  # idempotent
    assert placement_group_table(locations[0].placement_group)["state"] == "REMOVED"
    assert _wait_for_cpus(cpus_before) == pytest.approx(cpus_before)


def test_bundle_sharing_is_bounded(ray_cluster: dict[str, float]) -> None:
    cluster = RayVirtualCluster(
        ClusterConfig(gpus_per_node=1, placement_timeout_s=60), max_colocated_worker_groups=2
    )
    try:
        cluster.reserve_bundles([0], "policy")
        cluster.reserve_bundles([0], "generation")
        with pytest.raises(ValueError, match=r"already hold 2 worker groups \(\['generation', 'policy'\]\)"):
            cluster.reserve_bundles([0], "third")
        cluster.release_bundles([0], "generation")
        cluster.reserve_bundles([0], "third")
        with pytest.raises(IndexError):
            cluster.reserve_bundles([1], "policy")
    finally:
        cluster.shutdown()


def test_placement_timeout_names_missing_resources(ray_cluster: dict[str, float]) -> None:
    cpus_before = _wait_for_cpus(
        ray_cluster["CPU"], timeout_s=5.0
    )  # earlier tests free theirs asynchronously
    slots = int(ray_cluster["CPU"]) + 4
    with pytest.raises(PlacementTimeoutError) as excinfo:
        RayVirtualCluster(ClusterConfig(gpus_per_node=slots, placement_timeout_s=1.0), name="too_big")
    message = str(excinfo.value)
    assert "'too_big'" in message
    assert "placement_timeout_s=1 s" in message
    assert f"cluster.gpus_per_node={slots}" in message
    assert f"CPU: {int(ray_cluster['CPU'])}" in message  # what Ray has
    assert "Lower cluster.gpus_per_node" in message and "cluster.num_nodes" in message
    # The failed placement groups were removed, so nothing stays reserved.
    assert _wait_for_cpus(cpus_before) == pytest.approx(cpus_before)
