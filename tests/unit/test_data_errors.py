"""A data file that cannot be used ends a script like a config error does: one line on stderr that names the
file and the line (or the config key to change), exit status 2, no traceback, and the file left as it was.

Each case runs the loader an example script runs under :func:`nemo_rl.config.cli.run_cli`, the scripts' way of
turning a :class:`~nemo_rl.config.errors.UserError` into that line; two cases that once ended in a traceback run
the scripts themselves.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import re
import runpy
import sys
from collections.abc import Callable
from typing import Any

import pytest

from nemo_rl.algorithms.loop import Resume
from nemo_rl.algorithms.run_build import make_train_loader
from nemo_rl.config.cli import run_cli
from nemo_rl.config.data import DataConfig
from nemo_rl.config.eval import EvalDataConfig
from nemo_rl.data.datasets import ProcessedDataset, load_dataset_splits
from nemo_rl.data.datasets.eval_datasets import load_eval_records
from nemo_rl.data.interfaces import TaskDataSpec
from nemo_rl.data.processors import math_processor
from nemo_rl.models.tokenizer import resolve_chat_template

ROOT = pathlib.Path(__file__).resolve().parents[2]

MATH = [{"problem": f"What is {i}+1?", "expected_answer": str(i + 1)} for i in range(6)]
PAIRS = [{"prompt": f"What is {i}+1?", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(6)]


def _jsonl(rows: list[Any]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _with_row(rows: list[dict[str, Any]], index: int, row: Any) -> bytes:
    return _jsonl([*rows[:index], row, *rows[index + 1 :]])


# (case, the file's name, its bytes (None: a directory), data.dataset_name, what the one line says). The
# message is a regex in which {file} stands for the file's path.
CASES: list[tuple[str, str, bytes | None, str, str]] = [
    (
        "latin-1 bytes",
        "latin1.jsonl",
        _jsonl(MATH[:2]) + b'{"problem": "caf\xe9", "expected_answer": "1"}\n',
        "OpenMathInstruct-2",
        r"{file}: line 3 is not UTF-8 text \(byte 0xe9 at offset \d+\): save the file as UTF-8",
    ),
    (
        "truncated line",
        "cut.jsonl",
        _jsonl(MATH[:3]) + b'{"problem": "What is\n' + _jsonl(MATH[3:]),
        "OpenMathInstruct-2",
        r"{file}: line 4 is not valid JSON \(Unterminated string .*\); a \.jsonl file holds one JSON object per line",
    ),
    (
        "missing field",
        "missing.jsonl",
        _with_row(MATH, 3, {"expected_answer": "4"}),
        "OpenMathInstruct-2",
        r"{file}: line 4 \(row 3, 0-based\) is missing 'problem' \(it has \['expected_answer'\]\)\. Rows of this",
    ),
    (
        "field of the wrong type",
        "wrong_type.jsonl",
        _with_row(MATH, 3, {"problem": ["What is 1+1?"], "expected_answer": "2"}),
        "OpenMathInstruct-2",
        r"{file}: line 4 \(row 3, 0-based\) has 'problem' of type list, expected a string",
    ),
    (
        "preference missing rejected",
        "pairs_missing.jsonl",
        _with_row(PAIRS, 1, {"prompt": "p", "chosen": "c"}),
        "binary_preference",
        r"{file}: line 2 \(row 1, 0-based\) has no 'rejected' string or message list",
    ),
    (
        "preference field of the wrong type",
        "pairs_wrong_type.jsonl",
        _with_row(PAIRS, 1, {"prompt": "p", "chosen": 5, "rejected": "r"}),
        "binary_preference",
        r"{file}: line 2 \(row 1, 0-based\) has 'chosen' of type int, expected a string or a message list",
    ),
    (
        "row that is not an object",
        "list_row.jsonl",
        _with_row(MATH, 2, ["What is 1+1?", "2"]),
        "OpenMathInstruct-2",
        r"{file}: line 3 \(row 2, 0-based\) is a list, not an object with named fields",
    ),
    ("empty file", "empty.jsonl", b"", "OpenMathInstruct-2", r"data\.train_data_path={file} holds no rows"),
    (
        "blank lines only",
        "blank.jsonl",
        b"\n  \n",
        "OpenMathInstruct-2",
        r"data\.train_data_path={file} holds no rows",
    ),
    (
        "csv header only",
        "header.csv",
        b"problem,expected_answer\n",
        "OpenMathInstruct-2",
        r"data\.train_data_path={file} holds no rows",
    ),
    (
        "csv row with an unquoted comma",
        "commas.csv",
        b"problem,expected_answer\nWhat is 1+1?,2\nAdd 1, 2 and 3,6\n",
        "OpenMathInstruct-2",
        r"{file}: line 3 has 3 fields, more than the header's 2: quote values that hold commas",
    ),
    (
        "broken parquet",
        "broken.parquet",
        b"PAR1 not really parquet",
        "OpenMathInstruct-2",
        r"{file} is not a readable Parquet file",
    ),
    (
        "wrong file type",
        "data.txt",
        b"What is 1+1?\n",
        "OpenMathInstruct-2",
        r"data\.train_data_path={file}: unsupported data file type '\.txt'",
    ),
    ("directory", "folder", None, "OpenMathInstruct-2", r"data\.train_data_path={file} is a directory"),
    (
        "directory named like a file",
        "folder.jsonl",
        None,
        "OpenMathInstruct-2",
        r"data\.train_data_path={file} is a directory: give the path of a data file",
    ),
]


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], call: Callable[[], object]) -> str:
    """Run ``call`` as a script's ``main``; assert it ends with status 2 and one line on stderr, return it."""
    with pytest.raises(SystemExit) as exit_info:
        run_cli(call)
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    return stderr.strip()


