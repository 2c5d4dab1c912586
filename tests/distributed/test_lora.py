"""LoRA on the DTensor policy worker over gloo, against PEFT on the same Hugging Face model in one process.

FSDP (dp=2), tensor parallelism (tp=2) and the replicated mode train the same adapters from the same initial
values as ``peft.get_peft_model``; DPO uses the frozen base model as its reference policy; a checkpoint holds
the adapters only and resumes bit for bit; the export is a merged Hugging Face folder plus a PEFT adapter that
``peft.PeftModel.from_pretrained`` loads. One pair of rank processes runs every scenario
(``rank_groups.run_groups``); the tiny model, data and losses are ``test_dtensor_worker.py``'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_groups import SaveFn, load, run_groups
from test_dtensor_worker import (
    DPO_CFG,
    GLOBAL_BATCH,
    NUM_STEPS,
    WORLD_SIZE,
    TinyNLLLoss,
    _optimizer_and_schedule,
    _shard,
    build_tiny_model,
    make_batch,
    policy_cfg,
    preference_data,
    reference_logprobs,
    train_data,
    with_reference_logprobs,
)
from transformers import AutoConfig, AutoModelForCausalLM

from nemo_rl.algorithms.loss_functions import DPOLossFn
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

peft = pytest.importorskip("peft")

LORA = {"enabled": True, "dim": 4, "alpha": 8, "match_all_linear": True}
SPAWN_TIMEOUT_S = 240.0


def lora_policy(model_dir: Path, dtensor: dict[str, Any] | None = None, **overrides: Any) -> Any:
    return policy_cfg(model_dir, {"lora_cfg": LORA} | (dtensor or {}), **overrides)


# -------------------------------------------------------------------------------- spawned scenarios
def _full_adapters(worker: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from nemo_rl.models.lora import is_adapter_name

    state = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True))
    return {name: value.clone() for name, value in state.items() if is_adapter_name(name)}


def _scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    rank = int(os.environ["RANK"])
    data, score_data, loss_fn = train_data(), make_batch(seed=2, num_rows=6), TinyNLLLoss()
    for name, dtensor in (
        ("fsdp", {}),
        ("tp2", {"tensor_parallel_size": 2}),
        ("replicate", {"data_parallel_mode": "replicate"}),
    ):
        worker = DTensorPolicyWorker(lora_policy(model_dir, dtensor))
        save(f"{name}_adapters_init", _full_adapters(worker))
        save(f"{name}_trainable", [n for n, p in worker.model.named_parameters() if p.requires_grad])
        save(f"{name}_optimizer_params", sum(len(g["params"]) for g in worker.optimizer.param_groups))
        save(f"{name}_ref_logprobs", worker.get_reference_policy_logprobs(score_data))
        save(f"{name}_train", worker.train(_shard(data, worker.dp_rank, worker.dp_size), loss_fn))
        save(f"{name}_logprobs_trained", worker.get_logprobs(score_data))
        save(f"{name}_ref_logprobs_trained", worker.get_reference_policy_logprobs(score_data))
        if name == "fsdp":
            save("fsdp_refit", dict(worker.iter_hf_weights(torch.float32)))
            worker.export_hf(str(out_dir / "export"))
        worker.shutdown()

    # DPO: the reference log-probs come from the same worker with its adapters off.
    pairs = preference_data()
    worker = DTensorPolicyWorker(lora_policy(model_dir))
    shard = pairs.shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH, group_size=2)[worker.dp_rank]
    shard["reference_policy_logprobs"] = worker.get_reference_policy_logprobs(shard)["reference_logprobs"]
    save("dpo_train", worker.train(shard, DPOLossFn(DPO_CFG), mbs=2))
    worker.shutdown()

    # Resume: two steps, an adapter-only checkpoint, then a fresh worker takes step three.
    def steps(first: int, last: int) -> BatchedDataDict[Any]:
        return _shard(data.slice(first * GLOBAL_BATCH, last * GLOBAL_BATCH), rank, WORLD_SIZE)

    worker = DTensorPolicyWorker(lora_policy(model_dir))
    worker.train(steps(0, 2), loss_fn)
    save("ckpt_logprobs", worker.get_logprobs(score_data))
    worker.save_checkpoint(str(out_dir / "ckpt_weights"), str(out_dir / "ckpt_optim"))
    worker.shutdown()
    worker = DTensorPolicyWorker(
        lora_policy(model_dir),
        weights_path=str(out_dir / "ckpt_weights"),
        optimizer_path=str(out_dir / "ckpt_optim"),
    )
    save("resumed_train", worker.train(steps(2, NUM_STEPS), loss_fn))
    worker.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen2_lora")
    build_tiny_model(path, tie_word_embeddings=True)
    return path


@pytest.fixture(scope="module")
def results(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("lora_results")
    run_groups([("lora", WORLD_SIZE, _scenarios)], model_dir, out_dir, timeout_s=SPAWN_TIMEOUT_S)
    return out_dir


# ------------------------------------------------------------------------------------ PEFT reference
def base_model(model_dir: Path) -> torch.nn.Module:
    # Built from the config (not from_pretrained) so the rotary buffers are computed, as the worker does.
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    return model


def peft_model(model_dir: Path, adapters: dict[str, torch.Tensor]) -> Any:
    """PEFT's LoRA (r=4, alpha=8 on every linear layer) on the base model, with the worker's initial A and B."""
    targets = sorted({name.rsplit(".", 2)[-2] for name in adapters})
    config = peft.LoraConfig(
        r=LORA["dim"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=targets
    )
    model = peft.get_peft_model(base_model(model_dir), config)
    with torch.no_grad():
        for name, value in adapters.items():
            module, _, half = name.rpartition(".")
            getattr(model.base_model.model.get_submodule(module), half)["default"].weight.copy_(value)
    return model


def peft_training(model: Any, batches: list[BatchedDataDict[Any]], loss_fn: Any, per_sequence: bool) -> dict:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = _optimizer_and_schedule(model)
    losses, grad_norms = [], []
    for batch in batches:
        optimizer.zero_grad()
        mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
        seqs, toks = (
            (batch["sample_mask"].sum(), torch.tensor(0.0))
            if per_sequence
            else (torch.tensor(0.0), mask.sum())
        )
        loss, _ = loss_fn(model(input_ids=batch["input_ids"]).logits, batch, seqs, toks)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, 0.05)))
        losses.append(float(loss.detach()))
        optimizer.step()
        scheduler.step()
    return {"loss": torch.tensor(losses), "grad_norm": torch.tensor(grad_norms), "model": model}


@pytest.fixture(scope="module")
def peft_sft(results: Path, model_dir: Path) -> dict[str, Any]:
    data = train_data()
    batches = [data.slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH) for s in range(NUM_STEPS)]
    model = peft_model(model_dir, load(results, "lora.fsdp_adapters_init"))
    return peft_training(model, batches, TinyNLLLoss(), per_sequence=False)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", ["fsdp", "tp2", "replicate"])
def test_sft_steps_match_peft(results: Path, peft_sft: dict[str, Any], layout: str) -> None:
    torch.testing.assert_close(
        load(results, f"lora.{layout}_adapters_init"), load(results, "lora.fsdp_adapters_init")
    )
    for rank in range(WORLD_SIZE):
        out = load(results, f"lora.{layout}_train", rank)
        assert_close(out["loss"], peft_sft["loss"])
        assert_close(out["grad_norm"], peft_sft["grad_norm"])
        assert out["grad_norm"][0] > 0.05, "clipping should be active in this test"


def test_only_adapters_train(results: Path) -> None:
    trainable = load(results, "lora.fsdp_trainable")
    assert trainable and all(name.endswith((".lora_A", ".lora_B")) for name in trainable)
    # q, k, v, o, gate, up and down in each of the 2 layers, an A and a B each; not the tied LM head.
    assert len(trainable) == 2 * 7 * 2
    for layout in ("fsdp", "tp2", "replicate"):
        assert load(results, f"lora.{layout}_optimizer_params") == len(trainable)


def test_reference_policy_is_the_base_model(results: Path, model_dir: Path) -> None:
    expected = reference_logprobs(base_model(model_dir), make_batch(seed=2, num_rows=6))
    for layout in ("fsdp", "tp2", "replicate"):
        # Before training (B = 0) and after it, the adapters switched off give the frozen base model.
        for when in ("", "_trained"):
            assert_close(load(results, f"lora.{layout}_ref_logprobs{when}")["reference_logprobs"], expected)


def test_dpo_with_the_base_model_as_reference_matches_peft(results: Path, model_dir: Path) -> None:
    pairs = preference_data()
    reference_lp = reference_logprobs(base_model(model_dir), pairs)
    batches = [
        with_reference_logprobs(pairs, reference_lp).slice(s * GLOBAL_BATCH, (s + 1) * GLOBAL_BATCH)
        for s in range(NUM_STEPS)
    ]
    model = peft_model(model_dir, load(results, "lora.fsdp_adapters_init"))
    expected = peft_training(model, batches, DPOLossFn(DPO_CFG), per_sequence=True)
    out = load(results, "lora.dpo_train")
    assert_close(out["loss"], expected["loss"])
    assert_close(out["grad_norm"], expected["grad_norm"])


def test_adapter_checkpoint_resumes_bit_for_bit(results: Path) -> None:
    uninterrupted = load(results, "lora.fsdp_train")
    for rank in range(WORLD_SIZE):
        resumed = load(results, "lora.resumed_train", rank)
        assert resumed["loss"].tolist() == uninterrupted["loss"][2:].tolist()
        assert resumed["grad_norm"].tolist() == uninterrupted["grad_norm"][2:].tolist()


def test_adapter_checkpoint_holds_only_adapters(results: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from nemo_rl.models.lora import read_lora_metadata

    keys = set(dcp.FileSystemReader(str(results / "ckpt_weights")).read_metadata().state_dict_metadata)
    assert keys and all(key.endswith((".lora_A", ".lora_B")) for key in keys)
    metadata = read_lora_metadata(results / "ckpt_weights")
    assert metadata is not None and metadata["lora_cfg"]["dim"] == LORA["dim"]


def test_refit_and_exports_hold_the_trained_model(
    results: Path, model_dir: Path, peft_sft: dict[str, Any]
) -> None:
    from nemo_rl.models.policy.hf_io import LORA_ADAPTER_SUBDIR

    score_data = make_batch(seed=2, num_rows=6)
    trained = load(results, "lora.fsdp_logprobs_trained")["logprobs"]
    assert_close(trained, reference_logprobs(peft_sft["model"], score_data))
    # A full-scope refit sends the base weights under their own names and the adapters unmerged (the engine
    # merges them); folded together they are the trained model.
    from nemo_rl.models.lora import merged_weights

    refit = load(results, "lora.fsdp_refit")
    adapters = {name for name in refit if name.endswith((".lora_A", ".lora_B"))}
    assert adapters == set(load(results, "lora.fsdp_adapters_init"))
    merged = base_model(model_dir)
    assert {name for name, _ in merged.named_parameters()} <= set(refit)  # the tied LM head is listed once
    layers = {name.rpartition(".")[0] for name in adapters}
    merged.load_state_dict(
        dict(merged_weights(refit.items(), LORA["alpha"] / LORA["dim"], layers)), strict=False
    )
    assert_close(reference_logprobs(merged, score_data), trained)
    # The merged Hugging Face export, and the PEFT adapter on the base model, give the trained log-probs.
    export = results / "export"
    assert_close(reference_logprobs(AutoModelForCausalLM.from_pretrained(export), score_data), trained)
    adapted = peft.PeftModel.from_pretrained(base_model(model_dir), str(export / LORA_ADAPTER_SUBDIR))
    assert_close(reference_logprobs(adapted, score_data), trained)


def test_converter_writes_the_checkpoint_merged_and_as_a_peft_adapter(
    results: Path, model_dir: Path, tmp_path: Path
) -> None:
    from nemo_rl.models.policy.dcp_io import TrainingCheckpoint, convert_dcp_to_hf, convert_dcp_to_peft

    checkpoint = TrainingCheckpoint(weights_dir=results / "ckpt_weights", policy=lora_policy(model_dir))
    score_data = make_batch(seed=2, num_rows=6)
    expected = load(results, "lora.ckpt_logprobs")["logprobs"]
    merged = convert_dcp_to_hf(checkpoint, tmp_path / "merged")
    assert_close(reference_logprobs(AutoModelForCausalLM.from_pretrained(merged), score_data), expected)
    adapter = convert_dcp_to_peft(checkpoint, tmp_path / "adapter")
    adapted = peft.PeftModel.from_pretrained(base_model(model_dir), str(adapter))
    assert_close(reference_logprobs(adapted, score_data), expected)
