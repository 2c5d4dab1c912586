"""Reading raw rows from local files or the hub, and the train/validation split of the ``data`` section."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nemo_rl.config.data import DataConfig, DatasetName
from nemo_rl.data.datasets.formats import MalformedRowError, RowConverter, converter_for
from nemo_rl.data.datasets.lazy import LazySequence
from nemo_rl.data.errors import DataError, MissingDataFileError
from nemo_rl.data.interfaces import Record
from nemo_rl.data.tiny import tiny_math_splits
from nemo_rl.utils.files import existing_file, named, read_utf8

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclasses.dataclass(frozen=True)
class HubSource:
    """Where a dataset with a hub default lives."""

    name: str
    """Hub dataset name."""

    train_split: str
    """Split used for training unless ``data.split`` names another."""

    val_split: str | None
    """Split used for validation when no ``data.val_data_path`` is given (``None``: the dataset has none)."""

    subset: str | None = None
    """Hub subset (configuration) unless ``data.subset`` names another."""


HUB_DEFAULTS: dict[str, HubSource] = {
    "OpenMathInstruct-2": HubSource("nvidia/OpenMathInstruct-2", "train_1M", None),
    "squad": HubSource("rajpurkar/squad", "train", "validation"),
    "HelpSteer3": HubSource("nvidia/HelpSteer3", "train", "validation", subset="preference"),
    "Tulu3Preference": HubSource("allenai/llama-3.1-tulu-3-8b-preference-mixture", "train", None),
    "DAPOMath17K": HubSource("BytedTsinghua-SIA/DAPO-Math-17k", "train", None),
    "DAPOMathAIME2024": HubSource("BytedTsinghua-SIA/AIME-2024", "train", None),
    "DeepScaler": HubSource("agentica-org/DeepScaleR-Preview-Dataset", "train", None),
    "AIME2024": HubSource("HuggingFaceH4/aime_2024", "train", None),
    "clevr-cogent": HubSource("MMInstruction/Clevr_CoGenT_TrainA_70K_Complex", "train", None),
}
"""Hub source of each dataset that has one."""


class RecordDataset(LazySequence[Record]):
    """Raw rows seen as canonical records, converted on access (so hub datasets stay lazy).

    ``indices`` selects and orders the rows; a malformed row raises with its index in the source and, when
    ``lines`` gives the line each row is on (a JSON Lines or CSV file), that line.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        converter: RowConverter,
        source: str,
        indices: Sequence[int] | None = None,
        *,
        lines: Sequence[int] | None = None,
    ) -> None:
        self.rows = rows
        self.converter = converter
        self.source = source
        self.indices = list(range(len(rows))) if indices is None else list(indices)
        self.lines = lines

    def __len__(self) -> int:
        return len(self.indices)

    def _item(self, i: int) -> Record:
        row_index = self.indices[i]
        try:
            return self.converter(self.rows[row_index], row_index)
        except MalformedRowError as err:
            if self.lines is None:
                raise
            # The converter knows the row; only the file's reader knew the line it is on.
            raise err.at_line(self.lines[row_index]) from None

    def validate(self) -> None:
        """Convert every row once, raising on the first malformed one."""
        for _ in self:
            pass

    def split(self, val_fraction: float, seed: int) -> tuple[RecordDataset, RecordDataset]:
        """A seeded random split into (train, validation), the validation part holding ``val_fraction`` of
        the rows (at least one), both keeping the source order."""
        num_val = max(1, math.floor(len(self) * val_fraction))
        if num_val >= len(self):
            raise DataError(
                f"{self.source} has {len(self)} rows, too few to hold out {num_val} for validation: give "
                "data.val_data_path, lower data.val_fraction, or set it to 0 for no validation"
            )
        order = np.random.default_rng(seed).permutation(len(self))
        val_positions = set(order[:num_val].tolist())
        train = [r for p, r in enumerate(self.indices) if p not in val_positions]
        val = [r for p, r in enumerate(self.indices) if p in val_positions]
        return self._with_indices(train), self._with_indices(val)

    def repeated(self, times: int) -> RecordDataset:
        """The rows ``times`` over, in order (all of them, then all again)."""
        return self._with_indices(self.indices * times)

    def _with_indices(self, indices: Sequence[int]) -> RecordDataset:
        return RecordDataset(self.rows, self.converter, self.source, indices, lines=self.lines)


