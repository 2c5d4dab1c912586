"""Evaluation benchmarks: built-in math test sets in their hub schemas, or any file of problems and answers.

Every benchmark becomes a :class:`RecordDataset` of records with one user message (the problem) and an
``expected_answer``, which :func:`~nemo_rl.data.processors.math_processor` turns into prompts whose
``extra_env_info`` carries the ground truth the environment checks.

=============  ===========================================  ========  =================  ==================
name           hub source (configuration)                   split     problem column     answer column
=============  ===========================================  ========  =================  ==================
``aime2024``   HuggingFaceH4/aime_2024                      train     ``problem``        ``answer``
``aime2025``   opencompass/AIME2025 (AIME2025-I and -II)    test      ``question``       ``answer``
``math500``    HuggingFaceH4/MATH-500                       test      ``problem``        ``answer``
``gsm8k``      openai/gsm8k (main)                          test      ``question``       ``answer`` after ``####``
``tiny_math``  generated: the held-out split of the tiny arithmetic recipes
=============  ===========================================  ========  =================  ==================

``data.data_path`` reads a built-in benchmark from a local file (or another hub name) in the same schema;
any other ``data.dataset_name`` is itself a file or hub name read with ``data.problem_key`` and
``data.solution_key``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl.config.eval import EvalDataConfig
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.data.datasets.formats import MalformedRowError, RowConverter, math_converter
from nemo_rl.data.datasets.loading import (
    LOCAL_SUFFIXES,
    RecordDataset,
    is_local_source,
    load_hub_rows,
    read_local_file,
)
from nemo_rl.data.errors import DataError
from nemo_rl.data.interfaces import ChatMessage, Record, TaskDataSpec
from nemo_rl.data.processors import math_processor
from nemo_rl.data.tiny import tiny_math_splits

_GSM8K_SEPARATOR = "####"
# Thousands separators inside a number ("1,000"), which math answers checkers read as a tuple.
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def gsm8k_final_answer(solution: str) -> str | None:
    """The final answer of a GSM8K solution: the text after ``####``, without thousands separators."""
    if _GSM8K_SEPARATOR not in solution:
        return None
    return _THOUSANDS_COMMA.sub("", solution.rsplit(_GSM8K_SEPARATOR, 1)[1].strip())


@dataclasses.dataclass(frozen=True)
class EvalDatasetSchema:
    """Where a built-in benchmark lives on the hub and which columns hold the problem and the answer."""

    hub_name: str
    """Hub dataset name."""

    subsets: tuple[str | None, ...]
    """Hub configurations read and concatenated in this order (``None``: the default one)."""

    split: str
    """Hub split holding the test problems."""

    problem_key: str
    """Column of the problem statement."""

    answer_key: str
    """Column of the reference answer."""

    parse_answer: Callable[[str], str | None] | None = None
    """Turns the answer column into the bare answer (``None``: use it as is); returning ``None`` marks a
    malformed row."""


EVAL_DATASET_SCHEMAS: dict[str, EvalDatasetSchema] = {
    "aime2024": EvalDatasetSchema("HuggingFaceH4/aime_2024", (None,), "train", "problem", "answer"),
    "aime2025": EvalDatasetSchema(
        "opencompass/AIME2025", ("AIME2025-I", "AIME2025-II"), "test", "question", "answer"
    ),
    "math500": EvalDatasetSchema("HuggingFaceH4/MATH-500", (None,), "test", "problem", "answer"),
    "gsm8k": EvalDatasetSchema(
        "openai/gsm8k", ("main",), "test", "question", "answer", parse_answer=gsm8k_final_answer
    ),
}
"""The built-in benchmarks other than ``tiny_math`` (which is generated)."""


def problem_answer_converter(
    source: str,
    problem_key: str,
    answer_key: str,
    parse_answer: Callable[[str], str | None] | None = None,
) -> RowConverter:
    """Rows with a problem column and an answer column -> a user turn and its ``expected_answer``."""
    schema = f"{problem_key!r} (the problem) and {answer_key!r} (the answer)"

    def convert(row: Mapping[str, Any], index: int) -> Record:
        if not isinstance(row, Mapping):
            raise MalformedRowError(source, index, f"is a {type(row).__name__}, not an object", schema)
        values = {}
        for key in (problem_key, answer_key):
            value = row.get(key)
            if value is None:
                raise MalformedRowError(source, index, f"has no {key!r} (it has {sorted(row)})", schema)
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise MalformedRowError(
                    source, index, f"has {key!r} of type {type(value).__name__}, expected a string", schema
                )
            values[key] = str(value)
        parsed = values[answer_key].strip() if parse_answer is None else parse_answer(values[answer_key])
        if parsed is None:
            raise MalformedRowError(
                source, index, f"has an {answer_key!r} whose final answer cannot be read", schema
            )
        answer: str = parsed
        return Record(
            messages=[ChatMessage(role="user", content=values[problem_key])], expected_answer=answer
        )

    return convert


