"""RayWorkerGroup on two CPU slots: env vars, gloo collectives, sharded data, colocation and worker failures."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import torch.distributed as dist

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.device import configure_worker_threads, init_process_group_from_env
from nemo_rl.distributed.lost_calls import LostCallError
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_group_facade import WorkerGroupFacade, start_together
from nemo_rl.distributed.worker_groups import RayWorkerGroup, WorkerDiedError

TIMEOUT_S = 120.0

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NEMO_RL_WORKER_GROUP",
    "NEMO_RL_DP_RANK",
    "NEMO_RL_DP_SIZE",
    "NEMO_RL_TP_RANK",
    "NEMO_RL_TP_SIZE",
    "NEMO_RL_BUNDLE_INDEX",
    "NEMO_RL_TEST_FLAG",
)


class EchoWorker:
    """A worker exercising the group's plumbing; its ``shutdown`` leaves a marker file per rank."""

    def __init__(self, fail_in_init_rank: int | None = None, marker_dir: str | None = None) -> None:
        configure_worker_threads()
        if fail_in_init_rank == int(os.environ["RANK"]):
            raise RuntimeError("init failed on purpose")
        self.marker_dir = marker_dir
        self.log: list[str] = []

    def record(self, entry: str) -> None:
        self.log.append(entry)

    def records(self) -> list[str]:
        return list(self.log)

    def env(self) -> dict[str, str | None]:
        return {key: os.environ.get(key) for key in ENV_KEYS}

    def all_reduce_rank(self) -> float:
        init_process_group_from_env(timeout_s=60.0)
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return float(value.item())

    def scale(self, data: BatchedDataDict[Any], factor: int) -> BatchedDataDict[Any]:
        rank = int(os.environ["RANK"])
        return BatchedDataDict({"x": data["x"] * factor, "rank": [rank] * data.size})

    def fail(self) -> None:
        raise ValueError("method failed on purpose")

    def fail_on_rank(self, rank: int) -> None:
        if int(os.environ["RANK"]) == rank:
            raise ValueError(f"rank {rank} failed on purpose\nsecond line")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def exit_process(self) -> None:
        os._exit(3)

    def shutdown(self) -> None:
        if self.marker_dir is not None:
            Path(self.marker_dir, f"rank{os.environ['RANK']}").write_text("bye")


@pytest.fixture(scope="module")
def cluster(ray_cluster: dict[str, float]) -> Iterator[RayVirtualCluster]:
    if 0 < ray_cluster.get("GPU", 0.0) < 2:
        pytest.skip("the session's Ray has a single GPU; these tests need two slots")
    virtual_cluster = RayVirtualCluster(
        ClusterConfig(gpus_per_node=2, placement_timeout_s=60), name="wg_test"
    )
    yield virtual_cluster
    virtual_cluster.shutdown()


@pytest.fixture(scope="module")
def policy_group(cluster: RayVirtualCluster) -> Iterator[RayWorkerGroup]:
    group = RayWorkerGroup(cluster, EchoWorker, name="policy", env_vars={"NEMO_RL_TEST_FLAG": "on"})
    group.wait_until_ready(TIMEOUT_S)
    yield group
    group.shutdown()


