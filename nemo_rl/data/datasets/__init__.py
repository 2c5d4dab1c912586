"""Datasets: raw rows (hub or local file) -> canonical records -> processed samples (message logs).

Typical use by an algorithm's ``setup``::

    tokenizer = get_policy_tokenizer(master.policy)
    train_ds, val_ds = setup_rl_data(master.data, tokenizer, max_total_sequence_length=...)
    loader = StatefulDataLoader(train_ds, batch_size=..., shuffle=master.data.shuffle, seed=master.data.seed,
                                drop_last=True, collate_fn=rl_collate_fn)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl.config.data import PREFERENCE_DATASETS, DataConfig
from nemo_rl.config.errors import UserError
from nemo_rl.data.datasets.formats import MalformedRowError, RowConverter, converter_for
from nemo_rl.data.datasets.lazy import LazySequence
from nemo_rl.data.datasets.loading import (
    DatasetSplits,
    RecordDataset,
    load_dataset_splits,
    load_hub_rows,
    read_local_rows,
)
from nemo_rl.data.interfaces import DatumSpec, Processor, Record, TaskDataSpec
from nemo_rl.data.processors import math_processor, preference_processor, sft_processor

__all__ = [
    "DatasetSplits",
    "MalformedRowError",
    "ProcessedDataset",
    "RecordDataset",
    "RowConverter",
    "converter_for",
    "dataset_task_names",
    "load_dataset_splits",
    "load_hub_rows",
    "prompt_groups",
    "read_local_rows",
    "setup_data",
    "setup_preference_data",
    "setup_rl_data",
    "setup_sft_data",
]


@dataclasses.dataclass(eq=False)
class ProcessedDataset(LazySequence[DatumSpec]):
    """Records turned into samples by a processor, on access (each sample is tokenized when read)."""

    records: Sequence[Record]
    """The raw rows."""

    processor: Processor
    """Turns one row into a sample (``processor(record, spec, tokenizer, max_seq_length, idx)``)."""

    spec: TaskDataSpec
    """The task's prompt and system-prompt settings and its ``task_name``."""

    tokenizer: PreTrainedTokenizerBase
    """Tokenizes the samples."""

    max_seq_length: int
    """The processor's length limit."""

    def __len__(self) -> int:
        return len(self.records)

    def _item(self, i: int) -> DatumSpec:
        return self.processor(self.records[i], self.spec, self.tokenizer, self.max_seq_length, i)

    @property
    def source(self) -> str:
        """Where the records come from (a file, a hub dataset and split, a generator), as messages name it."""
        return self.records.source if isinstance(self.records, RecordDataset) else "in-memory records"

    @property
    def task_names(self) -> set[str]:
        """The ``task_name`` of every sample (one task per processed dataset)."""
        return {self.spec.task_name}


def prompt_groups(dataset: ProcessedDataset, max_size: int) -> list[list[int]]:
    """The sample indices of ``dataset`` grouped by identical prompts (every message but the last), each
    prompt's cut into groups of at most ``max_size``, in order of first appearance: a preference dataset's
    pairs of one prompt, for a loader that serves a group together."""
    by_prompt: dict[str, list[int]] = {}
    for i, record in enumerate(dataset.records):
        key = json.dumps(record["messages"][:-1], sort_keys=True, default=str)
        by_prompt.setdefault(key, []).append(i)
    return [rows[i : i + max_size] for rows in by_prompt.values() for i in range(0, len(rows), max_size)]


def dataset_task_names(dataset: Sequence[DatumSpec] | None) -> set[str]:
    """The ``task_name`` values of ``dataset``'s samples (none for ``None``).

    A :class:`ProcessedDataset` (or any dataset with a ``task_names`` attribute) answers without reading
    its samples; any other sequence of samples is read once.
    """
    if dataset is None:
        return set()
    known = getattr(dataset, "task_names", None)
    if known is not None:
        return set(known)
    names: set[str] = set()
    for index, sample in enumerate(dataset):
        if "task_name" not in sample:
            raise UserError(
                f"sample {index} of the dataset has no 'task_name' (keys: {sorted(sample)}); every RL sample "
                "names the task (environment) that scores it"
            )
        names.add(sample["task_name"])
    return names


