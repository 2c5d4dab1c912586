"""What a resumed run gets back, and what happens when a checkpoint or a config is not what was saved.

No Ray, no model: the shared loop (nemo_rl.algorithms.loop) with a fake policy, and the checkpoint manager.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nemo_rl.algorithms.loop import TrainLoop, check_config_change, find_resume, save_training_checkpoint
from nemo_rl.config.checkpointing import CheckpointingConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.logger import LoggerConfig
from nemo_rl.data.dataloader import StatefulDataLoader
from nemo_rl.models.policy.lm_policy import NonFiniteTrainingError, Policy
from nemo_rl.utils.checkpoint import CheckpointManager
from nemo_rl.utils.logger import Logger
from nemo_rl.utils.rng import get_rng_state, set_rng_state


@dataclasses.dataclass
class State:
    step: int = 0


class Counter:
    """A stand-in for the generation's seed counter: a checkpointable object."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


class FakePolicy:
    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        Path(weights_path).mkdir(parents=True)
        (Path(weights_path) / "w.bin").write_bytes(b"w" * 64)


def _run(tmp_path: Path, total_steps: int, log: list[tuple[int, float, int, float]], **ckpt: Any) -> None:
    """A toy run: each step draws from the driver's RNGs and the tracked counter, and shuffled data."""
    checkpointer = CheckpointManager(
        CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), save_period=2, **ckpt)
    )
    resume = find_resume(checkpointer, "toy", checkpointer.cfg)
    state = resume.state(State)
    loader: StatefulDataLoader[Any, list[int]] = StatefulDataLoader(
        list(range(8)), batch_size=2, shuffle=True, seed=3, drop_last=True, collate_fn=list
    )
    resume.restore_loader(loader)
    counter = Counter()
    checkpointer.track("counter", counter)
    logger = Logger(
        LoggerConfig(
            log_dir=str(tmp_path / "logs"), console_enabled=False, jsonl_enabled=False, progress_bar=False
        )
    )
    loop = TrainLoop(
        "toy",
        loader=loader,
        state=state,
        total_steps=total_steps,
        logger=logger,
        checkpointer=checkpointer,
        save_checkpoint=lambda: save_training_checkpoint(
            checkpointer,
            state=state,
            run_config=checkpointer.cfg,
            policy=FakePolicy(),  # type: ignore[arg-type]
            train_loader=loader,
        ),
    )
    for batch in loop:
        counter.calls += 1
        draw = float(torch.rand(())) + random.random() + float(np.random.rand())
        log.append((state.step + 1, draw, counter.calls, float(sum(batch))))
        loop.end_step({})


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def test_resume_continues_every_rng_the_loader_and_tracked_state(tmp_path: Path) -> None:
    _seed(0)
    full: list[tuple[int, float, int, float]] = []
    _run(tmp_path / "full", 6, full)

    _seed(0)
    first: list[tuple[int, float, int, float]] = []
    _run(tmp_path / "killed", 3, first)
    # As if killed while saving step 3 (after step 2's checkpoint): rerun with the RNGs in another state.
    os.rename(tmp_path / "killed" / "ckpt" / "step_3", tmp_path / "killed" / "ckpt" / "tmp_step_3")
    _seed(123)
    resumed: list[tuple[int, float, int, float]] = []
    _run(tmp_path / "killed", 6, resumed)
    assert first[:2] == full[:2]
    assert resumed == full[2:]  # bit for bit: ==, not approx


