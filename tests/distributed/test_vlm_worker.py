"""The DTensor worker on a vision-language model (the tiny Qwen2.5-VL, transformers' own class) over gloo.

Two ranks under FSDP2 (the language model sharded, the vision tower replicated) train on ``tiny_clevr`` rows,
one of them text-only so that one rank's micro-batch holds no image, against one rank doing the same
whole: losses and trained weights agree, with fixed-size and with token-budget (dynamic) micro-batches, and
with the language model split over two tensor-parallel ranks. Log-probs equal transformers' forward with the processor's inputs,
``freeze_config`` keeps the frozen sub-models bit for bit, and the export reloads with transformers' class
and processor. The second family, Qwen2-VL, scores, trains, freezes and exports the same way. Every group runs at
once (``rank_groups.run_groups``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_groups import SaveFn, load, run_groups
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

from nemo_rl.algorithms.loss_functions import NLLLoss
from nemo_rl.config.data import DataConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.collate_fn import make_sft_collate_fn
from nemo_rl.data.datasets import ProcessedDataset, load_dataset_splits
from nemo_rl.data.interfaces import TaskDataSpec
from nemo_rl.data.tiny_vlm import build_tiny_qwen2_vl, build_tiny_vlm
from nemo_rl.data.vlm import load_hf_processor, vlm_sft_processor
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.tokenizer import get_policy_tokenizer

NUM_ROWS = 8
"""Two steps of 4 rows; row 5 (rank 1's second row of step 2 under dp=2 with mbs 1) is text-only."""
TEXT_ROW = 5
MAX_LEN = 96
TIMEOUT_S = 300.0


def policy_cfg(
    model_dir: Path, dynamic_batching: dict[str, Any] | None = None, **dtensor: Any
) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "train_global_batch_size": 4,
            "train_micro_batch_size": 1,
            "max_total_sequence_length": MAX_LEN,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 3e-3}},
            "dtensor_cfg": dtensor,
            "dynamic_batching": dynamic_batching or {},
        }
    )


def vlm_batch(model_dir: Path) -> BatchedDataDict[Any]:
    """``NUM_ROWS`` tiny_clevr conversations through the model's processor, row ``TEXT_ROW`` without its image."""
    policy = PolicyConfig(model_name=str(model_dir))
    data_cfg = DataConfig(
        dataset_name="tiny_clevr", num_train_samples=NUM_ROWS, num_val_samples=0, add_generation_prompt=False
    )
    records = list(load_dataset_splits(data_cfg).train)
    user = records[TEXT_ROW]["messages"][0]
    user["content"] = [part for part in user["content"] if part["type"] == "text"]
    tokenizer = get_policy_tokenizer(policy)
    processor = vlm_sft_processor(data_cfg, load_hf_processor(policy), "tiny_clevr")
    spec = TaskDataSpec.from_config(data_cfg, task_name="sft")
    dataset = ProcessedDataset(records, processor, spec, tokenizer, MAX_LEN)  # type: ignore[arg-type]
    return make_sft_collate_fn(tokenizer, MAX_LEN)([dataset[i] for i in range(NUM_ROWS)])


def _full_state(worker: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True))
    return {name: value.detach().clone() for name, value in state.items()}


def _shard(data: BatchedDataDict[Any], worker: Any) -> BatchedDataDict[Any]:
    return data.shard_by_batch_size(worker.dp_size, batch_size=4)[worker.dp_rank]


