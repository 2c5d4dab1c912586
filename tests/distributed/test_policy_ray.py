"""The driver-side Policy on Ray workers (dp=2 over CPU bundles) against a single-process reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_dtensor_worker import (
    TinyNLLLoss,
    assert_close,
    build_tiny_model,
    make_batch,
    policy_cfg,
    reference_logprobs,
    single_process_reference,
    train_data,
)
from transformers import AutoModelForCausalLM

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.policy.lm_policy import Policy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen2_policy")
    build_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def policy(ray_cluster: dict[str, float], model_dir: Path) -> Iterator[Policy]:
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=2, placement_timeout_s=60), name="policy_test")
    try:
        policy = Policy(cluster, policy_cfg(model_dir), name_prefix="policy_test")
        try:
            yield policy
        finally:
            policy.shutdown()
    finally:
        cluster.shutdown()


def test_policy_scores_and_trains_like_one_process(policy: Policy, model_dir: Path) -> None:
    assert policy.dp_size == 2
    reference = single_process_reference(model_dir)
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    # 7 rows: uneven over 2 dp groups, and dealt by length, so the order must be restored.
    score_data = make_batch(seed=5, num_rows=7)
    expected = reference_logprobs(initial, score_data)
    assert_close(policy.get_logprobs(score_data)["logprobs"], expected)

    result: dict[str, Any] = dict(policy.train(train_data(), TinyNLLLoss()))
    assert_close(result["loss"], reference["loss"])
    assert_close(result["grad_norm"], reference["grad_norm"])
    assert_close(result["lr"], reference["lr"])

    trained = reference_logprobs(reference["trained_model"], score_data)
    assert_close(policy.get_logprobs(score_data)["logprobs"], trained, rtol=1e-4)
    assert_close(policy.get_reference_policy_logprobs(score_data)["reference_logprobs"], expected)

    eval_result = dict(policy.train(train_data().slice(0, 8), TinyNLLLoss(), eval_mode=True))
    assert "grad_norm" not in eval_result
    assert_close(policy.get_logprobs(score_data)["logprobs"], trained, rtol=1e-4)  # eval changed nothing

    # Answered by the workers from the loaded config (the tiny model has no dropout; GRPO asks this).
    assert policy.trains_with_dropout() is False

    manifest = policy.weights_manifest(torch.bfloat16)
    assert manifest["lm_head.weight"] == ((128, 64), "bfloat16")
    assert set(manifest) == set(initial.state_dict())
