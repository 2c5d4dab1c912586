"""Datasets from local files in every supported schema, splits, malformed rows and the data config."""

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
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import TokenizerConfig
from nemo_rl.data.datasets import (
    MalformedRowError,
    check_prompt_lengths,
    load_dataset_splits,
    read_local_rows,
    setup_preference_data,
    setup_rl_data,
    setup_sft_data,
)
from nemo_rl.data.llm_message_utils import message_log_token_ids
from nemo_rl.data.tiny import build_tiny_tokenizer, generate_arithmetic_problems
from nemo_rl.models.tokenizer import get_tokenizer

MATH_ROWS = generate_arithmetic_problems(20, seed=1)
SQUAD_ROWS = [
    {"context": f"Doc {i}.", "question": f"Q{i}?", "answers": {"text": [f"A{i}"], "answer_start": [0]}}
    for i in range(10)
]
CHAT_ROWS = [
    {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}
    for i in range(10)
]
RESPONSE_ROWS = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(10)]


HELPSTEER3_ROWS: list[dict[str, Any]] = [
    {
        "domain": "general",
        "context": [{"role": "user", "content": "Say hi."}],
        "response1": "Hi!",
        "response2": "Go away.",
        "overall_preference": -2,
    },
    {"context": "Add 1 and 1.", "response1": "3", "response2": "2", "overall_preference": 3},
    {"context": "Pick one.", "response1": "A", "response2": "B", "overall_preference": 0},
]
TULU3_ROWS: list[dict[str, Any]] = [
    {
        "prompt": "2+2?",
        "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}],
    }
]


def _write_jsonl(path: pathlib.Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def _write_parquet(path: pathlib.Path, rows: list[dict[str, Any]]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(path)
    return get_tokenizer(TokenizerConfig(name=str(path)), model_name=None, trust_remote_code=False)


@pytest.mark.parametrize("writer", [_write_jsonl, _write_parquet])
def test_openmathinstruct_local_files(tmp_path: pathlib.Path, writer: Any) -> None:
    suffix = ".jsonl" if writer is _write_jsonl else ".parquet"
    train = writer(tmp_path / f"train{suffix}", MATH_ROWS[:15])
    val = writer(tmp_path / f"val{suffix}", MATH_ROWS[15:])
    splits = load_dataset_splits(
        DataConfig(dataset_name="OpenMathInstruct-2", train_data_path=train, val_data_path=val)
    )
    assert len(splits.train) == 15 and splits.validation is not None and len(splits.validation) == 5
    record = splits.train[0]
    assert record["messages"] == [
        {"role": "user", "content": MATH_ROWS[0]["problem"]},
        {"role": "assistant", "content": MATH_ROWS[0]["generated_solution"]},
    ]
    assert record["expected_answer"] == MATH_ROWS[0]["expected_answer"]
    assert splits.validation[4]["expected_answer"] == MATH_ROWS[19]["expected_answer"]


def test_squad_local_file(tmp_path: pathlib.Path) -> None:
    rows = [*SQUAD_ROWS[:9], {**SQUAD_ROWS[9], "answers": ["plain list answer"]}]
    path = _write_jsonl(tmp_path / "squad.jsonl", rows)
    splits = load_dataset_splits(DataConfig(dataset_name="squad", train_data_path=path, val_fraction=0.0))
    assert splits.validation is None and len(splits.train) == 10
    assert [m["role"] for m in splits.train[0]["messages"]] == ["system", "user", "assistant"]
    assert [m["content"] for m in splits.train[3]["messages"]] == ["Doc 3.", "Q3?", "A3"]
    assert splits.train[9]["expected_answer"] == "plain list answer"


def test_openai_format_and_json_array(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"conversation": r["messages"]} for r in CHAT_ROWS]))
    cfg = DataConfig(dataset_name="openai_format", train_data_path=str(path), chat_key="conversation")
    splits = load_dataset_splits(cfg)
    assert splits.validation is not None
    assert len(splits.train) + len(splits.validation) == 10
    assert splits.train[0]["messages"][1]["role"] == "assistant"
    assert "expected_answer" not in splits.train[0]
    assert "tools" not in splits.train[0]