def test_damaged_latest_checkpoint_falls_back_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(tmp_path, 4, [])
    ckpt = tmp_path / "ckpt"
    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(ckpt)))
    assert manager.check_intact(ckpt / "step_4") is None
    # A flipped byte in a small file (same size), then a truncated weight file.
    info = ckpt / "step_4" / "train_dataloader.pt"
    data = bytearray(info.read_bytes())
    data[-1] ^= 0xFF
    info.write_bytes(bytes(data))
    assert "CRC-32" in (manager.check_intact(ckpt / "step_4") or "")
    with open(ckpt / "step_2" / "policy" / "weights" / "w.bin", "r+b") as f:
        f.truncate(10)
    assert "10 bytes" in (manager.check_intact(ckpt / "step_2") or "")

    resume = find_resume(manager, "toy")
    out = capsys.readouterr().out
    assert resume.path is None
    assert "step_4 is damaged" in out and "step_2 is damaged" in out and "starting afresh" in out

    (ckpt / "step_4" / "train_dataloader.pt").write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 0xFF]))
    assert find_resume(manager, "toy").path == ckpt / "step_4"


def test_prune_renames_before_deleting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path, 4, [], keep_top_k=1)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_4"]

    # A kill in the middle of deleting step_4 leaves no step_4 behind, only a tmp_ leftover.
    manager = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(ckpt), keep_top_k=1))
    tmp = manager.init_tmp_checkpoint(6, {}, None)
    (tmp / "x").write_text("x")

    def killed(path: Path) -> None:
        (Path(path) / "training_info.json").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr("nemo_rl.utils.checkpoint.shutil.rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        manager.finalize_checkpoint(tmp)
    monkeypatch.undo()
    assert [step for step, _ in manager.list_checkpoints()] == [6]
    assert manager.latest_intact_checkpoint() == (ckpt / "step_6", [])


def test_config_change_on_resume_warns_or_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = {
        "policy": {"model_name": "a", "dtensor_cfg": {"tensor_parallel_size": 1}, "optimizer": {"lr": 1.0}},
        "grpo": {"max_num_steps": 10},
        "logger": {"log_dir": "x"},
    }
    path = tmp_path / "step_2"
    same_but_bookkeeping = {**saved, "grpo": {"max_num_steps": 20}, "logger": {"log_dir": "y"}}
    assert check_config_change(saved, same_but_bookkeeping, path=path, allow_incompatible=False) == []
    assert capsys.readouterr().out == ""

    lr = {**saved, "policy": {**saved["policy"], "optimizer": {"lr": 2.0}}}
    assert check_config_change(saved, lr, path=path, allow_incompatible=False) == ["policy.optimizer.lr"]
    assert "policy.optimizer.lr: 1.0 -> 2.0" in capsys.readouterr().out

    for changed in ({"model_name": "b"}, {"dtensor_cfg": {"tensor_parallel_size": 2}}):
        new = {**saved, "policy": {**saved["policy"], **changed}}
        with pytest.raises(UserError, match="allow_incompatible_resume=true"):
            check_config_change(saved, new, path=path, allow_incompatible=False)
        check_config_change(saved, new, path=path, allow_incompatible=True)
        assert "WARNING" in capsys.readouterr().out


def test_rng_state_round_trips() -> None:
    state = get_rng_state()
    before = (torch.rand(3), random.random(), np.random.rand(2))
    set_rng_state(state)
    after = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and np.array_equal(before[2], after[2])


def test_non_finite_steps_are_counted_and_stop_the_run() -> None:
    policy = Policy.__new__(Policy)
    policy.cfg = type("Cfg", (), {"max_nonfinite_steps": 3})()  # type: ignore[assignment]
    policy.num_nonfinite_steps = policy.nonfinite_steps_in_a_row = 0

    def result(*losses: float) -> Any:
        return {"loss": torch.tensor(losses), "grad_norm": torch.ones(len(losses))}

    policy._count_nonfinite_steps(result(1.0, math.nan, math.inf))
    assert (policy.num_nonfinite_steps, policy.nonfinite_steps_in_a_row) == (2, 2)
    policy._count_nonfinite_steps(result(0.5))  # a finite step resets the run of them
    assert (policy.num_nonfinite_steps, policy.nonfinite_steps_in_a_row) == (2, 0)
    policy._count_nonfinite_steps(result(math.nan, math.nan))
    with pytest.raises(NonFiniteTrainingError, match="3 optimizer steps in a row") as err:
        policy._count_nonfinite_steps(result(math.nan))
    assert "\n" not in str(err.value)
