"""Atomic training checkpoints with top-k retention.

Layout under ``checkpointing.checkpoint_dir``::

    step_10/                 complete checkpoint (atomically renamed from tmp_step_10)
        training_info.json   step, metrics and loop state chosen by the algorithm
        config.yaml          the run's config
        run_state.pt         the state of every object registered with track() (RNG, generation seeds...)
        policy/ ...          written by the caller (weights, optimizer, dataloader state)
        MANIFEST.json        size of every file (and a CRC-32 of the small ones), written last
    tmp_step_20/             a save in progress (or left by a crash): never read, removed on the next save

A save is ``path = init_tmp_checkpoint(step, info, config)``, the caller writes its state under ``path``,
then ``finalize_checkpoint(path)`` writes the manifest, fsyncs everything and renames the directory to
``step_N``. A crash before the rename leaves only a ``tmp_step_*`` directory, so
:meth:`CheckpointManager.get_latest_checkpoint_path` always returns a complete checkpoint. Pruning renames a
checkpoint to ``tmp_step_*`` before deleting it, so a crash mid-delete never leaves a half checkpoint under a
``step_N`` name either. A checkpoint damaged later (a file truncated or changed on disk) fails
:meth:`CheckpointManager.check_intact`, and :meth:`CheckpointManager.latest_intact_checkpoint` falls back to
the one before it.

Objects registered with :meth:`CheckpointManager.track` (anything with ``state_dict`` / ``load_state_dict``)
are saved into every checkpoint and, in a resumed run, put back when they are registered.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import yaml
from pydantic import BaseModel

from nemo_rl.config.checkpointing import CheckpointingConfig

TRAINING_INFO_FILE = "training_info.json"
CONFIG_FILE = "config.yaml"
RUN_STATE_FILE = "run_state.pt"
MANIFEST_FILE = "MANIFEST.json"
_STEP_DIR_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = "tmp_step_"
# Files up to this size get a CRC-32 in the manifest (metadata, states); larger ones (weights) only a size,
# so that finalising a multi-gigabyte checkpoint does not read it all back.
_CHECKSUM_MAX_BYTES = 1 << 20


class Checkpointable(Protocol):
    """Something whose state a checkpoint records: a data loader, an RNG, a generation seed counter."""

    def state_dict(self) -> Mapping[str, Any]:
        """The state to save (tensors, numbers, strings, lists, tuples and dicts of them)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned."""
        ...


class CheckpointDamagedError(RuntimeError):
    """A checkpoint's files do not match what was written when it was saved."""