def _digest(path: pathlib.Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


@pytest.mark.parametrize(
    ("case", "name", "content", "dataset_name", "message"), CASES, ids=[c[0] for c in CASES]
)
def test_a_bad_training_file_is_one_line_and_exit_2(
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    name: str,
    content: bytes | None,
    dataset_name: str,
    message: str,
) -> None:
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    before = _digest(path)
    cfg = DataConfig(dataset_name=dataset_name, train_data_path=str(path))  # type: ignore[arg-type]
    line = _one_line_exit_2(capsys, lambda: load_dataset_splits(cfg))
    assert re.search(message.format(file=path), line), line
    assert _digest(path) == before, "the data file was changed"


def test_a_bad_validation_file_names_its_key(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = tmp_path / "train.jsonl"
    train.write_bytes(_jsonl(MATH))
    cfg = DataConfig(
        dataset_name="OpenMathInstruct-2",
        train_data_path=str(train),
        val_data_path=str(tmp_path / "val.jsonl"),
    )
    line = _one_line_exit_2(capsys, lambda: load_dataset_splits(cfg))
    assert f"data.val_data_path={tmp_path / 'val.jsonl'} does not exist: give the path of a data file" in line


def test_a_path_that_does_not_exist_is_not_looked_up_on_the_hub(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A path without a data suffix was taken for a hub name: the hub's loader then failed with a traceback.
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("looked up on the hub"))
    for missing in (tmp_path / "no" / "train", "./data/train", "data/v2/train"):
        cfg = DataConfig(dataset_name="OpenMathInstruct-2", train_data_path=str(missing))
        line = _one_line_exit_2(capsys, lambda cfg=cfg: load_dataset_splits(cfg))
        assert f"data.train_data_path={missing} does not exist: give the path of a data file" in line


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("Couldn't reach 'someone/nothing' on the Hub (LocalEntryNotFoundError)"),
        FileNotFoundError(),
    ],
)
def test_a_hub_name_that_cannot_be_loaded_names_its_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    import datasets

    def unreachable(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    cfg = DataConfig(dataset_name="OpenMathInstruct-2", train_data_path="someone/nothing")
    line = _one_line_exit_2(capsys, lambda: load_dataset_splits(cfg))
    assert (
        f"data.train_data_path: the hub dataset someone/nothing (split 'train') cannot be loaded ({type(error).__name__}"
        in line
    )


def test_fewer_rows_than_one_batch_names_the_file_and_the_key(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "few.jsonl"
    path.write_bytes(_jsonl(MATH[:3]))
    splits = load_dataset_splits(
        DataConfig(dataset_name="OpenMathInstruct-2", train_data_path=str(path), val_fraction=0)
    )
    spec = TaskDataSpec.from_prompt_files(
        task_name="math", prompt_file=None, system_prompt_file=None, add_bos=False
    )
    train = ProcessedDataset(splits.train, math_processor, spec, None, 64)  # type: ignore[arg-type]
    line = _one_line_exit_2(
        capsys,
        lambda: make_train_loader(
            train,
            Resume(None, {}),
            batch_size=8,
            batch_size_key="policy.train_global_batch_size",
            shuffle=True,
            seed=0,
            collate_fn=list,
        ),
    )
    assert (
        f"the training data ({path}) has 3 samples, fewer than one batch (policy.train_global_batch_size=8): "
        "lower policy.train_global_batch_size or give more data"
    ) in line


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"Solve: caf\xe9 {}\n", r"{file}: line 1 is not UTF-8 text"),
        (
            b"Solve {} and put it in \\boxed{}\n",
            r"data\.prompt_file={file} must contain exactly one '\{{\}}'",
        ),
        (b"Solve {\n", r"data\.prompt_file={file} is not a valid template"),
        (None, r"data\.prompt_file={file} is a directory: give the path of a text file"),
    ],
)
def test_a_bad_prompt_file_is_one_line_and_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], content: bytes | None, message: str
) -> None:
    path = tmp_path / "prompt.txt"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    cfg = DataConfig(prompt_file=str(path))
    line = _one_line_exit_2(capsys, lambda: TaskDataSpec.from_config(cfg, task_name="math"))
    assert re.search(message.format(file=path), line), line


