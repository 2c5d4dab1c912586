"""GRPO on images, the parts that need no workers: prompts with images through the model's own processor (and
blanked), per-row images through batches and groups, the counting verifier and NeMo RL's reward functions and
environment sections, the scripts' one-line refusals, and NeMo RL's ``vlm_grpo_3B.yaml`` under ``--dry-run``.
The model is the checked-in tiny Qwen2.5-VL (examples/assets)."""

from __future__ import annotations

import json
import pathlib
import runpy
import sys
from typing import Any

import pytest
import torch
from PIL import Image

from nemo_rl.config import ConfigError, load_and_validate
from nemo_rl.config.data import DataConfig
from nemo_rl.config.env import EnvConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.config.vlm_env import VlmEnvConfig, vlm_env_config
from nemo_rl.data.collate_fn import repeat_prompts, rl_collate_fn
from nemo_rl.data.datasets import setup_rl_data
from nemo_rl.data.vlm import load_hf_processor
from nemo_rl.data.vlm_prompts import BLANK_COLOUR, setup_vlm_rl_data
from nemo_rl.environments.vlm_environment import VlmEnvironment
from nemo_rl.environments.vlm_rewards import (
    CombinedReward,
    bbox_giou_reward,
    boxed_integer_reward,
    exact_alnum_reward,
    format_reward,
)
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "assets" / "tiny_qwen25vl_init"
NEMO_RL_RECIPE = ROOT / "tests" / "data" / "nemo_rl_recipes" / "main" / "vlm_grpo_3B.yaml"


@pytest.fixture(scope="module")
def policy() -> PolicyConfig:
    return PolicyConfig(model_name=str(MODEL))


@pytest.fixture(scope="module")
def hf_processor(policy: PolicyConfig) -> Any:
    return load_hf_processor(policy)


def _tiny_clevr(**extra: Any) -> DataConfig:
    return DataConfig(dataset_name="tiny_clevr", num_train_samples=4, num_val_samples=2, **extra)


def test_prompts_hold_the_processors_tokens_up_to_the_generation_prompt(
    policy: PolicyConfig, hf_processor: Any
) -> None:
    tokenizer = get_policy_tokenizer(policy)
    train, val = setup_vlm_rl_data(_tiny_clevr(), tokenizer, hf_processor, max_total_sequence_length=96)
    assert val is not None and len(train) == 4 and train.task_names == {"tiny_clevr"}
    record = train.records[1]
    prompt = hf_processor.apply_chat_template(
        record["messages"][:1], tokenize=False, add_generation_prompt=True
    )
    image = record["messages"][0]["content"][0]["image"]
    expected = hf_processor(text=[prompt], images=[image], return_tensors="pt")
    sample = train[1]
    ids = torch.cat([m["token_ids"] for m in sample["message_log"]])
    assert ids.tolist() == expected["input_ids"][0].tolist() and sample["length"] == ids.numel()
    assert torch.equal(sample["pixel_values"], expected["pixel_values"])
    assert torch.equal(sample["image_grid_thw"], expected["image_grid_thw"])
    assert sample["extra_env_info"] == {"ground_truth": record["expected_answer"]}


def test_batches_and_groups_carry_each_rows_images(policy: PolicyConfig, hf_processor: Any) -> None:
    tokenizer = get_policy_tokenizer(policy)
    train, _ = setup_vlm_rl_data(_tiny_clevr(), tokenizer, hf_processor, max_total_sequence_length=96)
    batch = rl_collate_fn([train[i] for i in range(3)])
    assert [torch.equal(p, train[i]["pixel_values"]) for i, p in enumerate(batch["pixel_values"])] == [
        True
    ] * 3
    group = repeat_prompts(batch, 4)
    # A prompt's repeats share its image tensors (sent once) but not its message log (each is extended).
    assert all(
        group["pixel_values"][4 * i + j] is batch["pixel_values"][i] for i in range(3) for j in range(4)
    )
    assert group["message_log"][0] is not group["message_log"][1]
    assert group.select_indices([5])["image_grid_thw"][0] is batch["image_grid_thw"][1]