def test_env_vars_and_ranks(cluster: RayVirtualCluster, policy_group: RayWorkerGroup) -> None:
    assert (policy_group.world_size, policy_group.dp_size, policy_group.tp_size) == (2, 2, 1)
    envs = policy_group.get_all_worker_results(policy_group.run_all_workers_single_data("env"), TIMEOUT_S)
    master_ip = cluster.bundle_locations()[0].node_ip
    for rank, env in enumerate(envs):
        assert env["RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank)  # both bundles are on the one local node
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == master_ip
        assert env["NEMO_RL_WORKER_GROUP"] == "policy"
        assert (env["NEMO_RL_DP_RANK"], env["NEMO_RL_DP_SIZE"]) == (str(rank), "2")
        assert (env["NEMO_RL_TP_RANK"], env["NEMO_RL_TP_SIZE"]) == ("0", "1")
        assert env["NEMO_RL_BUNDLE_INDEX"] == str(rank)
        assert env["NEMO_RL_TEST_FLAG"] == "on"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert int(envs[0]["MASTER_PORT"] or 0) > 0


def test_gloo_all_reduce(policy_group: RayWorkerGroup) -> None:
    results = policy_group.get_all_worker_results(
        policy_group.run_all_workers_single_data("all_reduce_rank"), TIMEOUT_S
    )
    assert results == [3.0, 3.0]


def test_sharded_data_comes_back_in_order_dp2(policy_group: RayWorkerGroup) -> None:
    data: BatchedDataDict[Any] = BatchedDataDict(
        {"x": torch.arange(8), "input_lengths": torch.tensor([9, 8, 7, 6, 1, 2, 3, 4])}
    )
    shards = data.shard_by_batch_size(policy_group.dp_size)
    refs = policy_group.run_all_workers_sharded_data("scale", shards, 3)
    merged = BatchedDataDict.from_batches(policy_group.get_dp_leader_results(refs, TIMEOUT_S))
    assert merged["x"].tolist() == [3 * i for i in range(8)]
    assert merged["rank"] == [0] * 4 + [1] * 4

    indices = data.shard_indices(policy_group.dp_size, batch_size=4, balance_by_length_key="input_lengths")
    shards = [data.select_indices(shard) for shard in indices]
    refs = policy_group.run_all_workers_sharded_data("scale", shards, factor=2)
    merged = BatchedDataDict.from_shards(policy_group.get_dp_leader_results(refs, TIMEOUT_S), indices)
    assert merged["x"].tolist() == [2 * i for i in range(8)]


def test_method_error_names_the_worker(policy_group: RayWorkerGroup) -> None:
    with pytest.raises(ValueError, match="method failed on purpose") as excinfo:
        policy_group.get_all_worker_results([policy_group.run_single_worker("fail", 1)], TIMEOUT_S)
    assert "raised in rank 1, method 'fail' of worker group 'policy'" in excinfo.value.__notes__


def test_deferred_calls_run_first_and_fail_at_the_next_wait(policy_group: RayWorkerGroup) -> None:
    """run_all_workers_deferred does not wait, but the workers run the call before the next one, and the next
    wait raises its error (once)."""
    before = policy_group.get_all_worker_results(
        policy_group.run_all_workers_single_data("records"), TIMEOUT_S
    )
    policy_group.run_all_workers_deferred("record", "deferred")
    policy_group.run_all_workers_deferred("sleep", 0.2)
    refs = policy_group.run_all_workers_single_data("records")
    assert policy_group.get_all_worker_results(refs, TIMEOUT_S) == [[*log, "deferred"] for log in before]
    policy_group.run_all_workers_deferred("fail")
    with pytest.raises(ValueError, match="method failed on purpose"):
        policy_group.get_all_worker_results([policy_group.run_single_worker("records", 0)], TIMEOUT_S)
    # Collected by that wait: the next one does not raise it again.
    assert policy_group.get_all_worker_results([policy_group.run_single_worker("env", 1)], TIMEOUT_S)


def test_deferred_failures_nobody_waited_for_are_raised_at_shutdown(ray_cluster: dict[str, float]) -> None:
    """A deferred call whose error no wait collected (the driver's last call on the group) is reported when the
    group shuts down and raised, named, when its cluster shuts down: a failed method and a worker that died."""
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=1, placement_timeout_s=60), name="lost_calls")
    try:
        # Two colocated one-worker groups, started at once.
        policy = RayWorkerGroup(cluster, EchoWorker, name="policy")
        generation = RayWorkerGroup(cluster, EchoWorker, name="generation")
        for group in (policy, generation):
            group.wait_until_ready(TIMEOUT_S)
        policy.run_all_workers_deferred("fail_on_rank", 0)
        policy.run_all_workers_deferred("record", "fine")  # succeeds: not reported
        generation.run_all_workers_deferred("exit_process")
        policy.shutdown()
        generation.shutdown()
    except BaseException:
        with contextlib.suppress(LostCallError):
            cluster.shutdown()
        raise
    with pytest.raises(LostCallError) as info:
        cluster.shutdown()
    assert str(info.value).splitlines()[:2] == [
        "worker calls failed after the driver's last wait for them (2):",
        "worker group 'policy': deferred call fail_on_rank() on rank 0 failed: ValueError: rank 0 failed on purpose",
    ]
    assert (
        str(info.value)
        .splitlines()[2]
        .startswith(
            "worker group 'generation': deferred call exit_process() on rank 0 failed: WorkerDiedError: rank 0 of "
            "worker group 'generation' died. Ray reported: "
        )
    )
    cluster.shutdown()  # raised once
    # Shut down while another error propagates: that error stays the one raised, with the lost calls as a note.
    cluster.lost_calls.report("worker group 'policy': deferred call train() on rank 0 failed: ValueError: x")
    with pytest.raises(KeyboardInterrupt) as interrupted:
        try:
            raise KeyboardInterrupt
        finally:
            cluster.shutdown()
    assert interrupted.value.__notes__ == [
        "worker calls failed after the driver's last wait for them (1):\n"
        "worker group 'policy': deferred call train() on rank 0 failed: ValueError: x"
    ]