def test_a_bad_chat_template_file_is_one_line_and_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "template.jinja").write_bytes(b"{{ caf\xe9 }}")
    line = _one_line_exit_2(capsys, lambda: resolve_chat_template(str(tmp_path / "template.jinja")))
    assert f"{tmp_path / 'template.jinja'}: line 1 is not UTF-8 text" in line
    line = _one_line_exit_2(capsys, lambda: resolve_chat_template(str(tmp_path / "missing.jinja")))
    assert f"policy.tokenizer.chat_template={tmp_path / 'missing.jinja'} does not exist" in line


def test_a_bad_benchmark_file_is_one_line_and_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    line = _one_line_exit_2(capsys, lambda: load_eval_records(EvalDataConfig(dataset_name=str(empty))))
    assert f"data.dataset_name={empty} holds no rows" in line
    line = _one_line_exit_2(
        capsys,
        lambda: load_eval_records(EvalDataConfig(dataset_name="gsm8k", data_path=str(tmp_path / "nope"))),
    )
    assert f"data.data_path={tmp_path / 'nope'} does not exist" in line


def _run_script(
    script: str, args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    """Run ``examples/<script>`` in this process as a user would; assert exit 2 and one line, return it.
    Ray's background start is left out: with it under way a script exits at once (``os._exit``), which
    tests/faults/test_bad_input.py checks in a process of its own."""
    import nemo_rl.distributed.ray_start as ray_start

    monkeypatch.setattr(ray_start, "start_ray_in_background", lambda cluster_cfg=None: None)
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    return stderr.strip()


def test_scripts_end_with_one_line_where_they_once_showed_a_traceback(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Both fail before any worker starts: the SFT script reads its data before setup, the eval script before
    # its workers.
    missing = tmp_path / "data" / "train"
    line = _run_script(
        "run_sft.py",
        [
            "--config",
            str(ROOT / "examples" / "configs" / "sft_tiny_math.yaml"),
            "data.dataset_name=OpenMathInstruct-2",
            f"data.train_data_path={missing}",
            f"logger.log_dir={tmp_path / 'logs'}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
        monkeypatch,
        capsys,
    )
    assert line.startswith(f"run_sft.py: error: data.train_data_path={missing} does not exist"), line
    empty = tmp_path / "problems.jsonl"
    empty.write_bytes(b"")
    line = _run_script(
        "run_eval.py",
        [
            "--config",
            str(ROOT / "examples" / "configs" / "evals" / "tiny_math_eval.yaml"),
            f"data.dataset_name={empty}",
            f"eval.save_path={tmp_path / 'eval'}",
            f"logger.log_dir={tmp_path / 'logs'}",
        ],
        monkeypatch,
        capsys,
    )
    assert line.startswith(f"run_eval.py: error: data.dataset_name={empty} holds no rows"), line
