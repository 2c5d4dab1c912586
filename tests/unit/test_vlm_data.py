"""Vision-language data: the tiny_clevr scenes, rows with images through the model's own processor, the checks
that refuse a bad image with one line naming the row and the file (exit 2 in the script), and the settings a
vision-language policy refuses. The model is the checked-in tiny Qwen2.5-VL (examples/assets)."""

from __future__ import annotations

import json
import pathlib
import runpy
import sys
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from nemo_rl.config.data import DataConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.collate_fn import make_sft_collate_fn
from nemo_rl.data.datasets import load_dataset_splits, setup_sft_data
from nemo_rl.data.datasets.formats import clevr_cogent_converter
from nemo_rl.data.images import BadImageError, load_image
from nemo_rl.data.tiny_clevr import tiny_clevr_splits
from nemo_rl.data.tiny_vlm import TINY_VLM_MAX_PIXELS
from nemo_rl.data.vlm import load_hf_processor, setup_vlm_sft_data
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.vllm.engine_setup import installed_vllm_build
from nemo_rl.models.tokenizer import get_policy_tokenizer
from nemo_rl.models.vlm import check_vlm_policy, frozen_submodel_names, image_forward_inputs

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "assets" / "tiny_qwen25vl_init"
QUESTION = [{"type": "text", "text": "How many?"}]


@pytest.fixture(scope="module")
def policy() -> PolicyConfig:
    return PolicyConfig(model_name=str(MODEL))


@pytest.fixture(scope="module")
def hf_processor(policy: PolicyConfig) -> Any:
    return load_hf_processor(policy)


def _chat_rows(images: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": image}, *QUESTION]},
                {"role": "assistant", "content": "\\boxed{1}"},
            ]
        }
        for image in images
    ]


def _write_jsonl(path: pathlib.Path, rows: list[dict[str, Any]]) -> pathlib.Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _chat_cfg(path: pathlib.Path, **extra: Any) -> DataConfig:
    return DataConfig(
        dataset_name="openai_format",
        processor="vlm_hf_data_processor",
        train_data_path=str(path),
        val_fraction=0.0,
        add_generation_prompt=False,
        **extra,
    )


def test_tiny_clevr_is_deterministic_and_holds_out_its_validation_scenes() -> None:
    train, val = tiny_clevr_splits(8, 4, seed=3, image_size=84, max_objects=5)
    again, _ = tiny_clevr_splits(20, 4, seed=3, image_size=84, max_objects=5)
    for i in range(8):
        a, b = train[i]["messages"][0]["content"][0]["image"], again[i]["messages"][0]["content"][0]["image"]
        assert np.array_equal(np.asarray(a), np.asarray(b))
    answers = {row["expected_answer"] for row in [*train, *val]}
    assert answers <= {"1", "2", "3", "4", "5"} and len(answers) > 1
    first_val = np.asarray(val[0]["messages"][0]["content"][0]["image"])
    assert not any(
        np.array_equal(first_val, np.asarray(r["messages"][0]["content"][0]["image"])) for r in train
    )


def test_samples_hold_exactly_the_processors_tokens_and_patches(
    policy: PolicyConfig, hf_processor: Any
) -> None:
    cfg = DataConfig(
        dataset_name="tiny_clevr", num_train_samples=4, num_val_samples=2, add_generation_prompt=False
    )
    tokenizer = get_policy_tokenizer(policy)
    train, val = setup_vlm_sft_data(cfg, tokenizer, hf_processor, max_total_sequence_length=96)
    assert val is not None and len(train) == 4
    record = train.records[1]
    text = hf_processor.apply_chat_template(record["messages"], tokenize=False)
    image = record["messages"][0]["content"][0]["image"]
    expected = hf_processor(text=[text], images=[image], return_tensors="pt")
    sample = train[1]
    ids = torch.cat([m["token_ids"] for m in sample["message_log"]])
    assert ids.tolist() == expected["input_ids"][0].tolist()
    assert torch.equal(sample["pixel_values"], expected["pixel_values"])
    assert torch.equal(sample["image_grid_thw"], expected["image_grid_thw"])
    # The worker's forward gives the model the processor's token types (multimodal RoPE needs them).
    batch = BatchedDataDict(
        input_ids=ids[None], pixel_values=[sample["pixel_values"]], image_grid_thw=[sample["image_grid_thw"]]
    )
    inputs = image_forward_inputs(batch, torch.device("cpu"), hf_processor.image_token_id)
    assert torch.equal(inputs["mm_token_type_ids"], expected["mm_token_type_ids"].int())