def test_a_prompt_too_long_for_a_response_is_refused_with_its_row(
    policy: PolicyConfig, hf_processor: Any
) -> None:
    tokenizer = get_policy_tokenizer(policy)
    with pytest.raises(
        ValueError, match=r"^tiny_clevr \(train\): row 0 has a prompt of \d+ tokens \(its images included\)"
    ):
        setup_vlm_rl_data(_tiny_clevr(), tokenizer, hf_processor, max_total_sequence_length=20)


def test_counting_verifier_and_nemo_rl_reward_functions() -> None:
    assert boxed_integer_reward("3", "I see \\boxed{2} no, \\boxed{ 3 }").correct
    assert boxed_integer_reward("3", "\\boxed{03}").score == 1.0
    for wrong in ("\\boxed{4}", "\\boxed{3.5}", "3", "\\boxed{three}", ""):
        assert boxed_integer_reward("3", wrong).score == 0.0, wrong
    assert format_reward("x", "<think>a</think><answer>b</answer>").score == 1.0
    assert format_reward("x", "<answer>b</answer>").score == 0.75 and format_reward("x", "b").correct is None
    assert exact_alnum_reward("Yes.", "<answer> yes </answer>").correct
    assert bbox_giou_reward("[0,0,2,2]", "<answer>[0,0,2,2]</answer>").score == pytest.approx(1.0)
    # Boxes that do not overlap still rank by their distance (generalised IoU below 0).
    near = bbox_giou_reward("[0,0,1,1]", "<answer>[2,0,3,1]</answer>").score
    far = bbox_giou_reward("[0,0,1,1]", "<answer>[9,0,10,1]</answer>").score
    assert 0 > near > far
    clevr = CombinedReward.from_config(vlm_env_config("clevr-cogent", None).reward_functions)
    right = clevr("3", "<think>count</think><answer>3</answer>")
    assert (right.score, right.correct, right.answer) == (pytest.approx(1.0), True, "3")
    wrong = clevr("3", "<answer>4</answer>")
    assert wrong.score == pytest.approx(0.2 * 0.75) and not wrong.correct


def test_environment_scores_counts_and_reports_accuracy() -> None:
    env = VlmEnvironment(EnvConfig().section("tiny_clevr"))
    logs = [
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": reply}]
        for reply in ("\\boxed{2}", "\\boxed{5}", "\\boxed{1}", "no idea")
    ]
    metadata = [{"ground_truth": g} for g in ("2", "2", "1", "1")]
    out = env.step(logs, metadata)
    assert out.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] and out.answers == ["2", "5", "1", None]
    assert bool(out.terminateds.all())
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    batch = BatchedDataDict(
        total_reward=out.rewards, idx=torch.tensor([0, 0, 1, 1]), extra_env_info=out.metadata
    )
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["accuracy"] == 0.5 and metrics["pass@samples_per_prompt"] == 1.0


def test_nemo_rl_env_sections_load_and_a_bad_reward_function_fails_in_one_line() -> None:
    cfg = load_and_validate(NEMO_RL_RECIPE, GRPOMasterConfig)
    clevr = cfg.env.section("clevr-cogent")
    assert isinstance(clevr, VlmEnvConfig) and clevr.num_workers == 8
    assert [(f.name, f.weight) for f in clevr.reward_functions] == [("format", 0.2), ("exact_alnum", 0.8)]
    assert cfg.env.section("refcoco").reward_functions[1].kwargs == {"giou_penalty_thres": 0.5}
    assert [f.name for f in cfg.env.section("tiny_clevr").reward_functions] == ["boxed_integer"]
    with pytest.raises(ConfigError, match=r"env\.clevr-cogent\.reward_functions\.0\.name"):
        load_and_validate(
            NEMO_RL_RECIPE, GRPOMasterConfig, ["env.clevr-cogent.reward_functions.0.name=exact_text"]
        )