def _source_dataset(
    path_or_name: str,
    converter_of: Callable[[str], RowConverter],
    *,
    key: str,
    subsets: Sequence[str | None],
    split: str,
) -> RecordDataset:
    """The records of a local file, or of the hub dataset's configurations concatenated; ``converter_of`` makes
    the row converter from the description of the source, ``key`` is the config key that names it."""
    if is_local_source(path_or_name):
        local = read_local_file(path_or_name, key=key)
        return RecordDataset(local.rows, converter_of(path_or_name), path_or_name, lines=local.lines)
    rows: list[Any] = []
    for subset in subsets:
        rows += list(load_hub_rows(path_or_name, split, subset, key=key))
    parts = "" if subsets == (None,) else f" {'+'.join(str(s) for s in subsets)}"
    source = f"{path_or_name}{parts} (hub split {split})"
    return RecordDataset(rows, converter_of(source), source)


def load_eval_records(cfg: EvalDataConfig) -> RecordDataset:
    """The benchmark's records (every row checked), cut to ``data.max_num_problems``."""
    name = cfg.builtin_name
    if cfg.multimodal:
        # Its prompts hold images, which only the model's own processor reads.
        raise DataError(
            f"data.dataset_name={cfg.dataset_name} holds images: read it with "
            "nemo_rl.data.vlm_prompts.setup_vlm_eval_data (examples/run_eval.py does)"
        )
    if name == "tiny_math":
        _, rows = tiny_math_splits(
            0, cfg.num_val_samples, seed=cfg.seed, max_operand=cfg.tiny_math_max_operand
        )
        dataset = RecordDataset(rows, math_converter("tiny_math (held-out)"), "tiny_math (held-out)")
    elif name is not None:
        schema = EVAL_DATASET_SCHEMAS[name]
        dataset = _source_dataset(
            cfg.data_path or schema.hub_name,
            lambda source: problem_answer_converter(
                source, schema.problem_key, schema.answer_key, schema.parse_answer
            ),
            key="data.data_path" if cfg.data_path else "data.dataset_name",
            subsets=schema.subsets if cfg.data_path is None else (None,),
            split=cfg.split or schema.split,
        )
    else:
        dataset = _source_dataset(
            cfg.dataset_name,
            lambda source: problem_answer_converter(source, cfg.problem_key, cfg.solution_key),
            key="data.dataset_name",
            subsets=(None,),
            split=cfg.split or "test",
        )
    if not len(dataset):
        raise DataError(f"{dataset.source} holds no problems: check data.dataset_name / data.split")
    if cfg.max_num_problems is not None:
        dataset = RecordDataset(
            dataset.rows,
            dataset.converter,
            dataset.source,
            dataset.indices[: cfg.max_num_problems],
            lines=dataset.lines,
        )
    dataset.validate()
    return dataset


def setup_eval_data(
    cfg: EvalDataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_total_sequence_length: int,
    tools: Sequence[dict[str, Any]] = (),
) -> ProcessedDataset:
    """The benchmark's prompts for ``data.env_name`` (prompt template and system prompt applied, declaring
    ``tools``: the JSON schemas of ``env.<data.env_name>.tools``), cut at ``data.max_input_seq_length`` (or
    ``max_total_sequence_length``)."""
    spec = TaskDataSpec.from_prompt_files(
        task_name=cfg.env_name,
        prompt_file=cfg.prompt_file,
        system_prompt_file=cfg.system_prompt_file,
        add_bos=cfg.add_bos,
    )
    spec = dataclasses.replace(spec, tools=tuple(tools))
    return ProcessedDataset(
        load_eval_records(cfg),
        math_processor,
        spec,
        tokenizer,
        cfg.max_input_seq_length or max_total_sequence_length,
    )


__all__ = [
    "EVAL_DATASET_SCHEMAS",
    "LOCAL_SUFFIXES",
    "EvalDatasetSchema",
    "gsm8k_final_answer",
    "load_eval_records",
    "problem_answer_converter",
    "setup_eval_data",
]
