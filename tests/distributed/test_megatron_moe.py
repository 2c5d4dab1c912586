"""MegatronPolicyWorker on the tiny Qwen3-MoE with expert parallelism (EP=2 over gloo) against the one-process
DTensor worker and Hugging Face transformers.

Two groups of forked ranks run at once: EP=2 on two ranks (each holds 4 of the 8 experts of every MoE layer;
tokens travel to their experts with the all-to-all dispatcher, or the all-gather one; Qwen3-MoE, and
GLM-4-MoE with its sigmoid group routing, correction bias and shared expert) and the one-process DTensor
worker. The tests compare 3 optimizer steps of SFT with transformers' load-balancing loss trained on
(loss, grad norm, aux loss; rel 1e-5, fp32), log-probs against transformers' forward, the HF -> Megatron ->
HF round trip and the refit streams (each expert-parallel rank sends its own experts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rank_groups import SaveFn, load, run_groups
from safetensors.torch import load_file
from test_moe_dtensor import AUX_COEF, GLOBAL_BATCH, LR, NUM_STEPS, NLLLoss, asset, hf_logprobs, make_batch

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
pytestmark = pytest.mark.mcore

SPAWN_TIMEOUT_S = 300.0
NUM_EXPERTS = 8
AUX = {"output_router_logits": True, "router_aux_loss_coef": AUX_COEF}


def common(family: str, hf_aux: bool = True) -> dict[str, Any]:
    """Qwen3-MoE trains with transformers' load-balancing loss (unless ``hf_aux`` is off); GLM-4-MoE has none
    (its correction bias)."""
    return {
        "model_name": str(asset(family)),
        "train_global_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size": GLOBAL_BATCH // 2,
        "max_grad_norm": 1.0,
        "hf_config_overrides": AUX if family == "qwen3_moe" and hf_aux else {},
    }


def megatron_cfg(
    megatron: dict[str, Any] | None = None, family: str = "qwen3_moe", hf_aux: bool = True
) -> PolicyConfig:
    """EP=2 with the DTensor reference's optimizer (AdamW, constant LR, no weight decay, clip 1)."""
    return PolicyConfig.model_validate(
        common(family, hf_aux)
        | {
            "optimizer": None,
            "scheduler": None,
            "dtensor_cfg": {"enabled": False},
            "megatron_cfg": {
                "enabled": True,
                "expert_model_parallel_size": 2,
                "optimizer": {"lr": LR, "min_lr": 0.0, "weight_decay": 0.0, "clip_grad": 1.0},
            }
            | (megatron or {}),
        }
    )


def dtensor_cfg(family: str) -> PolicyConfig:
    """One process, two micro-batches per step: the same rows each EP rank trains on."""
    return PolicyConfig.model_validate(
        common(family)
        | {"optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": LR, "weight_decay": 0.0}}}
    )


def train_data() -> BatchedDataDict[Any]:
    return make_batch(seed=1, num_rows=GLOBAL_BATCH * NUM_STEPS)


def score_data() -> BatchedDataDict[Any]:
    return make_batch(seed=2, num_rows=6)


# -------------------------------------------------------------------------------- spawned scenarios
def _ep2_scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    from nemo_rl.models.policy.megatron_worker import MegatronPolicyWorker

    for dispatcher in ("alltoall", "allgather"):
        worker = MegatronPolicyWorker(megatron_cfg({"moe_token_dispatcher_type": dispatcher}))
        save(f"{dispatcher}_local_experts", list(worker._local_experts()))
        save(f"{dispatcher}_logprobs", worker.get_logprobs(score_data())["logprobs"])
        shard = train_data().shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH)[worker.dp_rank]
        save(f"{dispatcher}_train", worker.train(shard, NLLLoss()))
        if dispatcher == "alltoall":
            save("trained_logprobs", worker.get_logprobs(score_data())["logprobs"])
            worker.export_hf(str(out_dir / "trained_export"))
        worker.shutdown()
    worker = MegatronPolicyWorker(megatron_cfg({"freeze_moe_router": True}))
    worker.export_hf(str(out_dir / "init_export"))
    save("stream", {"stream": worker.refit_stream(), "weights": dict(worker.iter_hf_weights(torch.float32))})
    save("manifest", worker.weights_manifest(torch.float32))
    router = worker.gpt.decoder.layers[0].mlp.router.weight
    save("router_frozen", not router.requires_grad)
    worker.shutdown()
    # megatron-core's own switch loss instead of transformers'.
    switch = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": AUX_COEF}
    worker = MegatronPolicyWorker(megatron_cfg(switch, hf_aux=False))
    shard = train_data().shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH)[worker.dp_rank]
    save("switch_train", worker.train(shard, NLLLoss()))
    worker.shutdown()
    # GLM-4-MoE: sigmoid groups with the correction bias, a shared expert, a dense first layer.
    worker = MegatronPolicyWorker(megatron_cfg(family="glm4_moe"))
    worker.export_hf(str(out_dir / "glm4_init_export"))
    save("glm4_logprobs", worker.get_logprobs(score_data())["logprobs"])
    shard = train_data().shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH)[worker.dp_rank]
    save("glm4_train", worker.train(shard, NLLLoss()))
    worker.shutdown()