def test_text_scripts_refuse_images_and_name_the_vlm_scripts(policy: PolicyConfig) -> None:
    with pytest.raises(UserError, match=r"examples/run_vlm_grpo\.py \(GRPO\)"):
        setup_rl_data(DataConfig(dataset_name="tiny_clevr"), None, max_total_sequence_length=64)  # type: ignore[arg-type]


def _run_script(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> int:
    import nemo_rl.distributed.ray_start as ray_start

    monkeypatch.setattr(ray_start, "start_ray_in_background", lambda cluster_cfg=None: None)
    monkeypatch.setattr(sys, "argv", ["run_vlm_grpo.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "examples" / "run_vlm_grpo.py"), run_name="__main__")
    return int(exit_info.value.code or 0)


def test_the_grpo_script_exits_2_with_one_line_on_a_bad_image(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    Image.new("RGB", (56, 56), BLANK_COLOUR).save(tmp_path / "ok.png")
    rows = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": str(tmp_path / name)}]},
                {"role": "assistant", "content": "\\boxed{1}"},
            ]
        }
        for name in ("ok.png", "gone.png")
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code = _run_script(
        monkeypatch,
        [
            "data.dataset_name=openai_format",
            f"+data.train_data_path={path}",
            "data.val_fraction=0",
            "data.env_name=tiny_clevr",
            f"policy.model_name={MODEL}",
            f"logger.log_dir={tmp_path / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
    )
    stderr = capsys.readouterr().err.strip()
    assert code == 2 and len(stderr.splitlines()) == 1, stderr
    assert f"{path}: row 1: image file {tmp_path}/gone.png does not exist" in stderr


def test_text_data_and_agents_are_refused_by_the_grpo_script(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run_script(monkeypatch, ["data.dataset_name=tiny_math", "data.processor=null"]) == 2
    assert "is text: set data.processor=vlm_hf_data_processor" in capsys.readouterr().err
    assert _run_script(monkeypatch, ["grpo.agent.enabled=true", "grpo.agent.function=agents:solve"]) == 2
    assert "cannot carry the prompts' images" in capsys.readouterr().err


def test_nemo_rl_vlm_grpo_recipe_passes_dry_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run_script(monkeypatch, ["--config", str(NEMO_RL_RECIPE), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen2.5-VL-3B-Instruct" in out and "clevr-cogent" in out


def test_a_sampled_image_placeholder_is_fed_as_padding(hf_processor: Any) -> None:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.vlm import image_forward_inputs

    image_id = int(hf_processor.image_token_id)
    grid = torch.tensor([[1, 4, 4]])  # 16 patches, merged 2x2: four placeholders
    ids = torch.tensor([[5, *[image_id] * 4, 6, image_id, 2], [5, *[image_id] * 4, 6, 3, 2]])
    token_mask = torch.tensor([[0.0] * 6 + [1.0] * 2] * 2)
    batch = BatchedDataDict(
        input_ids=ids,
        token_mask=token_mask,
        pixel_values=[torch.zeros(16, 8)] * 2,
        image_grid_thw=[grid, grid],
    )
    inputs = image_forward_inputs(batch, torch.device("cpu"), image_id, pad_token_id=0, merge_size=2)
    assert inputs["input_ids"][0].tolist() == [5, *[image_id] * 4, 6, 0, 2]
    assert torch.equal(inputs["input_ids"][1], ids[1])
    assert inputs["mm_token_type_ids"].sum(dim=1).tolist() == [4, 4]
    # Without the sampled token, the batch goes in as it is.
    clean = BatchedDataDict({**batch, "input_ids": ids[[1, 1]]})
    assert "input_ids" not in image_forward_inputs(
        clean, torch.device("cpu"), image_id, pad_token_id=0, merge_size=2
    )
