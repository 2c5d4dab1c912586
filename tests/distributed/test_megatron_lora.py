"""LoRA on the Megatron worker (``megatron_cfg.peft``) over gloo against the one-process DTensor LoRA worker.

The Megatron adapters are the Hugging Face adapters (three on ``linear_qkv``, two on ``linear_fc1``), so
with the same model, data and initial adapters the two backends train alike: TP=2, TP=2 with sequence
parallelism and PP=2 (through an adapter-only checkpoint after two steps) match the DTensor worker's loss and
gradient norm over 3 optimizer steps (rel 1e-5, fp32); the merged refit weights match the DTensor worker's;
the reference policy is the base model; the export is the merged model plus a PEFT folder. The processes
are spawned as in ``test_megatron_worker.py``, whose tiny model, helpers and spawner this module reuses.
"""

from __future__ import annotations

import json
from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_groups import SaveFn, load, run_groups
from safetensors.torch import load_file
from test_dtensor_worker import GLOBAL_BATCH, reference_logprobs, train_data
from test_megatron_worker import SPAWN_TIMEOUT_S, assert_close, dtensor_cfg, megatron_cfg, score_data, shard
from transformers import AutoModelForCausalLM

from nemo_rl.algorithms.loss_functions import NLLLoss
from nemo_rl.models.lora import LORA_METADATA_FILE, PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE, peft_name

pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
pytestmark = pytest.mark.mcore

PEFT = {"enabled": True, "dim": 4, "alpha": 8}
"""The same adapters on both backends: every linear layer of every decoder layer, rank 4, scale 2."""
LORA_CFG = {"enabled": True, "dim": 4, "alpha": 8, "match_all_linear": True}
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_megatron(model_dir: Path, tp: int = 1, pp: int = 1, **megatron: Any) -> Any:
    return megatron_cfg(model_dir, tp=tp, pp=pp, megatron={"peft": PEFT} | megatron)


def _stage_adapters(worker: Any) -> dict[str, torch.Tensor]:
    """This stage's adapters, full, under their Hugging Face names (a TP collective)."""
    weights = worker.weights
    return dict(weights.iter_hf_tensors(None, weights.adapter_rules))