def _scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    data = vlm_batch(model_dir)
    worker = DTensorPolicyWorker(policy_cfg(model_dir))
    save("logprobs", worker.get_logprobs(data)["logprobs"])
    save("train", worker.train(_shard(data, worker), NLLLoss()))
    save("trained", _full_state(worker))
    if worker.dp_size > 1:
        worker.export_hf(str(out_dir / "export"))
    worker.shutdown()

    # Dynamic batching groups whole rows (their images with them) and trims padding: the same step.
    dynamic = {"enabled": True, "train_mb_tokens": 2 * MAX_LEN, "logprob_mb_tokens": 2 * MAX_LEN}
    worker = DTensorPolicyWorker(policy_cfg(model_dir, dynamic_batching=dynamic))
    save("dynamic_train", worker.train(_shard(data, worker), NLLLoss()))
    worker.shutdown()

    freeze = {"freeze_vision_model": True, "freeze_vision_projection": True}
    worker = DTensorPolicyWorker(policy_cfg(model_dir, freeze_config=freeze))
    save("frozen_trainable", [name for name, p in worker.model.named_parameters() if p.requires_grad])
    worker.train(_shard(data, worker), NLLLoss())
    save("frozen_trained", _full_state(worker))
    worker.shutdown()


def _tp_scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    """Tensor parallelism over the language model (the vision tower whole on both ranks)."""
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    data = vlm_batch(model_dir)
    worker = DTensorPolicyWorker(policy_cfg(model_dir, tensor_parallel_size=2))
    save("logprobs", worker.get_logprobs(data)["logprobs"])
    save("train", worker.train(data, NLLLoss()))
    save("trained", _full_state(worker))
    worker.shutdown()


def _qwen2_vl_scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    """The second family, Qwen2-VL, under FSDP2: log-probs, one step, an export."""
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    qwen2_vl = model_dir / QWEN2_VL
    data = vlm_batch(qwen2_vl)
    worker = DTensorPolicyWorker(policy_cfg(qwen2_vl, freeze_config={"freeze_vision_model": True}))
    save("logprobs", worker.get_logprobs(data)["logprobs"])
    save("train", worker.train(_shard(data, worker), NLLLoss()))
    worker.export_hf(str(out_dir / "qwen2_vl_export"))
    worker.shutdown()


QWEN2_VL = "qwen2_vl"
"""Where, inside the tiny Qwen2.5-VL's folder, the tiny Qwen2-VL is built."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen25vl")
    build_tiny_vlm(path, seed=0)
    build_tiny_qwen2_vl(path / QWEN2_VL, seed=0)
    return path


@pytest.fixture(scope="module")
def results(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("vlm_results")
    groups = [
        ("dp2", 2, _scenarios),
        ("one", 1, _scenarios),
        ("tp2", 2, _tp_scenarios),
        ("qwen2vl", 2, _qwen2_vl_scenarios),
    ]
    run_groups(groups, model_dir, out_dir, timeout_s=TIMEOUT_S)
    return out_dir


def hf_logprobs(model: Any, data: BatchedDataDict[Any]) -> torch.Tensor:
    """Token log-probs of each row alone through transformers' forward (0 at position 0 and padding)."""
    out = torch.zeros(data["input_ids"].shape)
    for row in range(data.size):
        length = int(data["input_lengths"][row])
        ids = data["input_ids"][row : row + 1, :length]
        images = {}
        if data["pixel_values"][row] is not None:
            # The processor's token types (tests/unit/test_vlm_data.py checks the worker's equal them).
            images = {
                "pixel_values": data["pixel_values"][row],
                "image_grid_thw": data["image_grid_thw"][row],
                "mm_token_type_ids": (ids == model.config.image_token_id).int(),
            }
        with torch.no_grad():
            logits = model(input_ids=ids, **images).logits.float()
        lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        out[row, 1:length] = lp
    return out


def test_logprobs_equal_transformers_forward_with_images(results: Path, model_dir: Path) -> None:
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir)
    expected = hf_logprobs(model, vlm_batch(model_dir))
    for group in ("dp2", "one", "tp2"):
        torch.testing.assert_close(load(results, f"{group}.logprobs"), expected, rtol=1e-5, atol=1e-5)