def test_timeout_names_pending_workers(policy_group: RayWorkerGroup) -> None:
    refs = policy_group.run_all_workers_single_data("sleep", 2.0)
    with pytest.raises(TimeoutError, match=r"'policy': rank 0 \(sleep\), rank 1 \(sleep\) did not finish"):
        policy_group.get_all_worker_results(refs, timeout_s=0.2)
    assert policy_group.get_all_worker_results(refs, TIMEOUT_S) == [None, None]


def test_bad_arguments_fail_early(cluster: RayVirtualCluster, policy_group: RayWorkerGroup) -> None:
    with pytest.raises(ValueError, match="must be >= 1 and divide the 2 workers"):
        RayWorkerGroup(cluster, EchoWorker, name="bad", dp_size=3)
    with pytest.raises(ValueError, match=r"may not set \['RANK'\]"):
        RayWorkerGroup(cluster, EchoWorker, name="bad", env_vars={"RANK": "7"})
    with pytest.raises(ValueError, match="repeats a bundle"):
        RayWorkerGroup(cluster, EchoWorker, name="bad", bundle_indices=[0, 0])
    with pytest.raises(TypeError, match="plain worker class"):
        RayWorkerGroup(cluster, ray.remote(EchoWorker), name="bad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 1 data shards for dp_size=2"):
        policy_group.run_all_workers_sharded_data("scale", [BatchedDataDict({"x": torch.ones(1)})], 1)
    with pytest.raises(AttributeError, match="no method 'missing'"):
        policy_group.run_all_workers_single_data("missing")
    with pytest.raises(ValueError, match="one ref per worker"):
        policy_group.get_dp_leader_results([policy_group.run_single_worker("env", 0)], TIMEOUT_S)


def test_colocated_group_with_dp1_tp2(
    cluster: RayVirtualCluster, policy_group: RayWorkerGroup, tmp_path: Path
) -> None:
    generation = RayWorkerGroup(
        cluster, EchoWorker, name="generation", dp_size=1, init_kwargs={"marker_dir": str(tmp_path)}
    )
    try:
        assert (generation.dp_size, generation.tp_size) == (1, 2)
        envs = generation.get_all_worker_results(generation.run_all_workers_single_data("env"), TIMEOUT_S)
        policy_envs = policy_group.get_all_worker_results(
            policy_group.run_all_workers_single_data("env"), TIMEOUT_S
        )
        # Same bundles as the policy group, its own rendezvous port.
        assert [env["NEMO_RL_BUNDLE_INDEX"] for env in envs] == ["0", "1"]
        assert envs[0]["MASTER_PORT"] != policy_envs[0]["MASTER_PORT"]
        assert [(env["NEMO_RL_DP_RANK"], env["NEMO_RL_TP_RANK"]) for env in envs] == [("0", "0"), ("0", "1")]
        assert envs[0]["NEMO_RL_TEST_FLAG"] is None

        # Both tensor-parallel ranks receive the single dp shard; the dp leader's result is returned.
        data: BatchedDataDict[Any] = BatchedDataDict({"x": torch.arange(4)})
        refs = generation.run_all_workers_sharded_data("scale", [data], 5)
        all_results = generation.get_all_worker_results(refs, TIMEOUT_S)
        assert [result["x"].tolist() for result in all_results] == [[0, 5, 10, 15]] * 2
        assert [result["rank"] for result in all_results] == [[0] * 4, [1] * 4]
        leaders = generation.get_dp_leader_results(
            generation.run_all_workers_sharded_data("scale", [data], 5), TIMEOUT_S
        )
        assert len(leaders) == 1 and leaders[0]["rank"] == [0] * 4

        # Both groups run collectives on the shared bundles.
        assert generation.get_all_worker_results(
            generation.run_all_workers_single_data("all_reduce_rank"), TIMEOUT_S
        ) == [3.0, 3.0]

        with pytest.raises(ValueError, match="already hold 2 worker groups"):
            RayWorkerGroup(cluster, EchoWorker, name="third")
    finally:
        generation.shutdown()
    # The graceful shutdown method ran on every worker before the actors were killed.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    with pytest.raises(RuntimeError, match="was shut down"):
        generation.run_all_workers_single_data("env")


