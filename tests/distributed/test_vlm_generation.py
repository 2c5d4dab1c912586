"""The embedded engine's generation worker on the tiny Qwen2.5-VL next to the DTensor policy (one slot each,
fp32, Ray), as GRPO drives them:

- the run's ``Refitter`` checks both manifests (the vision tower and its projection included) and its refit
  replaces an engine started from other weights (a different vision tower) with the policy's: every weight
  equal, and greedy outputs on image prompts equal transformers' ``generate`` with the policy's weights;
- the engine's sampled log-probs on image prompts equal the policy's scores of the same sequences with the
  same images (``gen_kl_error`` ~0 in fp32);
- the engine hosted in the policy's worker (``in_policy_workers``) refits in process and samples the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import AutoProcessor
from vlm_prompts import build_vlm, generated, generation_batch, hf_greedy, image_prompts, pictures

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.embedded.in_policy import InPolicyEmbeddedGeneration
from nemo_rl.models.generation.factory import create_generation
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.models.tokenizer import get_policy_tokenizer
from nemo_rl.weight_sync.refitter import Refitter

TIMEOUT_S = 300.0
MAX_NEW_TOKENS = 8


def _cfg(model_dir: Path) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "train_global_batch_size": 2,
            "train_micro_batch_size": 1,
            "max_total_sequence_length": 96,
            "precision": "float32",
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
            "generation": {
                "max_new_tokens": MAX_NEW_TOKENS,
                "embedded_cfg": {"precision": "float32", "in_policy_workers": True},
            },
        }
    )


@pytest.fixture(scope="module")
def stack(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The policy on the checkpoint ``policy``, a generation worker started from ``other`` (other weights,
    the vision tower's among them), and image prompts."""
    root = tmp_path_factory.mktemp("vlm_generation")
    hf = build_vlm(root / "policy", seed=0)
    build_vlm(root / "other", seed=5)
    cfg = _cfg(root / "policy")
    tokenizer = get_policy_tokenizer(cfg)
    prompts = image_prompts(AutoProcessor.from_pretrained(root / "policy"), pictures())
    cluster = RayVirtualCluster(
        ClusterConfig(gpus_per_node=1, placement_timeout_s=120), name="vlm_gen", max_colocated_worker_groups=2
    )
    policy = Policy(cluster, cfg, name_prefix="vlm_gen_policy", init_reference_model=False)
    generation = create_generation(
        cluster, cfg, tokenizer, seed=0, bundle_indices=[0], model_path=str(root / "other")
    )
    try:
        yield {"hf": hf, "cfg": cfg, "policy": policy, "generation": generation, "prompts": prompts}
    finally:
        generation.shutdown()
        policy.shutdown()
        cluster.shutdown()


def _engine_weights(generation: Any) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = ray.get(
        generation.workers[0].named_weights.remote(), timeout=TIMEOUT_S
    )
    return weights


def test_refit_carries_the_vision_tower_and_greedy_equals_transformers(stack: dict[str, Any]) -> None:
    generation, policy, hf = stack["generation"], stack["policy"], stack["hf"]
    before = _engine_weights(generation)
    refitter = Refitter.create(stack["cfg"], policy, generation)
    try:
        refitter.refit()
    finally:
        refitter.shutdown()
    after = _engine_weights(generation)
    expected_weights = dict(hf.named_parameters())
    tower = [name for name in after if name.startswith("model.visual.")]
    assert any(name.startswith("model.visual.merger.") for name in tower) and len(tower) > 20
    for name in tower:  # the norms are 1 in both checkpoints (see vlm_prompts.build_vlm)
        assert "norm" in name or "ln_q" in name or not torch.equal(before[name], after[name]), name
    for name, tensor in after.items():
        assert torch.equal(tensor, expected_weights[name].detach()), name

    prompts = stack["prompts"]
    out = generation.generate(generation_batch([*prompts, prompts[0]], pad_token_id=0), greedy=True)
    expected = [hf_greedy(hf, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    assert [generated(out, row) for row in range(out.size)] == [*expected, expected[0]]


def _assert_policy_scores_as_engine(policy: Policy, sampled: BatchedDataDict[Any], batch: Any) -> None:
    scored = BatchedDataDict[Any](
        input_ids=sampled["output_ids"],
        input_lengths=sampled["unpadded_sequence_lengths"],
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
    )
    policy_logprobs = policy.get_logprobs(scored)["logprobs"]
    for row in range(sampled.size):
        start, end = int(batch["input_lengths"][row]), int(sampled["unpadded_sequence_lengths"][row])
        diff = (sampled["logprobs"][row, start:end] - policy_logprobs[row, start:end]).abs().max()
        assert diff <= 1e-4, f"row {row}: engine and policy log-probs differ by {diff}"


def test_sampled_logprobs_equal_the_policy_scores_with_images(stack: dict[str, Any]) -> None:
    batch = generation_batch([*stack["prompts"], stack["prompts"][1]], pad_token_id=0)
    sampled = stack["generation"].generate(batch, greedy=False)
    assert int(sampled["generation_lengths"].sum()) > sampled.size
    _assert_policy_scores_as_engine(stack["policy"], sampled, batch)


def test_engine_hosted_in_the_policy_refits_in_process_with_images(stack: dict[str, Any]) -> None:
    policy = stack["policy"]
    tokenizer = get_policy_tokenizer(stack["cfg"])
    in_policy = InPolicyEmbeddedGeneration(policy, tokenizer, seed=0)
    Refitter.create(stack["cfg"], policy, in_policy).refit()
    batch = generation_batch(stack["prompts"], pad_token_id=0)
    greedy = in_policy.generate(batch, greedy=True)
    expected = [hf_greedy(stack["hf"], prompt, MAX_NEW_TOKENS) for prompt in stack["prompts"]]
    assert [generated(greedy, row) for row in range(greedy.size)] == expected
    _assert_policy_scores_as_engine(policy, in_policy.generate(batch, greedy=False), batch)