def test_fsdp_training_with_a_replicated_vision_tower_equals_one_rank(results: Path) -> None:
    dp2, one = load(results, "dp2.train"), load(results, "one.train")
    torch.testing.assert_close(dp2["loss"], one["loss"], rtol=1e-5, atol=1e-6)
    assert float(dp2["loss"][1]) < float(dp2["loss"][0])
    trained_dp2, trained_one = load(results, "dp2.trained"), load(results, "one.trained")
    assert trained_dp2.keys() == trained_one.keys()
    for name, value in trained_one.items():
        torch.testing.assert_close(trained_dp2[name], value, rtol=1e-4, atol=1e-6, msg=name)
    # Both ranks hold the same replicated vision tower after the step.
    rank1 = load(results, "dp2.trained", rank=1)
    assert all(torch.equal(rank1[n], v) for n, v in trained_dp2.items() if n.startswith("model.visual."))


def test_tensor_parallel_language_model_trains_like_one_rank(results: Path) -> None:
    torch.testing.assert_close(
        load(results, "tp2.train")["loss"], load(results, "one.train")["loss"], rtol=1e-5, atol=1e-6
    )
    trained_tp, trained_one = load(results, "tp2.trained"), load(results, "one.trained")
    # TP sums partial products in another order; Adam turns those roundings of near-zero gradients into
    # updates of up to 3e-5 here (the steps themselves move weights by up to 6e-3).
    for name, value in trained_one.items():
        torch.testing.assert_close(trained_tp[name], value, rtol=1e-4, atol=1e-4, msg=name)


def test_dynamic_batching_of_image_rows_takes_the_same_steps(results: Path) -> None:
    expected = load(results, "one.train")["loss"]
    for group in ("dp2", "one"):
        torch.testing.assert_close(
            load(results, f"{group}.dynamic_train")["loss"], expected, rtol=1e-5, atol=1e-6
        )


def test_freeze_config_keeps_the_vision_tower_and_projection(results: Path, model_dir: Path) -> None:
    initial = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).state_dict()
    trainable = load(results, "dp2.frozen_trainable")
    assert trainable and not [n for n in trainable if n.startswith("model.visual.")]
    trained = load(results, "dp2.frozen_trained")
    for name, value in trained.items():
        if name.startswith("model.visual."):
            assert torch.equal(value, initial[name]), name
    assert not torch.equal(
        trained["model.language_model.layers.0.mlp.up_proj.weight"],
        initial["model.language_model.layers.0.mlp.up_proj.weight"],
    )


def test_export_loads_with_transformers_class_and_processor(results: Path, model_dir: Path) -> None:
    export_dir = results / "export"
    exported = Qwen2_5_VLForConditionalGeneration.from_pretrained(export_dir)
    config = json.loads((export_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    trained = load(results, "dp2.trained")
    state = exported.state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(state[name], value, msg=name)
    processor = AutoProcessor.from_pretrained(export_dir)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert processor.image_processor.size == AutoProcessor.from_pretrained(model_dir).image_processor.size


def test_the_second_family_qwen2_vl_scores_trains_freezes_and_exports(results: Path, model_dir: Path) -> None:
    initial = Qwen2VLForConditionalGeneration.from_pretrained(model_dir / QWEN2_VL)
    expected = hf_logprobs(initial, vlm_batch(model_dir / QWEN2_VL))
    torch.testing.assert_close(load(results, "qwen2vl.logprobs"), expected, rtol=1e-5, atol=1e-5)
    losses = load(results, "qwen2vl.train")["loss"]
    assert float(losses[1]) < float(losses[0])
    exported = Qwen2VLForConditionalGeneration.from_pretrained(results / "qwen2_vl_export").state_dict()
    start = initial.state_dict()
    tower = [n for n in start if n.startswith("model.visual.") and not n.startswith("model.visual.merger.")]
    assert tower and all(torch.equal(exported[n], start[n]) for n in tower)
    assert not torch.equal(
        exported["model.visual.merger.mlp.0.weight"], start["model.visual.merger.mlp.0.weight"]
    )