def test_openai_format_rows_declare_tools(tmp_path: pathlib.Path) -> None:
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{**row, "tools": tools} for row in CHAT_ROWS])
    splits = load_dataset_splits(
        DataConfig(dataset_name="openai_format", train_data_path=path, val_fraction=0.0)
    )
    assert splits.train[0]["tools"] == tools


def test_response_columns(tmp_path: pathlib.Path) -> None:
    path = _write_parquet(tmp_path / "r.parquet", RESPONSE_ROWS)
    cfg = DataConfig(
        dataset_name="response",
        train_data_path=path,
        input_key="prompt",
        output_key="completion",
        val_fraction=0,
    )
    record = load_dataset_splits(cfg).train[2]
    assert record["messages"] == [{"role": "user", "content": "p2"}, {"role": "assistant", "content": "c2"}]
    assert record["expected_answer"] == "c2"


def test_tiny_math_is_generated_deterministically() -> None:
    cfg = DataConfig(dataset_name="tiny_math", num_train_samples=30, num_val_samples=5, seed=3)
    splits = load_dataset_splits(cfg)
    assert len(splits.train) == 30 and splits.validation is not None and len(splits.validation) == 5
    assert list(splits.train) == list(load_dataset_splits(cfg).train)
    train_problems = {r["messages"][0]["content"] for r in splits.train}
    assert not train_problems & {r["messages"][0]["content"] for r in splits.validation}
    no_val = load_dataset_splits(DataConfig(num_train_samples=4, num_val_samples=0))
    assert no_val.validation is None


def test_val_fraction_split_is_seeded_and_disjoint(tmp_path: pathlib.Path) -> None:
    path = _write_jsonl(tmp_path / "m.jsonl", MATH_ROWS)
    cfg = DataConfig(dataset_name="OpenMathInstruct-2", train_data_path=path, val_fraction=0.25, seed=5)
    splits = load_dataset_splits(cfg)
    assert splits.validation is not None
    assert len(splits.train) == 15 and len(splits.validation) == 5
    problems = lambda ds: [r["messages"][0]["content"] for r in ds]  # noqa: E731
    assert sorted(problems(splits.train) + problems(splits.validation)) == sorted(
        r["problem"] for r in MATH_ROWS
    )
    again = load_dataset_splits(cfg)
    assert again.validation is not None and problems(again.validation) == problems(splits.validation)
    other = load_dataset_splits(cfg.model_copy(update={"seed": 6}))
    assert other.validation is not None and problems(other.validation) != problems(splits.validation)


