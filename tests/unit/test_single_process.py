"""A run that fits one worker slot runs in the driver's process (nemo_rl.distributed.single_process): when it
may, when it must not, and the worker group that stands in for Ray's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.single_process import (
    LocalCluster,
    LocalRef,
    LocalWorkerGroup,
    resolve,
    runs_in_one_process,
    single_process_refusal,
)

ROOT = Path(__file__).resolve().parents[2]


def _policy(**generation: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": "examples/assets/tiny_math_sft",
            "generation": {"backend": "embedded", "embedded_cfg": {"in_policy_workers": True}, **generation},
        }
    )


def test_a_one_slot_run_sampling_in_its_policy_worker_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert single_process_refusal(ClusterConfig(), _policy(), samples=True) is None
    assert single_process_refusal(ClusterConfig(), _policy(), samples=False) is None


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("two slots", "2 worker slots"),
        ("ray address", "RAY_ADDRESS"),
        ("megatron", "Megatron"),
        ("own generation workers", "in_policy_workers=true"),
        ("a critic", "critic beside the policy"),
        ("reward model", "reward-model environment"),
    ],
)
def test_what_needs_ray_is_named(case: str, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster, policy, kwargs = ClusterConfig(), _policy(), {"samples": True}
    if case == "two slots":
        cluster = ClusterConfig(gpus_per_node=2)
    elif case == "ray address":
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    elif case == "megatron":
        policy = policy.model_copy(
            update={"megatron_cfg": policy.megatron_cfg.model_copy(update={"enabled": True})}
        )
    elif case == "own generation workers":
        policy = _policy(embedded_cfg={"in_policy_workers": False})
    elif case == "a critic":
        kwargs["extra_models"] = ["critic"]
    else:
        kwargs["reward_model_env"] = True
    refusal = single_process_refusal(cluster, policy, **kwargs)
    assert refusal is not None and expected in refusal


def test_auto_picks_one_process_only_without_cuda_and_true_insists() -> None:
    auto, on, off = (ClusterConfig(single_process=v) for v in ("auto", True, False))
    assert runs_in_one_process(auto, None, cuda=False)
    assert not runs_in_one_process(auto, None, cuda=True)
    assert runs_in_one_process(on, None, cuda=True)
    assert not runs_in_one_process(off, None, cuda=False)
    assert not runs_in_one_process(auto, "it has 2 worker slots", cuda=False)
    with pytest.raises(
        UserError, match=r"single_process=true, but this run needs Ray: it has 2 worker slots"
    ):
        runs_in_one_process(on, "it has 2 worker slots", cuda=False)


class _Worker:
    """A worker class as the policy's are written: built from keyword arguments, methods called by name."""

    def __init__(self, scale: int) -> None:
        self.scale = scale
        self.rank_env = {
            k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "NEMO_RL_WORKER_GROUP")
        }
        self.calls: list[str] = []
        self.shutdowns = 0

    def times(self, value: int) -> int:
        self.calls.append("times")
        return value * self.scale

    def fail(self) -> None:
        raise ValueError("bad batch")

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_the_worker_runs_in_this_process_behind_the_group_interface() -> None:
    group = LocalWorkerGroup(LocalCluster(ClusterConfig()), _Worker, name="policy", init_kwargs={"scale": 3})
    (worker,) = group.workers
    assert worker.rank_env == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "NEMO_RL_WORKER_GROUP": "policy",
    }
    assert group.get_all_worker_results(group.run_all_workers_single_data("times", 2), timeout_s=1) == [6]
    assert group.get_dp_leader_results(group.run_all_workers_sharded_data("times", [5]), timeout_s=1) == [15]
    assert group.get_all_worker_results([group.run_single_worker("times", 0, value=1)], timeout_s=1) == [3]
    with pytest.raises(IndexError, match="no rank 1"):
        group.run_single_worker("times", 1, 1)
    # A call's error is raised where its result is read, naming the group, as a Ray worker's would be.
    ref = group.run_single_worker("fail", 0)
    with pytest.raises(ValueError, match="bad batch") as raised:
        group.get_all_worker_results([ref], timeout_s=1)
    assert any("group 'policy'" in note for note in raised.value.__notes__)
    # A deferred call has no later reader here: its error is raised at once.
    with pytest.raises(ValueError, match="bad batch"):
        group.run_all_workers_deferred("fail")
    with pytest.raises(AttributeError, match="no method 'nope'"):
        group.run_all_workers_single_data("nope")
    group.shutdown()
    group.shutdown()
    assert worker.shutdowns == 1
    with pytest.raises(RuntimeError, match="was shut down"):
        group.run_all_workers_single_data("times", 1)


def test_local_refs_and_ray_refs_read_alike() -> None:
    assert resolve(LocalRef(4), timeout_s=1) == 4
    assert resolve(LocalRef.of_call(lambda: 5), timeout_s=1) == 5
    with pytest.raises(KeyError):
        resolve(LocalRef.of_call(dict().__getitem__, "x"), timeout_s=1)


def test_insisting_on_one_process_for_a_run_that_needs_ray_exits_2_before_ray_starts() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "run_grpo_math.py"),
            "--config",
            str(ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"),
            "cluster.single_process=true",
            "cluster.gpus_per_node=2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and "cluster.single_process=true, but this run needs Ray: it has 2 worker slots" in lines[0]
    )
    assert "Ray" not in result.stdout