@dataclasses.dataclass(frozen=True)
class DatasetSplits:
    """Training and (optional) validation records of a dataset."""

    train: RecordDataset
    validation: RecordDataset | None


@dataclasses.dataclass(frozen=True)
class LocalRows:
    """The rows of a local data file and, where the format has lines, the line each row is on."""

    rows: list[Any]
    """The rows as read (a malformed one is reported when it is converted)."""

    lines: list[int] | None
    """1-based line of each row (JSON Lines; CSV: the line a row ends on); ``None`` for a JSON array and
    Parquet, whose errors name the row."""


def read_local_rows(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """Rows of a local ``.jsonl`` / ``.json`` (JSON Lines, or one JSON array), ``.parquet`` or ``.csv`` (with a
    header row; every value is a string) file."""
    return read_local_file(path, key=None).rows


def read_local_file(path: str | pathlib.Path, *, key: str | None) -> LocalRows:
    """Rows of a local data file (see :func:`read_local_rows`) with their line numbers.

    Every defect of the file itself is a :class:`DataError` (or :class:`MissingDataFileError`) that names the
    file, with ``key`` (the config key naming it, when given) or the line at fault: no such file, a directory,
    an unsupported suffix, bytes that are not UTF-8, a line that is not JSON, a CSV row with more fields than
    the header, no rows at all.
    """
    file = existing_file(path, key=key, kind=f"data file ({', '.join(LOCAL_SUFFIXES)})")
    if file.suffix not in LOCAL_SUFFIXES:
        raise DataError(
            f"{named(path, key)}: unsupported data file type {file.suffix!r}; use one of {LOCAL_SUFFIXES}"
        )
    if file.suffix == ".parquet":
        loaded = LocalRows(_read_parquet(file), None)
    elif file.suffix == ".csv":
        loaded = _read_csv(file)
    else:
        loaded = _read_json(file)
    if not loaded.rows:
        raise DataError(f"{named(path, key)} holds no rows: give a file with at least one row")
    return loaded


def _read_parquet(file: pathlib.Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows: list[dict[str, Any]] = pq.read_table(file).to_pylist()
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{file} is not a readable Parquet file ({err})") from err
    return rows


def _read_csv(file: pathlib.Path) -> LocalRows:
    reader = csv.DictReader(io.StringIO(read_utf8(file), newline=""))
    rows, lines = [], []
    for row in reader:
        if None in row:  # DictReader files the values past the header's last column under None
            raise DataError(
                f"{file}: line {reader.line_num} has {len(reader.fieldnames or []) + len(row[None])} fields, "
                f"more than the header's {len(reader.fieldnames or [])}: quote values that hold commas"
            )
        rows.append(dict(row))
        lines.append(reader.line_num)
    return LocalRows(rows, lines)


def _read_json(file: pathlib.Path) -> LocalRows:
    text = read_utf8(file)
    if text.lstrip().startswith("["):
        try:
            return LocalRows(list(json.loads(text)), None)
        except json.JSONDecodeError as err:
            raise DataError(f"{file} is not a valid JSON array ({err})") from err
    rows, lines = [], []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise DataError(
                f"{file}: line {line_number} is not valid JSON ({err}); a {file.suffix} file holds one JSON "
                "object per line (or one JSON array)"
            ) from err
        lines.append(line_number)
    return LocalRows(rows, lines)


def load_hub_rows(
    name: str, split: str, subset: str | None = None, *, key: str
) -> Sequence[Mapping[str, Any]]:
    """Split ``split`` of the hub dataset ``name`` (subset ``subset``); downloads it, so this needs network
    access or a cache.

    Raises:
        MissingDataFileError: the hub has no such dataset, split or subset, or cannot be reached; the message
            names ``key``, the config key that gave ``name``.
    """
    import datasets

    try:
        dataset = datasets.load_dataset(name, subset, split=split)
    except (FileNotFoundError, ConnectionError, ValueError) as err:
        # ValueError: an unknown split or subset, both config values.
        cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
        what = f"split {split!r}" + (f", subset {subset!r}" if subset else "")
        raise MissingDataFileError(
            f"{key}: the hub dataset {name} ({what}) cannot be loaded ({type(err).__name__}: {cause}): give "
            f"the path of a local {'/'.join(LOCAL_SUFFIXES)} file (none exists at {name}), or a hub dataset name "
            "with network access or a cached copy"
        ) from err
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"hub dataset {name} split {split} loaded as {type(dataset).__name__}, not a Dataset")
    return dataset


def is_local_source(path: str) -> bool:
    """Whether ``path`` names a local file rather than a hub dataset: it exists, has a data file suffix, or
    cannot be a hub name (``org/name``): an absolute path, one starting with ``./``, ``../`` or ``~``, or one
    with more than one ``/``."""
    return (
        pathlib.Path(path).exists()
        or path.endswith(LOCAL_SUFFIXES)
        or path.startswith(("/", "./", "../", "~"))
        or path.count("/") > 1
    )


def _load_source(
    cfg: DataConfig,
    path_or_name: str,
    *,
    key: str,
    hub_split: str,
    hub_subset: str | None,
    dataset_name: DatasetName | None = None,
) -> RecordDataset:
    """The records of a local file or hub dataset in the schema of ``dataset_name`` (by default
    ``cfg.dataset_name``); ``key`` is the config key that names it."""
    if is_local_source(path_or_name):
        local = read_local_file(path_or_name, key=key)
        converter = converter_for(cfg, source=path_or_name, dataset_name=dataset_name)
        dataset = RecordDataset(local.rows, converter, path_or_name, lines=local.lines)
        # Local files are small enough to check whole: a bad row fails now, not mid-training.
        dataset.validate()
        return dataset
    subset = f" subset {hub_subset}" if hub_subset else ""
    source = f"{path_or_name} (hub{subset} split {hub_split})"
    rows = load_hub_rows(path_or_name, hub_split, hub_subset, key=key)
    return RecordDataset(rows, converter_for(cfg, source=source, dataset_name=dataset_name), source)


def _separate_validation(cfg: DataConfig, name: DatasetName) -> RecordDataset:
    """The records of ``data.val_dataset_name`` (``name``, another dataset than the training data's): its
    ``val_data_path``, else its hub default's validation split, else its whole usual split."""
    hub = HUB_DEFAULTS.get(name)
    split = "validation" if hub is None else hub.val_split or hub.train_split
    subset = hub.subset if hub is not None else None
    if cfg.val_data_path is not None:
        path, key = cfg.val_data_path, "data.val_data_path"
    else:
        assert hub is not None  # DataConfig requires val_data_path for datasets without a hub default
        path, key = hub.name, "data.val_dataset_name"
    return _load_source(cfg, path, key=key, hub_split=split, hub_subset=subset, dataset_name=name)


def load_dataset_splits(cfg: DataConfig) -> DatasetSplits:
    """The training and validation records described by the ``data`` section.

    Validation comes from ``data.val_dataset_name`` when it names a dataset of its own, else
    ``data.val_data_path``, else the dataset's own validation split, else a seeded ``data.val_fraction``
    hold-out of the training data (none when the fraction is 0); it is repeated ``data.val_repeat`` times.
    """
    val_name = cfg.separate_val_dataset
    # A validation dataset of its own replaces the training data's validation: no hold-out, the whole
    # training data trains.
    splits = _training_splits(cfg, with_validation=val_name is None)
    validation = _separate_validation(cfg, val_name) if val_name else splits.validation
    if validation is not None and cfg.val_repeat > 1:
        validation = validation.repeated(cfg.val_repeat)
    return DatasetSplits(train=splits.train, validation=validation)


def _generated_splits(cfg: DataConfig, *, with_validation: bool) -> DatasetSplits | None:
    """The splits of a dataset generated on the fly (``tiny_math``, ``tiny_math_preference``, ``tiny_clevr``);
    ``None`` for one read from files or the hub."""
    name = cfg.dataset_name
    train_rows: Sequence[Mapping[str, Any]]
    val_rows: Sequence[Mapping[str, Any]]
    if name in ("tiny_math", "tiny_math_preference"):
        train_rows, val_rows = tiny_math_splits(
            cfg.num_train_samples,
            cfg.num_val_samples,
            seed=cfg.seed,
            max_operand=cfg.tiny_math_max_operand,
            preferences=name == "tiny_math_preference",
            rejected_per_problem=cfg.tiny_math_rejected_per_problem,
        )
    elif name == "tiny_clevr":
        # Imported here: tiny_clevr's rows are a LazySequence of this package, which imports this module.
        from nemo_rl.data.tiny_clevr import tiny_clevr_splits

        train_rows, val_rows = tiny_clevr_splits(
            cfg.num_train_samples,
            cfg.num_val_samples,
            seed=cfg.seed,
            image_size=cfg.tiny_clevr_image_size,
            max_objects=cfg.tiny_clevr_max_objects,
        )
    else:
        return None
    converter = converter_for(cfg, source=name)
    return DatasetSplits(
        train=RecordDataset(train_rows, converter, f"{name} (train)"),
        validation=RecordDataset(val_rows, converter, f"{name} (validation)")
        if len(val_rows) and with_validation
        else None,
    )


def _training_splits(cfg: DataConfig, *, with_validation: bool) -> DatasetSplits:
    """The training records of the ``data`` section and, ``with_validation``, the validation records that
    come with them."""
    generated = _generated_splits(cfg, with_validation=with_validation)
    if generated is not None:
        return generated
    name = cfg.dataset_name
    hub = HUB_DEFAULTS.get(name)
    subset = cfg.subset or (hub.subset if hub is not None else None)
    if cfg.train_data_path is not None:
        train = _load_source(
            cfg,
            cfg.train_data_path,
            key="data.train_data_path",
            hub_split=cfg.split or "train",
            hub_subset=subset,
        )
    else:
        assert hub is not None  # DataConfig requires train_data_path for datasets without a hub default
        train = _load_source(
            cfg, hub.name, key="data.dataset_name", hub_split=cfg.split or hub.train_split, hub_subset=subset
        )

    if not with_validation:
        validation: RecordDataset | None = None
    elif name == "clevr-cogent" and cfg.val_data_path is None:
        # Each of CLEVR-CoGenT's validation sets is a hub dataset of its own, held in its "train" split.
        val_name = f"MMInstruction/Clevr_CoGenT_{(cfg.val_split or 'valA').capitalize()}"
        validation = _load_source(cfg, val_name, key="data.val_split", hub_split="train", hub_subset=None)
    elif cfg.val_data_path is not None:
        validation = _load_source(
            cfg, cfg.val_data_path, key="data.val_data_path", hub_split="validation", hub_subset=subset
        )
    elif cfg.train_data_path is None and hub is not None and hub.val_split is not None:
        validation = _load_source(
            cfg, hub.name, key="data.dataset_name", hub_split=hub.val_split, hub_subset=subset
        )
    elif cfg.val_fraction > 0:
        train, validation = train.split(cfg.val_fraction, seed=cfg.seed)
    else:
        validation = None
    return DatasetSplits(train=train, validation=validation)