def test_batches_keep_each_rows_images_and_a_text_row_has_none(
    tmp_path: pathlib.Path, policy: PolicyConfig, hf_processor: Any
) -> None:
    red, blue = Image.new("RGB", (60, 60), "red"), Image.new("RGB", (100, 70), "blue")
    red.save(tmp_path / "red.png")
    blue.save(tmp_path / "blue.png")
    rows = _chat_rows([str(tmp_path / "red.png"), str(tmp_path / "blue.png")])
    rows.append({"messages": [{"role": "user", "content": "1+0?"}, {"role": "assistant", "content": "1"}]})
    tokenizer = get_policy_tokenizer(policy)
    train, _ = setup_vlm_sft_data(
        _chat_cfg(_write_jsonl(tmp_path / "chat.jsonl", rows)),
        tokenizer,
        hf_processor,
        max_total_sequence_length=96,
    )
    batch = make_sft_collate_fn(tokenizer, 96)([train[i] for i in range(3)])
    assert batch["pixel_values"][2] is None and batch["image_grid_thw"][2] is None
    swapped = BatchedDataDict(batch).select_indices([1, 0])
    inputs = image_forward_inputs(swapped, torch.device("cpu"), hf_processor.image_token_id)
    assert torch.equal(
        inputs["pixel_values"], torch.cat([batch["pixel_values"][1], batch["pixel_values"][0]])
    )
    assert inputs["image_grid_thw"].tolist() == [
        *batch["image_grid_thw"][1].tolist(),
        *batch["image_grid_thw"][0].tolist(),
    ]
    text_only = BatchedDataDict(batch).select_indices([2])
    assert image_forward_inputs(text_only, torch.device("cpu"), hf_processor.image_token_id) == {}


def _bad_images(tmp_path: pathlib.Path) -> list[tuple[str, Any, str]]:
    (tmp_path / "notes.png").write_text("not a picture")
    Image.new("I;16", (40, 40)).save(tmp_path / "depth.png")
    Image.new("RGB", (200, 200)).save(tmp_path / "big.png")
    return [
        ("missing", str(tmp_path / "gone.png"), "image file {dir}/gone.png does not exist"),
        ("not an image", str(tmp_path / "notes.png"), "{dir}/notes.png is not an image PIL can read"),
        ("wrong mode", str(tmp_path / "depth.png"), "image {dir}/depth.png has mode 'I;16'"),
        (
            "too large",
            str(tmp_path / "big.png"),
            f"200x200 = 40000 pixels, more than the {TINY_VLM_MAX_PIXELS}",
        ),
    ]


def test_every_bad_image_is_refused_at_setup_with_one_line_naming_row_and_file(
    tmp_path: pathlib.Path, policy: PolicyConfig, hf_processor: Any
) -> None:
    tokenizer = get_policy_tokenizer(policy)
    Image.new("RGB", (56, 56)).save(tmp_path / "ok.png")
    for case, value, message in _bad_images(tmp_path):
        path = _write_jsonl(tmp_path / f"{case}.jsonl", _chat_rows([str(tmp_path / "ok.png"), value]))
        with pytest.raises(BadImageError) as err:
            setup_vlm_sft_data(_chat_cfg(path), tokenizer, hf_processor, max_total_sequence_length=96)
        line = str(err.value)
        assert "\n" not in line and line.startswith(f"{path}: row 1: "), line
        assert message.format(dir=tmp_path) in line, line


def test_images_in_memory_and_as_datasets_features_load(tmp_path: pathlib.Path) -> None:
    image = Image.new("RGBA", (30, 20), (1, 2, 3, 255))
    image.save(tmp_path / "a.png")
    data = (tmp_path / "a.png").read_bytes()
    for value in (
        image,
        data,
        {"bytes": data, "path": None},
        {"bytes": None, "path": str(tmp_path / "a.png")},
    ):
        loaded = load_image(value, where="row 0", max_pixels=1000)
        assert loaded.mode == "RGB" and loaded.size == (30, 20)
    with pytest.raises(BadImageError, match=r"^row 0: 3 bytes of image data is not an image PIL can read"):
        load_image(b"abc", where="row 0", max_pixels=1000)
    with pytest.raises(BadImageError, match=r"downscale it or raise data\.max_image_pixels"):
        load_image(image, where="row 0", max_pixels=100)