def _reference_scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    for family, name in (("qwen3_moe", "train"), ("glm4_moe", "glm4_train")):
        worker = DTensorPolicyWorker(dtensor_cfg(family), init_reference_model=False)
        save(name, worker.train(train_data(), NLLLoss()))
        worker.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("megatron_moe_results")
    groups = [("ep2", 2, _ep2_scenarios), ("reference", 1, _reference_scenarios)]
    run_groups(groups, asset("qwen3_moe"), out_dir, timeout_s=SPAWN_TIMEOUT_S)
    return out_dir


def rel_close(actual: Any, expected: Any, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        rtol=rtol,
        atol=0,
    )


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize(
    ("scenario", "reference"),
    [("alltoall_train", "train"), ("allgather_train", "train"), ("glm4_train", "glm4_train")],
)
def test_ep2_sft_matches_one_process_dtensor(results: Path, scenario: str, reference: str) -> None:
    """Loss (with Qwen3-MoE's load-balancing loss), grad norm and the routing metrics."""
    expected = load(results, f"reference.{reference}")
    assert [load(results, "ep2.alltoall_local_experts", r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    keys = [k for k in expected["metrics"] if k.startswith("moe_")]
    assert "moe_router_entropy" in keys and "moe_expert_load_layer0_max" in keys
    for rank in range(2):
        got = load(results, f"ep2.{scenario}", rank)
        print(scenario, rank, got["loss"].tolist(), got["grad_norm"].tolist(), got["metrics"]["moe_aux_loss"])
        rel_close(got["loss"], expected["loss"])
        rel_close(got["grad_norm"], expected["grad_norm"])
        for key in keys:
            rel_close(got["metrics"][key], expected["metrics"][key])


@pytest.mark.parametrize(
    ("scenario", "family"),
    [("alltoall_logprobs", "qwen3_moe"), ("allgather_logprobs", "qwen3_moe"), ("glm4_logprobs", "glm4_moe")],
)
def test_ep2_logprobs_match_transformers(results: Path, scenario: str, family: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(asset(family), dtype=torch.float32)
    expected = hf_logprobs(model, score_data())
    for rank in range(2):
        diff = (load(results, f"ep2.{scenario}", rank) - expected).abs().max().item()
        print(f"{scenario} rank {rank}: max |logprob - transformers| = {diff:.2e}")
        assert diff <= 1e-5


@pytest.mark.parametrize(
    ("export", "family"), [("init_export", "qwen3_moe"), ("glm4_init_export", "glm4_moe")]
)
def test_ep2_round_trip_is_bit_exact_and_loads_in_transformers(
    results: Path, export: str, family: str
) -> None:
    from transformers import AutoModelForCausalLM

    export_dir = results / export
    files = sorted(export_dir.glob("*.safetensors"))
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    exported = [load_file(f) for f in files]
    original = load_file(asset(family) / "model.safetensors")
    assert set(exported[0]) | set(exported[1]) == set(original)
    # The second expert-parallel rank writes its own experts only.
    assert all(".mlp.experts." in name for name in exported[1])
    for name, tensor in original.items():
        assert torch.equal((exported[0] | exported[1])[name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    original_model = AutoModelForCausalLM.from_pretrained(asset(family), dtype=torch.float32)
    assert torch.equal(hf_logprobs(reloaded, score_data()), hf_logprobs(original_model, score_data()))
    if family != "qwen3_moe":
        return
    trained = AutoModelForCausalLM.from_pretrained(results / "trained_export", dtype=torch.float32)
    diff = (hf_logprobs(trained, score_data()) - load(results, "ep2.trained_logprobs")).abs().max().item()
    assert diff <= 1e-5


def test_each_expert_parallel_rank_streams_its_own_experts(results: Path) -> None:
    manifest = load(results, "ep2.manifest")
    streams = [load(results, "ep2.stream", rank) for rank in range(2)]
    assert [s["stream"] for s in streams] == [0, 1]
    names = [set(s["weights"]) for s in streams]
    assert not names[0] & names[1]
    assert names[0] | names[1] == set(manifest)
    for rank, expected_experts in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
        experts = {int(n.split(".")[5]) for n in names[rank] if ".mlp.experts." in n}
        assert experts == set(expected_experts)
    assert all(".mlp.experts." in n for n in names[1])
    original = load_file(asset("qwen3_moe") / "model.safetensors")
    for stream in streams:
        for name, tensor in stream["weights"].items():
            assert manifest[name] == (tuple(tensor.shape), "float32")
            assert torch.equal(tensor, original[name]), name
    assert all(load(results, "ep2.router_frozen", rank) for rank in range(2))


def test_megatron_aux_loss_replaces_transformers_in_the_trained_loss(results: Path) -> None:
    """Step 1 starts from the same weights: its loss is the NLL plus the coefficient times the logged loss."""
    hf_aux = load(results, "ep2.alltoall_train")
    switch = load(results, "ep2.switch_train")
    nll = float(hf_aux["loss"][0]) - AUX_COEF * hf_aux["metrics"]["moe_aux_loss"][0]
    megatron_aux = switch["metrics"]["moe_megatron_aux_loss"][0]
    print(
        "megatron aux_loss",
        switch["metrics"]["moe_megatron_aux_loss"],
        "transformers'",
        hf_aux["metrics"]["moe_aux_loss"],
    )
    # Near balanced routing both are about 1 per layer (transformers' about K over all layers together).
    assert 0.5 < megatron_aux / 2 < 2.0
    rel_close(switch["loss"][0], nll + AUX_COEF * megatron_aux)