@pytest.mark.parametrize(
    ("dataset_name", "row", "expected"),
    [
        (
            "OpenMathInstruct-2",
            {"generated_solution": "x"},
            "line 3 \\(row 2, 0-based\\) .*is missing 'problem'",
        ),
        (
            "OpenMathInstruct-2",
            {"problem": None, "expected_answer": "1"},
            "line 3 \\(row 2, 0-based\\) .*has 'problem': null",
        ),
        (
            "OpenMathInstruct-2",
            {"problem": "x", "expected_answer": " "},
            "line 3 \\(row 2, 0-based\\) .*an empty 'expected_answer'",
        ),
        (
            "OpenMathInstruct-2",
            {"problem": "x"},
            "line 3 \\(row 2, 0-based\\) .*neither 'generated_solution' nor 'expected_answer'",
        ),
        (
            "OpenMathInstruct-2",
            {"problem": ["x"], "expected_answer": "1"},
            "line 3 \\(row 2, 0-based\\) .*'problem' of type list",
        ),
        (
            "squad",
            {"context": "c", "question": "q", "answers": {"text": []}},
            "line 3 \\(row 2, 0-based\\) .*no answer text",
        ),
        (
            "openai_format",
            {"messages": [{"role": "user"}]},
            "line 3 \\(row 2, 0-based\\) .*message 0 of 'messages' without a string 'role'",
        ),
        ("openai_format", {"text": "x"}, "line 3 \\(row 2, 0-based\\) .*no message list under 'messages'"),
        (
            "openai_format",
            {"messages": [{"role": "user", "content": "x"}], "tools": "calculator"},
            "line 3 \\(row 2, 0-based\\) .*'tools' of type str, expected a list of JSON schema objects",
        ),
        ("response", {"input": "x"}, "line 3 \\(row 2, 0-based\\) .*is missing 'output'"),
        (
            "binary_preference",
            {"prompt": "p", "chosen": "c"},
            "line 3 \\(row 2, 0-based\\) .*no 'rejected' string or message list",
        ),
        (
            "HelpSteer3",
            {"context": "c", "response1": "a"},
            "line 3 \\(row 2, 0-based\\) .*is missing 'response2'",
        ),
        (
            "HelpSteer3",
            {"context": "c", "response1": "a", "response2": "b", "overall_preference": "left"},
            "line 3 \\(row 2, 0-based\\) .*'overall_preference' 'left', expected a number",
        ),
        (
            "Tulu3Preference",
            {
                "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}],
            },
            "line 3 \\(row 2, 0-based\\) .*different prompts",
        ),
        (
            "Tulu3Preference",
            {"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "q"}]},
            "line 3 \\(row 2, 0-based\\) .*'chosen' that does not end with an assistant response",
        ),
    ],
)
def test_malformed_row_names_its_index(
    tmp_path: pathlib.Path, dataset_name: str, row: dict, expected: str
) -> None:
    good_rows: dict[str, dict[str, Any]] = {
        "OpenMathInstruct-2": MATH_ROWS[0],
        "squad": SQUAD_ROWS[0],
        "openai_format": CHAT_ROWS[0],
        "response": {"input": "a", "output": "b"},
        "binary_preference": {"prompt": "p", "chosen": "c", "rejected": "r"},
        "HelpSteer3": HELPSTEER3_ROWS[0],
        "Tulu3Preference": TULU3_ROWS[0],
    }
    good = good_rows[dataset_name]
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, good, row, good])
    with pytest.raises(MalformedRowError, match=expected) as info:
        load_dataset_splits(DataConfig(dataset_name=dataset_name, train_data_path=path))  # type: ignore[arg-type]
    assert info.value.index == 2 and info.value.line == 3
    assert "Rows of this dataset need" in str(info.value)


def test_file_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        read_local_rows(tmp_path / "missing.jsonl")
    (tmp_path / "data.txt").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported data file type '\.txt'"):
        read_local_rows(tmp_path / "data.txt")
    (tmp_path / "broken.jsonl").write_text('{"problem": "x"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_local_rows(tmp_path / "broken.jsonl")
    (tmp_path / "tiny.jsonl").write_text(json.dumps(MATH_ROWS[0]) + "\n")
    with pytest.raises(ValueError, match="too few to hold out"):
        load_dataset_splits(
            DataConfig(dataset_name="OpenMathInstruct-2", train_data_path=str(tmp_path / "tiny.jsonl"))
        )


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_file_that_is_not_utf8_names_its_line(tmp_path: pathlib.Path, suffix: str) -> None:
    # Latin-1 text, as a spreadsheet export often is: the third line holds a byte UTF-8 does not allow.
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes(b'problem,expected_answer\n"1+1",2\n"caf\xe9",3\n')
    with pytest.raises(
        UserError, match=rf"latin1\{suffix}: line 3 is not UTF-8 text .*save the file as UTF-8"
    ):
        read_local_rows(path)


def test_a_broken_parquet_file_is_a_data_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(UserError, match=r"broken\.parquet is not a readable Parquet file"):
        read_local_rows(path)


def test_config_validation() -> None:
    with pytest.raises(ValidationError, match="has no default source"):
        DataConfig(dataset_name="openai_format")
    with pytest.raises(ValidationError, match="reads no files"):
        DataConfig(dataset_name="tiny_math", train_data_path="x.jsonl")
    with pytest.raises(ValidationError, match="exceeds the 18 distinct"):
        DataConfig(num_train_samples=10, num_val_samples=9, tiny_math_max_operand=2)
    with pytest.raises(ValidationError, match="extra"):
        DataConfig(datset_name="squad")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="dataset_name"):
        DataConfig(dataset_name="imagenet")  # type: ignore[arg-type]
    for name, field in DataConfig.model_fields.items():
        assert field.description, f"data.{name} has no docstring"


