"""CheckpointManager: atomic saves, crash recovery, top-k pruning by metric, save period."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from nemo_rl.config.checkpointing import CheckpointingConfig
from nemo_rl.utils.checkpoint import CheckpointManager


def _manager(tmp_path: Path, **overrides: Any) -> CheckpointManager:
    return CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), **overrides))


def _save(manager: CheckpointManager, step: int, **info: Any) -> Path:
    tmp = manager.init_tmp_checkpoint(step, info, {"policy": {"model_name": "tiny"}})
    (tmp / "policy").mkdir()
    torch.save({"w": torch.full((2,), float(step))}, tmp / "policy" / "weights.pt")
    return manager.finalize_checkpoint(tmp)


def _steps(manager: CheckpointManager) -> list[int]:
    return [step for step, _ in manager.list_checkpoints()]


def test_save_layout_and_read_back(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    assert manager.get_latest_checkpoint_path() is None
    tmp = manager.init_tmp_checkpoint(5, {"val_loss": torch.tensor(0.25), "consumed_samples": 40}, None)
    assert tmp.name == "tmp_step_5"
    assert manager.get_latest_checkpoint_path() is None  # in-progress saves are invisible
    (tmp / "optimizer.pt").write_bytes(b"state")
    final = manager.finalize_checkpoint(tmp)

    assert final == tmp_path / "ckpt" / "step_5"
    assert not tmp.exists()
    assert manager.get_latest_checkpoint_path() == final
    assert manager.load_training_info(final) == {"step": 5, "val_loss": 0.25, "consumed_samples": 40}
    assert (final / "optimizer.pt").read_bytes() == b"state"
    assert manager.load_config(final) is None

    final_with_config = _save(manager, 6)
    assert manager.load_config(final_with_config) == {"policy": {"model_name": "tiny"}}
    assert torch.equal(torch.load(final_with_config / "policy" / "weights.pt")["w"], torch.full((2,), 6.0))


def test_pydantic_run_config_is_saved_as_yaml(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    cfg = CheckpointingConfig(save_period=3)
    final = manager.finalize_checkpoint(manager.init_tmp_checkpoint(1, {}, cfg))
    saved = manager.load_config(final)
    assert (
        saved is not None and saved["save_period"] == 3 and saved["checkpoint_dir"] == "results/checkpoints"
    )


def test_killed_save_leaves_previous_checkpoint_latest(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    _save(manager, 10)
    # A separate process starts the save of step 20, writes part of it, and dies before finalising.
    script = textwrap.dedent(
        f"""
        import os
        from nemo_rl.config.checkpointing import CheckpointingConfig
        from nemo_rl.utils.checkpoint import CheckpointManager
        manager = CheckpointManager(CheckpointingConfig(checkpoint_dir={str(tmp_path / "ckpt")!r}))
        tmp = manager.init_tmp_checkpoint(20, {{"loss": 1.0}}, None)
        with open(tmp / "weights.pt", "wb") as f:
            f.write(b"half-written")
            f.flush()
            os._exit(1)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == 1, result.stderr.decode()
    assert (tmp_path / "ckpt" / "tmp_step_20" / "weights.pt").exists()

    assert manager.get_latest_checkpoint_path() == tmp_path / "ckpt" / "step_10"
    assert manager.load_training_info(manager.get_latest_checkpoint_path() or "")["step"] == 10
    assert _steps(manager) == [10]

    # The next save cleans up the crash residue.
    _save(manager, 11)
    assert not (tmp_path / "ckpt" / "tmp_step_20").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_10", "step_11"]


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_keep_top_k_by_metric(tmp_path: Path, higher_is_better: bool) -> None:
    manager = _manager(
        tmp_path, metric_name="validation/accuracy", higher_is_better=higher_is_better, keep_top_k=2
    )
    accuracy = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.7, 5: 0.3}
    for step, value in accuracy.items():
        _save(manager, step, **{"validation/accuracy": value})
    if higher_is_better:
        # Best two are steps 2 (0.9) and 4 (0.7); the latest (5) is always kept to resume from.
        assert _steps(manager) == [2, 4, 5]
        assert manager.get_best_checkpoint_path() == tmp_path / "ckpt" / "step_2"
    else:
        assert _steps(manager) == [3, 5]  # lowest: 3 (0.1), 5 (0.3), which is also the latest
        assert manager.get_best_checkpoint_path() == tmp_path / "ckpt" / "step_3"
    assert manager.get_latest_checkpoint_path() == tmp_path / "ckpt" / "step_5"


def test_keep_top_k_without_metric_keeps_most_recent(tmp_path: Path) -> None:
    manager = _manager(tmp_path, keep_top_k=2)
    for step in (2, 4, 6, 8):
        _save(manager, step)
    assert _steps(manager) == [6, 8]
    assert manager.get_best_checkpoint_path() == tmp_path / "ckpt" / "step_8"

    keep_all = _manager(tmp_path / "all")
    for step in (1, 2, 3):
        _save(keep_all, step)
    assert _steps(keep_all) == [1, 2, 3]


def test_missing_metric_names_metric_and_available_keys(tmp_path: Path) -> None:
    manager = _manager(tmp_path, metric_name="val_loss", keep_top_k=3)
    with pytest.raises(KeyError, match=r"val_loss.*\['consumed_samples', 'train/loss'\]"):
        manager.init_tmp_checkpoint(3, {"train/loss": 1.0, "consumed_samples": 9})
    assert not (tmp_path / "ckpt" / "tmp_step_3").exists()


def test_nan_metric_ranks_last(tmp_path: Path) -> None:
    manager = _manager(tmp_path, metric_name="val_loss", higher_is_better=False, keep_top_k=1)
    _save(manager, 1, val_loss=float("nan"))
    _save(manager, 2, val_loss=2.0)
    _save(manager, 3, val_loss=float("nan"))
    assert _steps(manager) == [2, 3]
    assert manager.get_best_checkpoint_path() == tmp_path / "ckpt" / "step_2"


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    _save(manager, 7, loss=1.0)
    _save(manager, 7, loss=0.5)
    assert _steps(manager) == [7]
    assert manager.load_training_info(tmp_path / "ckpt" / "step_7")["loss"] == 0.5
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_7"]


def test_save_period_and_enabled(tmp_path: Path) -> None:
    manager = _manager(tmp_path, save_period=3)
    assert [s for s in range(0, 10) if manager.should_save(s)] == [3, 6, 9]
    assert not _manager(tmp_path, enabled=False, save_period=1).should_save(1)


def test_bad_inputs_raise_clear_errors(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    with pytest.raises(ValueError, match="init_tmp_checkpoint"):
        manager.finalize_checkpoint(tmp_path / "somewhere")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.load_training_info(tmp_path / "nothing")
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        manager.init_tmp_checkpoint(1, {"obj": object()})
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValidationError, match="DD:HH:MM:SS"):
        CheckpointingConfig(checkpoint_must_save_by="3h")
    with pytest.raises(ValidationError, match="keep_top_k"):
        CheckpointingConfig(keep_top_k=0)
    with pytest.raises(ValidationError, match="Extra inputs"):
        CheckpointingConfig.model_validate({"save_every": 3})


def test_training_info_json_is_plain(tmp_path: Path) -> None:
    manager = _manager(tmp_path)
    final = _save(manager, 2, reward=torch.tensor([0.75]).mean())
    assert json.loads((final / "training_info.json").read_text()) == {"step": 2, "reward": 0.75}