def setup_data(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    processor: Processor,
    task_name: str,
    max_seq_length: int,
    tools: Sequence[dict[str, Any]] = (),
) -> tuple[ProcessedDataset, ProcessedDataset | None]:
    """Training and validation datasets of the ``data`` section, processed by ``processor``, their
    conversations declaring ``tools`` (JSON schemas). Multimodal data is refused: its processors are
    ``nemo_rl.data.vlm``'s and ``nemo_rl.data.vlm_prompts``' (``examples/run_vlm_sft.py``,
    ``examples/run_vlm_grpo.py``)."""
    if cfg.multimodal:
        raise UserError(
            f"data.dataset_name={cfg.dataset_name} (processor {cfg.processor}) holds images, which only "
            "examples/run_vlm_sft.py (SFT) and examples/run_vlm_grpo.py (GRPO) read (DPO, reward models, PPO "
            "and distillation on images are not built): run one of those"
        )
    splits = load_dataset_splits(cfg)
    spec = TaskDataSpec.from_config(cfg, task_name=task_name, tools=tools)
    train = ProcessedDataset(splits.train, processor, spec, tokenizer, max_seq_length)
    validation = (
        None
        if splits.validation is None
        else ProcessedDataset(splits.validation, processor, spec, tokenizer, max_seq_length)
    )
    return train, validation


def setup_rl_data(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_total_sequence_length: int,
    tools: Sequence[dict[str, Any]] = (),
) -> tuple[ProcessedDataset, ProcessedDataset | None]:
    """Math prompts for RL, cut at ``data.max_input_seq_length`` (or the policy's ``max_total_sequence_length``
    when unset); their task (the environment scoring them) is ``data.env_name``, by default ``"math"``. The
    prompts declare ``tools`` (the JSON schemas of the task's ``env.<task>.tools``; see
    :func:`nemo_rl.environments.tools.build_task_tools`).

    The first :data:`PROMPT_CHECK_SAMPLES` training prompts are read now, so bad rows and prompts too long
    to leave room for a response fail here, before any worker starts (see :func:`check_prompt_lengths`).
    """
    train, val = setup_data(
        cfg,
        tokenizer,
        processor=math_processor,
        task_name=cfg.env_name or "math",
        max_seq_length=cfg.max_input_seq_length or max_total_sequence_length,
        tools=tools,
    )
    limit_key = (
        f"data.max_input_seq_length={cfg.max_input_seq_length}"
        if cfg.max_input_seq_length
        else f"policy.max_total_sequence_length={max_total_sequence_length}"
    )
    check_prompt_lengths(train, max_total_sequence_length, limit_key)
    return train, val


PROMPT_CHECK_SAMPLES = 1000
"""How many training prompts :func:`setup_rl_data` reads at start-up to check them."""


def check_prompt_lengths(dataset: ProcessedDataset, max_total_sequence_length: int, limit_key: str) -> int:
    """Count the prompts among the first :data:`PROMPT_CHECK_SAMPLES` of ``dataset`` that leave no room for
    a response (cut for length, or as long as ``max_total_sequence_length``); returns the count.

    None fitting raises :class:`UserError` naming ``limit_key``; some not fitting prints a warning with the
    count (they are generated for but never trained on).
    """
    num_checked = min(len(dataset), PROMPT_CHECK_SAMPLES)
    num_too_long = 0
    for i in range(num_checked):
        sample = dataset[i]
        if sample["loss_multiplier"] == 0 or sample["length"] >= max_total_sequence_length:
            num_too_long += 1
    if num_checked and num_too_long == num_checked:
        raise UserError(
            f"none of the first {num_checked} training prompts leaves room for a response within {limit_key}; "
            "raise it"
        )
    if num_too_long:
        print(
            f"WARNING: {num_too_long} of the first {num_checked} training prompts leave no room for a response "
            f"within {limit_key}; they are cut and never trained on",
            flush=True,
        )
    return num_too_long


def setup_sft_data(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, *, max_total_sequence_length: int
) -> tuple[ProcessedDataset, ProcessedDataset | None]:
    """Whole conversations for SFT (task ``"sft"``); the collate function truncates them to
    ``data.max_input_seq_length`` (or ``max_total_sequence_length``)."""
    return setup_data(
        cfg,
        tokenizer,
        processor=sft_processor,
        task_name="sft",
        max_seq_length=cfg.max_input_seq_length or max_total_sequence_length,
    )


def setup_preference_data(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, *, max_total_sequence_length: int
) -> tuple[ProcessedDataset, ProcessedDataset | None]:
    """Chosen/rejected conversation pairs for DPO and reward models (task ``"preference"``); the collate
    function truncates them to ``data.max_input_seq_length`` (or ``max_total_sequence_length``)."""
    if cfg.dataset_name not in PREFERENCE_DATASETS:
        raise ValueError(
            f"preference training needs data.dataset_name to be one of {', '.join(PREFERENCE_DATASETS)}; got "
            f"{cfg.dataset_name}"
        )
    return setup_data(
        cfg,
        tokenizer,
        processor=preference_processor,
        task_name="preference",
        max_seq_length=cfg.max_input_seq_length or max_total_sequence_length,
    )
