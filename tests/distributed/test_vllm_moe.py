"""vLLM (marker ``vllm``) on the tiny Qwen3-MoE: greedy decoding matches Hugging Face token by token with its
log-probs; and again after a weight update that sends the 3-D expert tensors a transformers 5 policy's refit
sends (split into vLLM's per-expert checkpoint names by the worker extension; on vLLM's CPU build the extension
also repacks them for the CPU MoE kernel).

The module skips where vLLM is missing, as ``test_vllm.py`` does.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.vllm.engine_setup import installed_vllm_build
from nemo_rl.models.tokenizer import get_tokenizer

ASSET = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_qwen3_moe_init"
BUILD = installed_vllm_build()
_SKIP = (
    "vLLM is not installed"
    if BUILD is None
    else "vLLM's CUDA build needs a CUDA GPU"
    if BUILD == "cuda" and not torch.cuda.is_available()
    else None
)
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]
PROMPTS = [[8, 17, 30, 42, 9], [60, 13, 22], [11, 12, 13, 14, 15, 16, 17]]


def _scaled(seed: int) -> PreTrainedModel:
    """The tiny Qwen3-MoE with large weights: peaked routing and clear argmax margins."""
    model = AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.25)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm_moe")
    a, b = _scaled(1), _scaled(2)
    a.save_pretrained(root)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ASSET / name, root / name)
    return {"dir": root, "a": a, "b": b}


@pytest.fixture(scope="module")
def engine(models: dict[str, Any], ray_cluster: dict[str, float]) -> Iterator[Any]:
    from nemo_rl.models.generation.vllm.generation import VllmGeneration

    cfg = PolicyConfig.model_validate(
        {
            "model_name": str(models["dir"]),
            "max_total_sequence_length": 48,
            "precision": "float32",
            "generation": {
                "backend": "vllm",
                "max_new_tokens": 10,
                "vllm_cfg": {"precision": "float32", "cpu_kv_cache_gib": 0.25, "enforce_eager": True},
            },
        }
    )
    tokenizer = get_tokenizer(cfg.tokenizer, model_name=str(models["dir"]), trust_remote_code=False)
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=1, placement_timeout_s=300), name="vllm_moe")
    generation = VllmGeneration(cluster, cfg, tokenizer, seed=5, bundle_indices=[0])
    try:
        yield generation
    finally:
        generation.shutdown()
        cluster.shutdown()


def _check_greedy(hf: PreTrainedModel, out: BatchedDataDict[Any], lengths: torch.Tensor) -> float:
    worst = 0.0
    for row in range(out.size):
        start, end = int(lengths[row]), int(out["unpadded_sequence_lengths"][row])
        ids = out["output_ids"][row, :end]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
        for position in range(start, end):
            step, token = logprobs[position - 1], int(ids[position])
            assert step[token] >= step.max() - 1e-4, (row, position)
            worst = max(worst, abs(float(out["logprobs"][row, position]) - float(step[token])))
    return worst


def _prompts() -> BatchedDataDict[Any]:
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for row, prompt in enumerate(PROMPTS):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(p) for p in PROMPTS]))


def test_greedy_matches_hf(engine: Any, models: dict[str, Any]) -> None:
    data = _prompts()
    worst = _check_greedy(models["a"], engine.generate(data, greedy=True), data["input_lengths"])
    print(f"vLLM vs transformers on the tiny Qwen3-MoE, greedy log-probs max abs diff: {worst:.2e}")
    assert worst < 1e-4


def test_greedy_matches_hf_after_an_moe_weight_update(engine: Any, models: dict[str, Any]) -> None:
    data = _prompts()
    engine.finish_generation()
    # A refit moves one tensor per expert (docs/algorithms/moe.md); 3-D tensors given here are split so.
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in engine.expected_weights_manifest()
    engine.update_weights(models["b"].named_parameters())
    engine.prepare_for_generation()
    try:
        worst = _check_greedy(models["b"], engine.generate(data, greedy=True), data["input_lengths"])
    finally:
        engine.finish_generation()
        engine.update_weights(models["a"].named_parameters())
        engine.prepare_for_generation()
    print(f"after a refit to other weights, greedy log-probs max abs diff: {worst:.2e}")
    assert worst < 1e-4
