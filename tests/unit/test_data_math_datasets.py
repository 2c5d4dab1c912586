"""NeMo RL's math datasets (DAPOMath17K, DAPOMathAIME2024, DeepScaler, AIME2024) in their hub column layouts,
and validation data from another dataset than the training data (NeMo RL's ``data.validation``)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.data import DataConfig
from nemo_rl.config.policy import TokenizerConfig
from nemo_rl.data.datasets import MalformedRowError, load_dataset_splits, setup_rl_data
from nemo_rl.data.tiny import build_tiny_tokenizer
from nemo_rl.models.tokenizer import get_tokenizer

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put your "
    'answer on its own line after "Answer:".'
)


def verl_row(problem: str, answer: str) -> dict[str, Any]:
    """One row in the layout of BytedTsinghua-SIA/DAPO-Math-17k and BytedTsinghua-SIA/AIME-2024."""
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_INSTRUCTION.format(problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"id-{problem}"},
    }


DAPO_ROWS = [verl_row(f"What is {i} + {i}?", str(2 * i)) for i in range(6)]
DAPO_AIME_ROWS = [verl_row("Find the AIME answer.", "204"), verl_row("Find another one.", "23")]
# agentica-org/DeepScaleR-Preview-Dataset and HuggingFaceH4/aime_2024.
DEEPSCALER_ROWS = [{"problem": f"Compute {i}^2.", "answer": str(i * i), "solution": "..."} for i in range(5)]
AIME_ROWS = [
    {
        "id": 60,
        "problem": "AIME problem one.",
        "solution": "...",
        "answer": "204",
        "url": "u",
        "year": "2024",
    },
    {"id": 61, "problem": "AIME problem two.", "solution": "...", "answer": "23", "url": "u", "year": "2024"},
]
HUB = {
    ("BytedTsinghua-SIA/DAPO-Math-17k", "train"): DAPO_ROWS,
    ("BytedTsinghua-SIA/AIME-2024", "train"): DAPO_AIME_ROWS,
    ("agentica-org/DeepScaleR-Preview-Dataset", "train"): DEEPSCALER_ROWS,
    ("HuggingFaceH4/aime_2024", "train"): AIME_ROWS,
}


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """No network in tests: the hub datasets these loaders name, in memory; returns the requests made."""
    import datasets

    requests: list[tuple[str, str]] = []

    def fake_load_dataset(name: str, subset: str | None, split: str) -> datasets.Dataset:
        assert subset is None
        requests.append((name, split))
        return datasets.Dataset.from_list(HUB[(name, split)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    return requests


def nemo_rl_data(train: dict[str, Any], validation: dict[str, Any] | None, **default: Any) -> DataConfig:
    """The ``data`` section in NeMo RL's train / validation / default layout."""
    return DataConfig.model_validate(
        {"train": train, "validation": validation, "default": {"env_name": "math", **default}}
    )


def test_dapo_recipe_data_reads_both_hub_datasets_whole(hub: list[tuple[str, str]]) -> None:
    # NeMo RL's PPO/DAPO recipes: train on DAPOMath17K, validate on DAPO's AIME 2024.
    cfg = nemo_rl_data({"dataset_name": "DAPOMath17K"}, {"dataset_name": "DAPOMathAIME2024"})
    assert (cfg.dataset_name, cfg.val_dataset_name) == ("DAPOMath17K", "DAPOMathAIME2024")
    splits = load_dataset_splits(cfg)
    assert hub == [("BytedTsinghua-SIA/DAPO-Math-17k", "train"), ("BytedTsinghua-SIA/AIME-2024", "train")]
    # The validation set replaces the training data's own hold-out: every training row trains.
    assert len(splits.train) == len(DAPO_ROWS)
    assert splits.validation is not None and len(splits.validation) == len(DAPO_AIME_ROWS)
    # As NeMo RL maps them: the first prompt message (with DAPO's instruction) as the user turn, the ground
    # truth as the assistant reply and the RL answer.
    assert splits.train[3] == {
        "messages": [
            {"role": "user", "content": DAPO_INSTRUCTION.format("What is 3 + 3?")},
            {"role": "assistant", "content": "6"},
        ],
        "expected_answer": "6",
    }
    assert splits.validation[0]["expected_answer"] == "204"


