"""A generation pool that heals itself: a dead or frozen embedded replica is replaced on its slot, its rows are
sampled again with the same seeds, and past ``policy.generation.healing.max_replacements`` the pool stops with
one line naming the worker.

Two replicas of the tiny Qwen2 checkpoint on a two-bundle CPU cluster; every loss is made before a call (a
killed or SIGSTOPped process), which the call then finds. (A generation worker killed mid-rollout of a whole
run, sync and async, is in tests/functional/test_generation_healing_run.py.)
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.experience.agent_batching import GenerationBatcher, SampleRequest
from nemo_rl.models.generation.embedded.generation import EmbeddedGeneration
from nemo_rl.models.generation.healing import GenerationPoolError

TIMEOUT_S = 120.0
SEED = 1234


def _cfg(model_dir: Path, **healing: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "max_total_sequence_length": 64,
            "generation": {
                "max_new_tokens": 6,
                "temperature": 1.0,
                "healing": {"max_replacements": 2, "hang_timeout_s": 2.0, **healing},
            },
        }
    )


@pytest.fixture
def pool(
    ray_cluster: dict[str, float],
    tiny_assets: tuple[Path, PreTrainedTokenizerBase],
    request: pytest.FixtureRequest,
) -> Iterator[EmbeddedGeneration]:
    model_dir, tokenizer = tiny_assets
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=2), name="healing_test")
    gen = None
    try:
        gen = EmbeddedGeneration(cluster, _cfg(model_dir, **getattr(request, "param", {})), tokenizer, seed=7)
        yield gen
    finally:
        if gen is not None:
            gen.shutdown()
        cluster.shutdown()


def _prompts(tokenizer: PreTrainedTokenizerBase, n: int = 6) -> BatchedDataDict[Any]:
    rows = [tokenizer(f"count {i} to {i + 3}:")["input_ids"] for i in range(n)]
    width = max(map(len, rows))
    ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows])})


def _pid(gen: EmbeddedGeneration, rank: int) -> int:
    ping = gen.worker_group.workers[rank].__ray_call__.options(concurrency_group="health")
    return int(ray.get(ping.remote(lambda _worker: os.getpid()), timeout=TIMEOUT_S))


def test_a_killed_and_a_frozen_replica_are_replaced_and_sample_the_same_rows_again(
    pool: EmbeddedGeneration,
    tiny_assets: tuple[Path, PreTrainedTokenizerBase],
    capfd: pytest.CaptureFixture[str],
) -> None:
    _, tokenizer = tiny_assets
    data = _prompts(tokenizer)
    before = pool.generate(data, seed=SEED)
    refilled: list[list[int]] = []
    pool.set_refill(lambda ranks: refilled.append(list(ranks)))

    os.kill(_pid(pool, 1), signal.SIGKILL)
    after_kill = pool.generate(data, seed=SEED)
    # The replacement has the dead replica's rank, so its rows' seeds: the same tokens as before.
    assert torch.equal(after_kill["output_ids"], before["output_ids"])
    assert refilled == [[1]]
    assert pool.take_metrics() == {"generation/replaced_workers": 1.0}
    assert "generation worker 1 (replica 1) died during generate" in capfd.readouterr().out

    frozen = _pid(pool, 0)
    os.kill(frozen, signal.SIGSTOP)
    try:
        after_hang = pool.generate(data, seed=SEED)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the pool killed it; never leave a stopped process
            os.kill(frozen, signal.SIGKILL)
    assert torch.equal(after_hang["output_ids"], before["output_ids"])
    assert refilled == [[1], [0]]
    assert (
        "generation worker 0 (replica 0) hung during generate (answered no ping for 2 s)"
        in capfd.readouterr().out
    )
    # The healed workers take every other call as well.
    pool.finish_generation()
    pool.prepare_for_generation()

    # A third loss is past max_replacements=2: one line naming the worker and the key.
    os.kill(_pid(pool, 1), signal.SIGKILL)
    with pytest.raises(
        GenerationPoolError,
        match=r"generation worker 1 \(replica 1\) died during generate.*max_replacements=2",
    ):
        pool.generate(data, seed=SEED)


def test_the_agent_endpoints_requests_are_answered_across_a_lost_worker(
    pool: EmbeddedGeneration, tiny_assets: tuple[Path, PreTrainedTokenizerBase]
) -> None:
    # The agent endpoint batches its requests into the pool's generate calls, so a lost worker is replaced
    # under them and every request is answered.
    _, tokenizer = tiny_assets
    batcher = GenerationBatcher(pool, pad_token_id=tokenizer.pad_token_id, max_batch_size=8, wait_s=0.05)
    batcher.start()
    try:
        batcher.resume()
        os.kill(_pid(pool, 0), signal.SIGKILL)
        futures = [batcher.submit(SampleRequest(tokenizer(f"add {i} and 2:")["input_ids"])) for i in range(4)]
        results = [future.result(timeout=TIMEOUT_S) for future in futures]
    finally:
        batcher.stop(TIMEOUT_S)
    assert all(len(result.sampled_ids) > 0 for result in results)
    assert pool.take_metrics() == {"generation/replaced_workers": 1.0}


@pytest.mark.parametrize("pool", [{"start_timeout_s": 0.01}], indirect=True)
def test_a_replica_that_cannot_start_again_leaves_a_smaller_pool(
    pool: EmbeddedGeneration, tiny_assets: tuple[Path, PreTrainedTokenizerBase]
) -> None:
    _, tokenizer = tiny_assets
    data = _prompts(tokenizer)
    os.kill(_pid(pool, 0), signal.SIGKILL)
    out = pool.generate(data, seed=SEED)
    assert pool.dp_size == 1 and len(pool.workers) == 1
    assert out["output_ids"].shape[0] == data.size
    assert pool.worker_node_ids == [pool.worker_node_ids[0]]
    # The last replica cannot be dropped: losing it ends the pool with one line.
    os.kill(_pid(pool, 0), signal.SIGKILL)
    with pytest.raises(GenerationPoolError, match="no generation worker is left"):
        pool.generate(data, seed=SEED)