def test_the_run_script_exits_2_with_one_line_on_a_bad_image(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import nemo_rl.distributed.ray_start as ray_start

    path = _write_jsonl(tmp_path / "chat.jsonl", _chat_rows([str(tmp_path / "gone.png")]))
    monkeypatch.setattr(ray_start, "start_ray_in_background", lambda cluster_cfg=None: None)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "run_vlm_sft.py",
            "data.dataset_name=openai_format",
            f"+data.train_data_path={path}",
            "data.val_fraction=0",
            f"logger.log_dir={tmp_path / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
    )
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "examples" / "run_vlm_sft.py"), run_name="__main__")
    stderr = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(stderr.splitlines()) == 1, stderr
    assert f"{path}: row 0: image file {tmp_path}/gone.png does not exist" in stderr


def test_text_setups_refuse_images_and_clevr_cogent_rows_convert() -> None:
    with pytest.raises(UserError, match=r"examples/run_vlm_sft\.py"):
        setup_sft_data(DataConfig(dataset_name="tiny_clevr"), None, max_total_sequence_length=64)  # type: ignore[arg-type]
    image = Image.new("RGB", (8, 8))
    row = {"image": image, "problem": "How many?", "solution": "<think>...</think> <answer> 3 </answer>"}
    record = clevr_cogent_converter("clevr")(row, 0)
    assert record["expected_answer"] == "3"
    assert record["messages"][0]["content"][0] == {"type": "image", "image": image}  # type: ignore[index]
    assert DataConfig(dataset_name="tiny_clevr", num_train_samples=2, num_val_samples=0).multimodal
    assert load_dataset_splits(DataConfig(dataset_name="tiny_clevr", num_val_samples=0)).validation is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"dtensor_cfg": {"tensor_parallel_size": 2, "sequence_parallel": True}},
            "set policy.dtensor_cfg.sequence_parallel=false",
        ),
        ({"sequence_packing": {"enabled": True}}, "set policy.sequence_packing.enabled=false"),
        ({"shared_prefix": {"enabled": True}}, "set policy.shared_prefix.enabled=false"),
        ({"reward_model_cfg": {"enabled": True}}, "set policy.reward_model_cfg.enabled=false"),
        (
            {"dtensor_cfg": {"enabled": False}, "megatron_cfg": {"enabled": True}, "optimizer": None},
            "the Megatron backend builds text models only",
        ),
    ],
)
def test_a_vision_language_policy_refuses_what_it_cannot_run(overrides: dict[str, Any], message: str) -> None:
    from nemo_rl.models.hf_config import load_hf_config

    cfg = PolicyConfig.model_validate({"model_name": str(MODEL), **overrides})
    with pytest.raises(UserError, match=message) as err:
        check_vlm_policy(cfg, load_hf_config(str(MODEL), trust_remote_code=False, overrides={}))
    assert "\n" not in str(err.value)


def test_freeze_config_names_the_sub_models_and_a_text_model_refuses_it() -> None:
    from nemo_rl.config.dtensor import VisionFreezeConfig
    from nemo_rl.models.hf_config import load_hf_config

    names = [
        "model.visual.blocks.0.attn.qkv.weight",
        "model.visual.merger.mlp.0.weight",
        "model.language_model.norm.weight",
        "lm_head.weight",
    ]
    assert frozen_submodel_names(names, VisionFreezeConfig(freeze_vision_model=True)) == names[:1]
    assert frozen_submodel_names(names, VisionFreezeConfig(freeze_vision_projection=True)) == names[1:2]
    assert frozen_submodel_names(names, VisionFreezeConfig(freeze_language_model=True)) == names[2:]
    text_model = ROOT / "examples" / "assets" / "tiny_qwen2_init"
    cfg = PolicyConfig.model_validate(
        {"model_name": str(text_model), "dtensor_cfg": {"freeze_config": {"freeze_vision_model": True}}}
    )
    with pytest.raises(UserError, match="freeze_vision_model=true needs a vision-language model"):
        check_vlm_policy(cfg, load_hf_config(str(text_model), trust_remote_code=False, overrides={}))


def test_both_generation_backends_accept_a_vision_language_policy() -> None:
    from nemo_rl.models.generation.factory import check_backend_available

    check_backend_available(PolicyConfig(model_name=str(MODEL)), cluster_has_gpus=False)
    vllm = PolicyConfig.model_validate({"model_name": str(MODEL), "generation": {"backend": "vllm"}})
    if installed_vllm_build() == "cpu":
        check_backend_available(vllm, cluster_has_gpus=False)