def test_dead_workers_raise_worker_died(cluster: RayVirtualCluster, policy_group: RayWorkerGroup) -> None:
    group = RayWorkerGroup(cluster, EchoWorker, name="doomed", init_kwargs={"fail_in_init_rank": 1})
    try:
        # Rank 1 raises in __init__: waiting for the group names it and carries the exception.
        with pytest.raises(WorkerDiedError, match="rank 1 of worker group 'doomed' died") as excinfo:
            group.wait_until_ready(TIMEOUT_S)
        assert (excinfo.value.group_name, excinfo.value.rank) == ("doomed", 1)
        assert "init failed on purpose" in excinfo.value.cause
        with pytest.raises(WorkerDiedError, match=r"(?s)rank 1 .* init failed on purpose"):
            group.get_all_worker_results(group.run_all_workers_single_data("env"), TIMEOUT_S)

        # Rank 0 is alive until its process exits in the middle of a method.
        assert group.get_all_worker_results([group.run_single_worker("env", 0)], TIMEOUT_S)[0]["RANK"] == "0"
        with pytest.raises(WorkerDiedError, match="rank 0 of worker group 'doomed' died") as excinfo:
            group.get_all_worker_results([group.run_single_worker("exit_process", 0)], TIMEOUT_S)
        assert excinfo.value.rank == 0
        assert "died" in excinfo.value.cause
    finally:
        group.shutdown(graceful_timeout_s=5.0)


def test_groups_started_together_fail_together(ray_cluster: dict[str, float], tmp_path: Path) -> None:
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=1, placement_timeout_s=60), name="together")
    try:
        # One group fails to start: the error names it when the block ends, and the block's other group,
        # which started fine, is shut down with it (its graceful shutdown ran, its slot share is free).
        with pytest.raises(WorkerDiedError, match="worker group 'bad'"), start_together():
            good = WorkerGroupFacade(
                RayWorkerGroup(cluster, EchoWorker, name="good", init_kwargs={"marker_dir": str(tmp_path)}),
                call_timeout_s=TIMEOUT_S,
            )
            WorkerGroupFacade(
                RayWorkerGroup(cluster, EchoWorker, name="bad", init_kwargs={"fail_in_init_rank": 0}),
                call_timeout_s=TIMEOUT_S,
            )
        assert (tmp_path / "rank0").read_text() == "bye"
        with pytest.raises(RuntimeError, match="was shut down"):
            good.worker_group.run_all_workers_single_data("env")

        # Both groups gave their slot shares back: two new groups fit on the slot, and start together.
        with start_together():
            groups = [
                WorkerGroupFacade(RayWorkerGroup(cluster, EchoWorker, name=n), call_timeout_s=TIMEOUT_S)
                for n in "ab"
            ]
        for group in groups:
            assert group._on_rank_0("env")["NEMO_RL_WORKER_GROUP"] == group.worker_group.name
            group.shutdown()
    finally:
        cluster.shutdown()