def test_distillation_recipe_data_repeats_aime(hub: list[tuple[str, str]]) -> None:
    # NeMo RL's distillation recipe: DeepScaler, validated on AIME 2024 repeated 16 times (3 here).
    cfg = nemo_rl_data({"dataset_name": "DeepScaler"}, {"dataset_name": "AIME2024", "repeat": 3})
    assert cfg.val_repeat == 3
    splits = load_dataset_splits(cfg)
    assert hub == [("agentica-org/DeepScaleR-Preview-Dataset", "train"), ("HuggingFaceH4/aime_2024", "train")]
    assert (
        splits.train[2]["messages"][0]["content"] == "Compute 2^2."
        and splits.train[2]["expected_answer"] == "4"
    )
    assert splits.validation is not None
    assert [r["expected_answer"] for r in splits.validation] == ["204", "23"] * 3


def test_validation_dataset_from_local_files(tmp_path: pathlib.Path) -> None:
    train_path, val_path = tmp_path / "dapo.parquet", tmp_path / "aime.jsonl"
    pq.write_table(pa.Table.from_pylist(DAPO_ROWS), train_path)  # nested columns, as the hub stores them
    # Answers stored as numbers (as some AIME copies do) are read as text.
    val_path.write_text("".join(f'{{"problem": "p{i}", "answer": {i}}}\n' for i in range(3)))
    cfg = DataConfig(
        dataset_name="DAPOMath17K",
        train_data_path=str(train_path),
        val_dataset_name="AIME2024",
        val_data_path=str(val_path),
    )
    tokenizer = _tokenizer(tmp_path)
    train, val = setup_rl_data(cfg, tokenizer, max_total_sequence_length=512)
    assert len(train) == 6 and val is not None and len(val) == 3
    # Both are math prompts for the same task, scored against their answers.
    assert train.task_names == val.task_names == {"math"}
    assert train[1]["extra_env_info"] == {"ground_truth": "2"}
    assert val[2]["extra_env_info"] == {"ground_truth": "2"}


def _tokenizer(tmp_path: pathlib.Path) -> PreTrainedTokenizerBase:
    build_tiny_tokenizer(tmp_path / "tok")
    return get_tokenizer(
        TokenizerConfig(name=str(tmp_path / "tok")), model_name=None, trust_remote_code=False
    )


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"prompt": "What?", "reward_model": {"ground_truth": "1"}}, "'prompt' as a string"),
        ({"prompt": [], "reward_model": {"ground_truth": "1"}}, "empty 'prompt'"),
        ({"prompt": [{"role": "user", "content": "What?"}]}, "'reward_model' None"),
        (
            {"prompt": [{"role": "user", "content": "What?"}], "reward_model": {"style": "x"}},
            "'ground_truth'",
        ),
    ],
)
def test_malformed_verl_rows_name_the_row(tmp_path: pathlib.Path, row: dict[str, Any], problem: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([DAPO_ROWS[0], row]))
    with pytest.raises(MalformedRowError, match=rf"row 1 .*{problem}.*Rows of this dataset need 'prompt'"):
        load_dataset_splits(DataConfig(dataset_name="DAPOMath17K", train_data_path=str(path)))


def test_validation_from_another_dataset_must_hold_the_same_kind_of_rows() -> None:
    # Preference pairs cannot validate a math run: one line saying what to do.
    with pytest.raises(
        ValidationError, match=r"holds preference pairs but data\.dataset_name=DAPOMath17K holds"
    ):
        nemo_rl_data({"dataset_name": "DAPOMath17K"}, {"dataset_name": "HelpSteer3"})
    # Another conversation dataset is fine (one processor reads both), also with the flat keys.
    assert DataConfig(dataset_name="OpenMathInstruct-2", val_dataset_name="AIME2024").separate_val_dataset
    # The same dataset named twice is the training data's own validation.
    same = nemo_rl_data({"dataset_name": "squad"}, {"dataset_name": "squad", "split": "validation"})
    assert same.separate_val_dataset is None
    # Prompts are built and scored one way for both: the validation entry cannot change how.
    with pytest.raises(
        ValidationError, match=r"data.validation.env_name='code' differs from data.train's 'math'"
    ):
        nemo_rl_data({"dataset_name": "DAPOMath17K"}, {"dataset_name": "AIME2024", "env_name": "code"})
    with pytest.raises(ValidationError, match=r"has no default source: set data\.val_data_path"):
        DataConfig(dataset_name="DAPOMath17K", val_dataset_name="response")
    with pytest.raises(ValidationError, match="generated together with its training problems"):
        DataConfig(dataset_name="OpenMathInstruct-2", val_dataset_name="tiny_math")
    with pytest.raises(ValidationError, match=r"data\.train\.repeat"):
        nemo_rl_data({"dataset_name": "AIME2024", "repeat": 2}, None)