def _json_default(value: Any) -> Any:
    """JSON encoding of numpy / torch scalars, which training loops often put into ``training_info``."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(
        f"training_info value of type {type(value).__name__} is not JSON-serialisable; "
        "store plain numbers, strings, lists or dicts."
    )


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` to disk, so the rename publishes durable data."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Creates, finalises, lists and prunes checkpoints under ``cfg.checkpoint_dir``."""

    def __init__(self, cfg: CheckpointingConfig) -> None:
        self.cfg = cfg
        self.checkpoint_dir = Path(cfg.checkpoint_dir)
        self.resume_path: Path | None = None
        """The checkpoint this run resumed from (set by whoever resumes, e.g.
        ``nemo_rl.algorithms.loop.find_resume``); :meth:`track` restores objects from it."""
        self._tracked: dict[str, Checkpointable] = {}
        self._resume_state: dict[str, Any] | None = None

    # ------------------------------------------------------------ run state
    def track(self, name: str, obj: Checkpointable, *, optional: bool = False) -> None:
        """Save ``obj.state_dict()`` under ``name`` in every checkpoint and, when this run resumed
        (:attr:`resume_path` is set), put back the state that checkpoint holds for ``name`` now.

        ``name`` must be unique and stable across runs (it is the key in ``run_state.pt``). A checkpoint with
        no state for ``name`` (saved before the object was tracked) leaves ``obj`` as it is, with a warning
        unless ``optional`` (state that only some runs have, such as what asynchronous GRPO sampled ahead).
        """
        if name in self._tracked:
            if self._tracked[name] is not obj:
                raise ValueError(f"another object is already tracked under the name {name!r}")
            return
        self._tracked[name] = obj
        if self.resume_path is None:
            return
        if self._resume_state is None:
            state_path = self.resume_path / RUN_STATE_FILE
            self._resume_state = torch.load(state_path, weights_only=True) if state_path.is_file() else {}
        if name in self._resume_state:
            obj.load_state_dict(self._resume_state[name])
        elif not optional:
            print(
                f"WARNING: {self.resume_path} holds no saved state for {name!r}; it starts afresh, so the "
                "resumed run will not repeat the uninterrupted one exactly",
                flush=True,
            )

    # ---------------------------------------------------------------- saving
    def should_save(self, step: int) -> bool:
        """Whether ``step`` (1-based count of finished training steps) is due for a periodic save."""
        return self.cfg.enabled and step > 0 and step % self.cfg.save_period == 0

    def init_tmp_checkpoint(
        self,
        step: int,
        training_info: Mapping[str, Any],
        run_config: Mapping[str, Any] | BaseModel | None = None,
    ) -> Path:
        """Create ``tmp_step_<step>`` for the caller to write its state into, and return its path.

        ``training_info`` (JSON-serialisable: step counters, metrics, dataloader position...) and
        ``run_config`` (a dict or a pydantic config) are written into it as ``training_info.json`` and
        ``config.yaml``. Leftovers of interrupted saves are removed first.
        """
        if step < 0:
            raise ValueError(f"Checkpoint step must be >= 0, got {step}.")
        self._require_metric(training_info, where=f"training_info of step {step}")
        # Serialise before touching the disk, so bad input leaves no directory behind.
        info_text = json.dumps({"step": step, **training_info}, indent=2, default=_json_default)
        if isinstance(run_config, BaseModel):
            run_config = run_config.model_dump(mode="json")
        config_text = None if run_config is None else yaml.safe_dump(dict(run_config), sort_keys=False)

        run_state = {name: obj.state_dict() for name, obj in self._tracked.items()}

        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self._remove_tmp_dirs()
        tmp_path = self.checkpoint_dir / f"{_TMP_PREFIX}{step}"
        tmp_path.mkdir()
        (tmp_path / TRAINING_INFO_FILE).write_text(info_text)
        if config_text is not None:
            (tmp_path / CONFIG_FILE).write_text(config_text)
        if run_state:
            torch.save(run_state, tmp_path / RUN_STATE_FILE)
        return tmp_path

    def finalize_checkpoint(self, tmp_path: Path | str) -> Path:
        """Make ``tmp_path`` durable, rename it to ``step_<N>`` atomically, prune, and return the new path.

        A checkpoint of the same step that already exists (a re-run of that step) is replaced.
        """
        tmp_path = Path(tmp_path)
        name = tmp_path.name
        if not name.startswith(_TMP_PREFIX) or not (tmp_path / TRAINING_INFO_FILE).is_file():
            raise ValueError(
                f"{tmp_path} is not a checkpoint in progress; pass the path returned by init_tmp_checkpoint()."
            )
        final_path = tmp_path.parent / name.removeprefix("tmp_")
        _write_manifest(tmp_path)
        _fsync_tree(tmp_path)
        if final_path.exists():
            # Move the old one aside first: rename cannot replace a non-empty directory, and the
            # tmp_ name guarantees a crash between the two renames never exposes a half-deleted checkpoint.
            stale_path = tmp_path.parent / f"{_TMP_PREFIX}stale_{final_path.name}"
            os.rename(final_path, stale_path)
            os.rename(tmp_path, final_path)
            shutil.rmtree(stale_path)
        else:
            os.rename(tmp_path, final_path)
        _fsync_dir(final_path.parent)
        self._prune()
        return final_path

    # --------------------------------------------------------------- reading
    def list_checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, path)``, oldest first."""
        if not self.checkpoint_dir.is_dir():
            return []
        found = []
        for entry in self.checkpoint_dir.iterdir():
            match = _STEP_DIR_RE.match(entry.name)
            if match and entry.is_dir() and (entry / TRAINING_INFO_FILE).is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def get_latest_checkpoint_path(self) -> Path | None:
        """The complete checkpoint with the highest step, or ``None`` when there is none."""
        checkpoints = self.list_checkpoints()
        return checkpoints[-1][1] if checkpoints else None

    @staticmethod
    def check_intact(path: Path | str) -> str | None:
        """What is wrong with checkpoint ``path`` (``None`` when its files are as saved).

        Checks that ``training_info.json`` parses and that every file of the manifest has its saved size (and,
        for small files, its CRC-32). Checkpoints saved before manifests existed are only checked for the
        training info.
        """
        path = Path(path)
        try:
            json.loads((path / TRAINING_INFO_FILE).read_text())
        except (OSError, ValueError) as err:
            return f"its {TRAINING_INFO_FILE} cannot be read ({err})"
        manifest_path = path / MANIFEST_FILE
        if not manifest_path.is_file():
            return None
        try:
            manifest: dict[str, Any] = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as err:
            return f"its {MANIFEST_FILE} cannot be read ({err})"
        for relative, entry in manifest["files"].items():
            file = path / relative
            if not file.is_file():
                return f"{relative} is missing"
            size = file.stat().st_size
            if size != entry["bytes"]:
                return f"{relative} has {size} bytes, {entry['bytes']} were saved"
            if "crc32" in entry and _crc32(file) != entry["crc32"]:
                return f"{relative} changed since it was saved (CRC-32 mismatch)"
        return None

    def latest_intact_checkpoint(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The complete checkpoint with the highest step whose files are intact, and the later ones that are
        not, each with what is wrong (``(None, [...])`` when none is intact)."""
        damaged: list[tuple[Path, str]] = []
        for _, path in reversed(self.list_checkpoints()):
            problem = self.check_intact(path)
            if problem is None:
                return path, damaged
            damaged.append((path, problem))
        return None, damaged

    def get_best_checkpoint_path(self) -> Path | None:
        """The best checkpoint by ``metric_name`` (the latest when ``metric_name`` is ``None``).

        Checkpoints whose ``training_info`` lacks the metric are not candidates; ``None`` when none is.
        """
        if self.cfg.metric_name is None:
            return self.get_latest_checkpoint_path()
        ranked = self._rank_by_metric(self.list_checkpoints())
        return ranked[0][1] if ranked and self._metric_of(ranked[0][1]) is not None else None

    @staticmethod
    def load_training_info(path: Path | str) -> dict[str, Any]:
        """The ``training_info`` saved in checkpoint ``path``."""
        info_path = Path(path) / TRAINING_INFO_FILE
        if not info_path.is_file():
            raise FileNotFoundError(
                f"{info_path} does not exist: {path} is not a complete checkpoint "
                "(use CheckpointManager.get_latest_checkpoint_path() to find one)."
            )
        info: dict[str, Any] = json.loads(info_path.read_text())
        return info

    @staticmethod
    def load_config(path: Path | str) -> dict[str, Any] | None:
        """The run config saved in checkpoint ``path``, or ``None`` when it was saved without one."""
        config_path = Path(path) / CONFIG_FILE
        if not config_path.is_file():
            return None
        config: dict[str, Any] = yaml.safe_load(config_path.read_text())
        return config

    # ------------------------------------------------------------- internals
    def _require_metric(self, training_info: Mapping[str, Any], where: str) -> None:
        metric = self.cfg.metric_name
        if metric is None or self.cfg.keep_top_k is None or metric in training_info:
            return
        raise KeyError(
            f"checkpointing.metric_name={metric!r} is missing from the {where}, so checkpoints cannot be "
            f"ranked for keep_top_k={self.cfg.keep_top_k}. Available keys: {sorted(training_info)}. "
            "Put the metric into training_info (e.g. validate before saving), pick one of the available "
            "keys, or set checkpointing.metric_name=null to keep the most recent checkpoints."
        )

    def _metric_of(self, path: Path) -> float | None:
        assert self.cfg.metric_name is not None
        value = self.load_training_info(path).get(self.cfg.metric_name)
        if value is None:
            return None
        number = float(value)
        return None if math.isnan(number) else number

    def _rank_by_metric(self, checkpoints: list[tuple[int, Path]]) -> list[tuple[int, Path]]:
        """Best first; checkpoints without the metric (or with NaN) rank last, ties go to the later step."""
        sign = 1.0 if self.cfg.higher_is_better else -1.0

        def key(item: tuple[int, Path]) -> tuple[bool, float, int]:
            value = self._metric_of(item[1])
            return (value is not None, sign * value if value is not None else 0.0, item[0])

        return sorted(checkpoints, key=key, reverse=True)

    def _prune(self) -> None:
        keep_top_k = self.cfg.keep_top_k
        checkpoints = self.list_checkpoints()
        if keep_top_k is None or len(checkpoints) <= keep_top_k:
            return
        if self.cfg.metric_name is None:
            ranked = sorted(checkpoints, reverse=True)
        else:
            ranked = self._rank_by_metric(checkpoints)
        keep = {path for _, path in ranked[:keep_top_k]}
        # The latest checkpoint is where training resumes from, so it survives even when it ranks low.
        keep.add(checkpoints[-1][1])
        for _, path in checkpoints:
            if path not in keep:
                _remove_checkpoint(path)

    def _remove_tmp_dirs(self) -> None:
        for entry in self.checkpoint_dir.iterdir():
            if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
                shutil.rmtree(entry)


def _remove_checkpoint(path: Path) -> None:
    """Delete a complete checkpoint: first rename it out of the ``step_N`` namespace (one atomic step), then
    delete the files, so a crash mid-delete leaves a ``tmp_step_*`` leftover (removed by the next save), never
    a half checkpoint that a resume could pick."""
    doomed = path.parent / f"{_TMP_PREFIX}pruned_{path.name}"
    os.rename(path, doomed)
    _fsync_dir(path.parent)
    shutil.rmtree(doomed)


def _crc32(path: Path) -> int:
    checksum = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            checksum = zlib.crc32(chunk, checksum)
    return checksum


def _write_manifest(root: Path) -> None:
    """Record the size of every file under ``root`` (and the CRC-32 of the small ones) in ``MANIFEST.json``."""
    files: dict[str, dict[str, int]] = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in sorted(filenames):
            file = Path(dirpath) / name
            if file.is_symlink():
                continue
            relative = file.relative_to(root).as_posix()
            if relative == MANIFEST_FILE:
                continue
            size = file.stat().st_size
            entry = {"bytes": size}
            if size <= _CHECKSUM_MAX_BYTES:
                entry["crc32"] = _crc32(file)
            files[relative] = entry
    (root / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