# -------------------------------------------------------------------------------- spawned scenarios
def _reference_scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    """The one-process DTensor worker with the same adapters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from nemo_rl.models.lora import is_adapter_name, merged_weights
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    worker = DTensorPolicyWorker(dtensor_cfg(model_dir, {"lora_cfg": LORA_CFG}))
    save("summary", [*astuple(worker.lora_summary()), worker.adapter_refits()])
    state = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True))
    save("adapters_init", {name: value.clone() for name, value in state.items() if is_adapter_name(name)})
    save("nll", worker.train(train_data(), NLLLoss()))
    # The DTensor worker's full refit carries the base weights and the adapters apart: fold them as engines do.
    stream = worker.iter_hf_weights(torch.float32)
    merged = merged_weights(stream, LORA_CFG["alpha"] / LORA_CFG["dim"], set(worker.lora_targets))
    save("stream", dict(merged))
    save("logprobs_trained", worker.get_logprobs(score_data()))
    worker.shutdown()


def _megatron_scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    """Two ranks: TP=2 (training, refit stream, reference, export), TP=2 with SP, PP=2 with a checkpoint."""
    from nemo_rl.models.policy.megatron_worker import MegatronPolicyWorker

    data = train_data()
    worker = MegatronPolicyWorker(lora_megatron(model_dir, tp=2))
    save("tp2_summary", [*astuple(worker.lora_summary()), worker.adapter_refits()])
    save("tp2_adapters_init", _stage_adapters(worker))
    save("tp2_trainable", sorted(n for n, p in worker.gpt.named_parameters() if p.requires_grad))
    save("tp2_optimizer_params", sum(len(g["params"]) for g in worker.optimizer.param_groups))
    save("tp2_nll", worker.train(shard(data, worker), NLLLoss()))
    save("tp2_stream", dict(worker.iter_hf_weights(torch.float32)))
    save("tp2_manifest", worker.weights_manifest(torch.float32))
    save("tp2_ref_logprobs", worker.get_reference_policy_logprobs(score_data()))
    save("tp2_logprobs_trained", worker.get_logprobs(score_data()))
    worker.export_hf(str(out_dir / "tp2_export"))
    worker.shutdown()

    worker = MegatronPolicyWorker(lora_megatron(model_dir, tp=2, sequence_parallel=True))
    save("sp2_nll", worker.train(shard(data, worker), NLLLoss()))
    worker.shutdown()

    # Two steps, an adapter-only checkpoint, a fresh worker resuming from it for the third step.
    worker = MegatronPolicyWorker(lora_megatron(model_dir, pp=2))
    save("pp2_adapters_init", _stage_adapters(worker))
    save("pp2_nll_first_two", worker.train(shard(data.slice(0, 2 * GLOBAL_BATCH), worker), NLLLoss()))
    worker.save_checkpoint(str(out_dir / "pp2_ckpt_weights"), str(out_dir / "pp2_ckpt_optim"))
    worker.shutdown()
    worker = MegatronPolicyWorker(
        lora_megatron(model_dir, pp=2),
        weights_path=str(out_dir / "pp2_ckpt_weights"),
        optimizer_path=str(out_dir / "pp2_ckpt_optim"),
    )
    save(
        "pp2_nll_resumed",
        worker.train(shard(data.slice(2 * GLOBAL_BATCH, 3 * GLOBAL_BATCH), worker), NLLLoss()),
    )
    save("pp2_stream", dict(worker.iter_hf_weights(torch.float32)))
    worker.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_dtensor_worker import build_tiny_model

    path = tmp_path_factory.mktemp("tiny_qwen2_lora")
    build_tiny_model(path, tie_word_embeddings=True)
    return path


@pytest.fixture(scope="module")
def results(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("megatron_lora_results")
    groups = [("megatron", 2, _megatron_scenarios), ("reference", 1, _reference_scenarios)]
    run_groups(groups, model_dir, out_dir, timeout_s=SPAWN_TIMEOUT_S)
    return out_dir


# ------------------------------------------------------------------------------------------------ tests
def test_adapters_start_as_the_dtensor_workers_and_only_they_train(results: Path) -> None:
    expected = load(results, "reference.adapters_init")
    assert len(expected) == 2 * len(ADAPTED) * 2
    for rank in range(2):
        tp2 = load(results, "megatron.tp2_adapters_init", rank)
        assert set(tp2) == set(expected)
        assert all(torch.equal(tp2[name], expected[name]) for name in expected)
    stages = [load(results, "megatron.pp2_adapters_init", rank) for rank in range(2)]
    assert not set(stages[0]) & set(stages[1]) and set(stages[0]) | set(stages[1]) == set(expected)
    assert all(torch.equal(stage[n], expected[n]) for stage in stages for n in stage)
    trainable = load(results, "megatron.tp2_trainable")
    assert len(trainable) == len(expected) and all(".lora." in name for name in trainable)
    assert load(results, "megatron.tp2_optimizer_params") == len(expected)


def test_lora_summary_counts_the_whole_model_as_the_dtensor_worker(results: Path) -> None:
    """Both backends report the same adapters (rank, layers, full parameter counts) for the start-up line; only
    the DTensor worker sends its adapters alone (Megatron folds them into every refit)."""
    *summary, adapter_refits = load(results, "reference.summary")
    assert adapter_refits is True and summary[0] == LORA_CFG["dim"]
    for rank in range(2):
        assert load(results, "megatron.tp2_summary", rank) == [*summary, False]


@pytest.mark.parametrize("scenario", ["tp2_nll", "sp2_nll", "pp2"])
def test_training_matches_one_process_dtensor_lora(results: Path, scenario: str) -> None:
    expected = load(results, "reference.nll")
    for rank in range(2):
        parts = ["pp2_nll_first_two", "pp2_nll_resumed"] if scenario == "pp2" else [scenario]
        outs = [load(results, f"megatron.{part}", rank) for part in parts]
        for key in ("loss", "grad_norm", "lr"):
            actual = torch.cat([torch.as_tensor(out[key]) for out in outs])
            assert_close(actual, torch.as_tensor(expected[key]))


def test_merged_refit_weights_match_the_dtensor_workers(results: Path, model_dir: Path) -> None:
    expected = load(results, "reference.stream")
    manifest = load(results, "megatron.tp2_manifest")
    stages = [load(results, "megatron.pp2_stream", rank) for rank in range(2)]
    for stream in (load(results, "megatron.tp2_stream"), {**stages[0], **stages[1]}):
        # The base model's names only: the adapters are folded into q_proj.weight and the others.
        assert set(stream) == set(manifest) == set(expected) - {"lm_head.weight"}
        for name, tensor in stream.items():
            # Adam turns gradient differences at float32 rounding level into update differences far below one
            # step's size (LR): an absolute tolerance of 1% of it.
            torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-5)
    # Training moved the merged weights away from the base ones.
    base = load_file(model_dir / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(expected["model.layers.0.self_attn.q_proj.weight"], base, rtol=1e-3, atol=1e-5)


def test_reference_policy_is_the_base_model(results: Path, model_dir: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert_close(
        load(results, "megatron.tp2_ref_logprobs")["reference_logprobs"],
        reference_logprobs(base, score_data()),
    )
    assert_close(
        load(results, "megatron.tp2_logprobs_trained")["logprobs"],
        load(results, "reference.logprobs_trained")["logprobs"],
        rtol=1e-4,
    )


def test_checkpoint_holds_the_adapters_only(results: Path, model_dir: Path) -> None:
    folder = results / "pp2_ckpt_weights"
    saved: dict[str, torch.Tensor] = {}
    for file in folder.glob("*.safetensors"):
        saved |= load_file(file)
    assert set(saved) == set(load(results, "reference.adapters_init"))
    metadata = json.loads((folder / LORA_METADATA_FILE).read_text())
    assert metadata["base_model"] == str(model_dir) and metadata["lora_cfg"]["dim"] == PEFT["dim"]


def test_export_is_merged_with_a_peft_adapter(results: Path) -> None:
    export = results / "tp2_export"
    exported = AutoModelForCausalLM.from_pretrained(export).eval()
    assert_close(
        reference_logprobs(exported, score_data()), load(results, "megatron.tp2_logprobs_trained")["logprobs"]
    )
    adapter = load_file(export / "lora_adapter" / PEFT_WEIGHTS_FILE)
    assert set(adapter) == {peft_name(name) for name in load(results, "reference.adapters_init")}
    config = json.loads((export / "lora_adapter" / PEFT_CONFIG_FILE).read_text())
    assert sorted(config["target_modules"]) == sorted(ADAPTED) and config["r"] == PEFT["dim"]