def test_setup_rl_and_sft_data(tokenizer: PreTrainedTokenizerBase, tmp_path: pathlib.Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Solve {}")
    cfg = DataConfig(num_train_samples=8, num_val_samples=2, prompt_file=str(prompt), max_input_seq_length=64)
    rl_train, rl_val = setup_rl_data(cfg, tokenizer, max_total_sequence_length=128)
    assert len(rl_train) == 8 and rl_val is not None and len(rl_val) == 2
    assert rl_train.max_seq_length == 64
    datum = rl_train[3]
    problem = rl_train.records[3]["messages"][0]["content"]
    assert datum["idx"] == 3 and datum["task_name"] == "math"
    assert datum["extra_env_info"] == {"ground_truth": rl_train.records[3]["expected_answer"]}
    text = tokenizer.decode(message_log_token_ids(datum["message_log"]).tolist())
    assert text == f"<|bos|><|user|>Solve {problem}<|assistant|>"
    sft_train, _ = setup_sft_data(
        cfg.model_copy(update={"max_input_seq_length": None}), tokenizer, max_total_sequence_length=128
    )
    assert sft_train.max_seq_length == 128
    assert sft_train[3]["task_name"] == "sft"
    assert sft_train[3]["message_log"][-1]["content"].endswith("<|eos|>")
    assert len(list(sft_train)) == 8 and len(sft_train[2:5]) == 3
    with pytest.raises(IndexError):
        sft_train[8]

    # Prompts that leave no room for a response: a warning with the count, or an error when none fits.
    longest = max(rl_train[i]["length"] for i in range(8))
    shortest = min(rl_train[i]["length"] for i in range(8))
    assert shortest < longest
    assert 0 < check_prompt_lengths(rl_train, longest, "policy.max_total_sequence_length") < 8
    with pytest.raises(
        UserError, match=r"none of the first 8 training prompts .* data.max_input_seq_length=4"
    ):
        setup_rl_data(
            cfg.model_copy(update={"max_input_seq_length": 4}), tokenizer, max_total_sequence_length=128
        )


def test_hub_sources_are_loaded_lazily_with_default_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    # No network in tests: stand in for the hub with in-memory datasets, recording what was asked for.
    import datasets

    requests: list[tuple[str, str]] = []
    hub = {
        ("rajpurkar/squad", "train"): SQUAD_ROWS[:8],
        ("rajpurkar/squad", "validation"): SQUAD_ROWS[8:],
        ("nvidia/OpenMathInstruct-2", "train_1M"): [
            *MATH_ROWS[:9],
            {"problem": "no answer"},
            *MATH_ROWS[10:],
        ],
        ("someone/chat", "train"): CHAT_ROWS,
        ("nvidia/HelpSteer3", "train"): HELPSTEER3_ROWS[:1] * 3,
        ("nvidia/HelpSteer3", "validation"): HELPSTEER3_ROWS[:1],
    }
    subsets: list[str | None] = []

    def fake_load_dataset(name: str, subset: str | None, split: str) -> datasets.Dataset:
        requests.append((name, split))
        subsets.append(subset)
        return datasets.Dataset.from_list(hub[(name, split)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)

    squad = load_dataset_splits(DataConfig(dataset_name="squad"))
    assert requests == [("rajpurkar/squad", "train"), ("rajpurkar/squad", "validation")]
    assert len(squad.train) == 8 and squad.validation is not None and len(squad.validation) == 2
    assert squad.validation[0]["expected_answer"] == "A8"

    math = load_dataset_splits(DataConfig(dataset_name="OpenMathInstruct-2", val_fraction=0.1))
    assert requests[-1] == ("nvidia/OpenMathInstruct-2", "train_1M")
    assert math.validation is not None and len(math.train) + len(math.validation) == 20
    # Hub rows are converted on access, so the malformed one fails when it is read, naming its row.
    with pytest.raises(MalformedRowError, match=r"hub split train_1M\): row 9 "):
        list(math.train) + list(math.validation)

    chat = load_dataset_splits(DataConfig(dataset_name="openai_format", train_data_path="someone/chat"))
    assert requests[-1] == ("someone/chat", "train")
    assert chat.validation is not None and len(chat.train) + len(chat.validation) == 10
    assert set(subsets) == {None}

    # HelpSteer3 reads its "preference" subset, training and validation splits.
    helpsteer = load_dataset_splits(DataConfig(dataset_name="HelpSteer3"))
    assert requests[-2:] == [("nvidia/HelpSteer3", "train"), ("nvidia/HelpSteer3", "validation")]
    assert subsets[-2:] == ["preference", "preference"]
    assert helpsteer.validation is not None and len(helpsteer.train) == 3
    assert helpsteer.train[2]["rejected_messages"][-1]["content"] == "Go away."


def test_binary_preference_rows(tmp_path: pathlib.Path, tokenizer: PreTrainedTokenizerBase) -> None:
    rows: list[dict[str, Any]] = [
        {"question": "What is 1+2?", "good": "3", "bad": "4"},
        {
            "question": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"}],
            "good": [{"role": "assistant", "content": "4"}],
            "bad": "5",
        },
    ]
    path = _write_jsonl(tmp_path / "pref.jsonl", rows)
    cfg = DataConfig(
        dataset_name="binary_preference",
        train_data_path=path,
        val_fraction=0,
        prompt_key="question",
        chosen_key="good",
        rejected_key="bad",
    )
    records = load_dataset_splits(cfg).train
    assert records[0]["messages"] == [
        {"role": "user", "content": "What is 1+2?"},
        {"role": "assistant", "content": "3"},
    ]
    assert records[0]["rejected_messages"][-1] == {"role": "assistant", "content": "4"}
    assert [m["role"] for m in records[1]["rejected_messages"]] == ["system", "user", "assistant"]
    train, val = setup_preference_data(cfg, tokenizer, max_total_sequence_length=64)
    assert val is None and train[1]["task_name"] == "preference"
    chosen = tokenizer.decode(message_log_token_ids(train[1]["message_log"]).tolist())
    rejected = tokenizer.decode(message_log_token_ids(train[1]["rejected_message_log"]).tolist())
    assert chosen == "<|bos|><|system|>Be exact.<|user|>2+2?<|assistant|>4<|eos|>"
    assert rejected == chosen.replace(">4<", ">5<")
    assert train[1]["length"] == len(_ids(tokenizer, chosen))
    with pytest.raises(ValueError, match=r"needs data\.dataset_name to be one of binary_preference"):
        setup_preference_data(DataConfig(), tokenizer, max_total_sequence_length=64)


def test_helpsteer3_and_tulu3_preferences(tmp_path: pathlib.Path) -> None:
    helpsteer = load_dataset_splits(
        DataConfig(
            dataset_name="HelpSteer3", train_data_path=_write_jsonl(tmp_path / "hs.jsonl", HELPSTEER3_ROWS)
        )
    )
    rows = list(helpsteer.train) + list(helpsteer.validation or [])
    by_prompt = {r["messages"][0]["content"]: r for r in rows}
    # A negative preference prefers response1, a positive one response2; a tie pairs response1 with itself.
    assert by_prompt["Say hi."]["messages"][-1]["content"] == "Hi!"
    assert by_prompt["Say hi."]["rejected_messages"][-1]["content"] == "Go away."
    assert by_prompt["Add 1 and 1."]["messages"] == [
        {"role": "user", "content": "Add 1 and 1."},
        {"role": "assistant", "content": "2"},
    ]
    assert by_prompt["Pick one."]["messages"] == by_prompt["Pick one."]["rejected_messages"]

    tulu = load_dataset_splits(
        DataConfig(
            dataset_name="Tulu3Preference",
            train_data_path=_write_jsonl(tmp_path / "tulu.jsonl", TULU3_ROWS),
            val_fraction=0,
        )
    )
    assert tulu.train[0]["messages"] == TULU3_ROWS[0]["chosen"]
    assert tulu.train[0]["rejected_messages"] == TULU3_ROWS[0]["rejected"]


def test_tiny_math_preferences_hold_out_the_tiny_math_validation_problems() -> None:
    cfg = DataConfig(dataset_name="tiny_math_preference", num_train_samples=300, num_val_samples=40)
    pairs = load_dataset_splits(cfg)
    problems = load_dataset_splits(cfg.model_copy(update={"dataset_name": "tiny_math"}))
    assert pairs.validation is not None and problems.validation is not None
    # Same held-out problems as tiny_math (so SFT, GRPO, DPO and RM never train on them), whatever the size.
    for split_pairs, split_problems in (
        (pairs.train, problems.train),
        (pairs.validation, problems.validation),
    ):
        assert [r["messages"][:2] for r in split_pairs] == [r["messages"][:2] for r in split_problems]
    smaller = load_dataset_splits(cfg.model_copy(update={"num_train_samples": 10}))
    assert smaller.validation is not None and list(smaller.validation) == list(pairs.validation)
    for record in list(pairs.train) + list(pairs.validation):
        chosen, rejected = record["messages"][-1]["content"], record["rejected_messages"][-1]["content"]
        question = record["messages"][0]["content"].removeprefix("What is ").removesuffix("?")
        assert chosen.split("=")[0] == rejected.split("=")[0] == question
        assert chosen.split("=")[1] == f"\\boxed{{{eval(question)}}}" != rejected.split("=")[1]
        assert rejected.split("=")[1].startswith("\\boxed{")


def test_tiny_math_preferences_with_several_rejected_answers_per_problem() -> None:
    cfg = DataConfig(dataset_name="tiny_math_preference", num_train_samples=50, num_val_samples=10)
    one = load_dataset_splits(cfg)
    many = load_dataset_splits(cfg.model_copy(update={"tiny_math_rejected_per_problem": 7}))
    assert many.validation is not None and one.validation is not None
    # Validation keeps one pair per problem, the same pairs; training gets every plausible wrong answer.
    assert list(many.validation) == list(one.validation)
    by_prompt: dict[str, list[str]] = {}
    for record in many.train:
        by_prompt.setdefault(record["messages"][0]["content"], []).append(
            record["rejected_messages"][-1]["content"]
        )
    assert len(by_prompt) == 50 and all(5 <= len(set(r)) == len(r) <= 7 for r in by_prompt.values())
    # A problem's first pair is the one-pair-per-problem pair.
    assert [r[0] for r in by_prompt.values()] == [r["rejected_messages"][-1]["content"] for r in one.train]
    with pytest.raises(ValueError, match="tiny_math_preference only"):
        DataConfig(dataset_name="tiny_math", tiny_math_rejected_per_problem=2)
