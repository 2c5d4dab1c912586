"""The shared loop tail (nemo_rl.algorithms.loop) without Ray or a model: a fake policy and loader."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.loop import (
    TrainLoop,
    batches_until,
    find_resume,
    save_training_checkpoint,
    step_budget,
    train_metrics,
    training_info,
)
from nemo_rl.config.checkpointing import CheckpointingConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.logger import LoggerConfig
from nemo_rl.data.dataloader import StatefulDataLoader
from nemo_rl.models.policy.interfaces import TrainResult
from nemo_rl.utils.checkpoint import CheckpointManager
from nemo_rl.utils.logger import Logger


@dataclasses.dataclass
class ToyState:
    step: int = 0
    val_loss: float | None = None
    seen: list[int] = dataclasses.field(default_factory=list)


class Recorder:
    """A logger backend that keeps every call, and the events of the loop in order."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.records: list[tuple[int, str, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str = "") -> None:
        self.records.append((step, prefix, dict(metrics)))
        self.events.append(f"log {prefix} {step}")

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    def at(self, step: int, prefix: str) -> dict[str, float]:
        return {k: v for s, p, m in self.records if s == step and p == prefix for k, v in m.items()}


class FakePolicy:
    """Writes marker files where the real policy writes its weights and optimizer state."""

    def __init__(self) -> None:
        self.saves: list[str] = []

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        Path(weights_path).mkdir(parents=True)
        (Path(weights_path) / "w").write_text("w")
        self.saves.append(weights_path)

    def export_hf(self, path: str) -> None:
        Path(path).mkdir(parents=True)


def _loader(n: int = 6) -> StatefulDataLoader[Any, list[int]]:
    return StatefulDataLoader(
        list(range(n)), batch_size=2, shuffle=False, seed=0, drop_last=True, collate_fn=list
    )


@dataclasses.dataclass
class Harness:
    """A loop's collaborators: logger (with a recording backend), checkpointer, loader, save and validate."""

    state: ToyState
    events: list[str]
    recorder: Recorder
    logger: Logger
    checkpointer: CheckpointManager
    loader: StatefulDataLoader[Any, list[int]]
    save: Callable[[], Path]
    validate: Callable[[int], None]

    def loop(self, total_steps: int, **options: Any) -> TrainLoop[list[int]]:
        return TrainLoop(
            "toy",
            loader=self.loader,
            state=self.state,
            total_steps=total_steps,
            logger=self.logger,
            checkpointer=self.checkpointer,
            save_checkpoint=self.save,
            **options,
        )


def _harness(tmp_path: Path, state: ToyState, **ckpt: Any) -> Harness:
    events: list[str] = []
    recorder = Recorder(events)
    logger = Logger(
        LoggerConfig(
            log_dir=str(tmp_path / "logs"),
            console_enabled=False,
            jsonl_enabled=False,
            monitor_gpus=False,
            progress_bar=False,
        ),
        extra_backends=[recorder],
    )
    checkpointer = CheckpointManager(
        CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), **{"save_period": 2, **ckpt})
    )
    loader = _loader()
    policy = FakePolicy()

    def save() -> Path:
        events.append(f"save {state.step}")
        return save_training_checkpoint(
            checkpointer,
            state=state,
            run_config=checkpointer.cfg,
            policy=policy,  # type: ignore[arg-type]
            train_loader=loader,
            metric_value=state.val_loss,
        )

    def validate(step: int) -> None:
        events.append(f"validate {step}")
        state.val_loss = 1.0 / (step + 1)

    return Harness(state, events, recorder, logger, checkpointer, loader, save, validate)


def test_loop_runs_to_the_budget_logging_before_saving(tmp_path: Path) -> None:
    state = ToyState()
    h = _harness(tmp_path, state)
    events, recorder = h.events, h.recorder
    loop = h.loop(step_budget(5, 2, len(h.loader)), validate=h.validate, val_period=2, val_at_start=True)
    for batch in loop:
        with loop.timer.time("work"):
            state.seen += batch
        loop.end_step({"loss": float(len(state.seen))}, num_tokens=10.0)

    # 3 batches per epoch, 2 epochs allowed, 5 steps asked: 5 steps crossing into the second epoch.
    assert state.step == 5 and state.seen == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    assert events[:3] == ["validate 0", "log train 1", "log timing/train 1"]
    # Step 2: validate, then train/* before the checkpoint, then the step's timings.
    step2 = events[events.index("validate 2") :][:5]
    assert step2 == ["validate 2", "log train 2", "save 2", "log timing/train 2", "log performance 2"]
    assert "save 5" in events and "save 3" not in events  # periodic saves and the last step
    assert "validate 5" not in events  # the period does not fall on the last step, and val_at_end is off
    timing = recorder.at(2, "timing/train")
    assert set(timing) == {"total_step_time", "work", "validation", "checkpointing"}
    assert timing["total_step_time"] >= timing["work"] + timing["checkpointing"]
    assert recorder.at(2, "performance")["tokens_per_sec"] == pytest.approx(10.0 / timing["total_step_time"])
    assert recorder.at(3, "train") == {"loss": 6.0}

    info = CheckpointManager.load_training_info(tmp_path / "ckpt" / "step_4")
    assert (
        info["step"] == 4
        and info["val_loss"] == pytest.approx(0.2)
        and info["seen"] == [0, 1, 2, 3, 4, 5, 0, 1]
    )


def test_val_at_end_validates_the_last_step_before_its_checkpoint(tmp_path: Path) -> None:
    state = ToyState()
    h = _harness(tmp_path, state)
    loop = h.loop(3, validate=h.validate, val_period=2, val_at_end=True)
    for _ in loop:
        loop.end_step({})
    validations = [e for e in h.events if e.startswith("validate")]
    assert validations == ["validate 2", "validate 3"]
    assert h.events.index("validate 3") < h.events.index("save 3")
    assert CheckpointManager.load_training_info(tmp_path / "ckpt" / "step_3")["val_loss"] == pytest.approx(
        0.25
    )


def test_resume_restores_the_state_and_continues(tmp_path: Path) -> None:
    first = ToyState()
    h = _harness(tmp_path, first)
    loop = h.loop(2)
    for batch in loop:
        first.seen += batch
        loop.end_step({})

    resume = find_resume(h.checkpointer, "toy")
    second = resume.state(ToyState)
    assert second == first and resume.weights_path is not None
    assert Path(resume.weights_path, "w").read_text() == "w"
    h = _harness(tmp_path, second)
    resume.restore_loader(h.loader)
    loop = h.loop(4)
    for batch in loop:
        second.seen += batch
        loop.end_step({})
    assert second.seen == [0, 1, 2, 3, 4, 5, 0, 1] and second.step == 4
    assert sorted(step for step, prefix, _ in h.recorder.records if prefix == "train") == [3, 4]

    # A fresh start, or fields missing from an older checkpoint, take the dataclass defaults.
    disabled = CheckpointManager(CheckpointingConfig(enabled=False, checkpoint_dir=str(tmp_path / "ckpt")))
    assert find_resume(disabled, "toy").state(ToyState) == ToyState()
    assert dataclasses.replace(resume, training_info={"step": 7}).state(ToyState) == ToyState(step=7)


def test_deadline_saves_and_stops_after_the_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = ToyState()
    h = _harness(tmp_path, state, checkpoint_must_save_by="00:00:00:00", save_period=100)
    loop = h.loop(10)
    for _ in loop:
        loop.end_step({"loss": 1.0})
    assert state.step == 1 and loop.out_of_time and "save 1" in h.events
    assert "stopping after step 1" in capsys.readouterr().out


def test_body_must_end_each_step(tmp_path: Path) -> None:
    loop = _harness(tmp_path, ToyState(), enabled=False).loop(3)
    with pytest.raises(RuntimeError, match="without calling end_step"):
        for _ in loop:
            pass
    with pytest.raises(RuntimeError, match="once per batch"):
        loop.end_step({})


def test_training_info_records_the_ranking_metric() -> None:
    state = ToyState(step=3, val_loss=0.5)
    assert training_info(state, None, 1.0) == {"step": 3, "val_loss": 0.5, "seen": []}
    assert training_info(state, "val_loss", 9.0)["val_loss"] == 0.5  # a state field wins
    assert training_info(state, "validation/accuracy", None)["validation/accuracy"] is None
    with pytest.raises(TypeError, match="dataclass"):
        training_info(object(), None, None)  # type: ignore[arg-type]


def test_train_metrics_reduce_over_optimizer_steps() -> None:
    result: TrainResult = {
        "loss": torch.tensor([1.0, 3.0]),
        "grad_norm": torch.tensor([float("inf"), 7.0]),  # the first step was skipped
        "lr": torch.tensor([0.1, 0.2]),
        "global_valid_seqs": torch.tensor([2.0, 2.0]),
        "global_valid_toks": torch.tensor([10.0, 20.0]),
        "metrics": {"entropy": [1.0, 2.0], "ratio_min": [0.5, 0.25], "ratio_max": [2.0, 3.0], "loss": [9.0]},
    }
    assert train_metrics(result, {"reward": 0.5, "lr": -1.0}) == {
        "loss": 2.0,
        "grad_norm": 7.0,
        "lr": -1.0,
        "num_valid_tokens": 30.0,
        "nonfinite_steps": 1.0,
        "reward": 0.5,
        "entropy": 1.5,
        "ratio_min": 0.25,
        "ratio_max": 3.0,
    }


def test_batches_until_reads_the_step_counter_before_each_batch() -> None:
    done = [0]

    def steps() -> int:
        return done[0]

    out = []
    for batch in batches_until([1, 2, 3], steps, 5):
        out.append(batch)
        done[0] += 1
    assert out == [1, 2, 3, 1, 2]


def test_training_data_smaller_than_one_batch_names_the_key() -> None:
    from nemo_rl.algorithms.loop import Resume
    from nemo_rl.algorithms.run_build import make_train_loader

    with pytest.raises(UserError, match=r"3 samples, fewer than one batch \(grpo.num_prompts_per_step=4\)"):
        make_train_loader(
            [{"idx": i} for i in range(3)],  # type: ignore[arg-type]
            Resume(None, {}),
            batch_size=4,
            batch_size_key="grpo.num_prompts_per_step",
            shuffle=False,
            seed=0,
            collate_fn=list,
        )


def test_further_trained_policies_are_saved_and_found_under_their_names(tmp_path: Path) -> None:
    # A second trained policy (PPO's critic) is checkpointed beside the run's policy and resumed from there.
    checkpointer = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    policy, critic = FakePolicy(), FakePolicy()
    save_training_checkpoint(
        checkpointer,
        state=ToyState(step=1),
        run_config=checkpointer.cfg,
        policy=policy,  # type: ignore[arg-type]
        train_loader=_loader(),
        other_policies={"critic": critic},  # type: ignore[dict-item]
    )
    resume = find_resume(checkpointer, "toy")
    weights, optimizer = resume.policy_paths("critic")
    assert weights is not None and optimizer is not None and len(critic.saves) == 1
    assert resume.weights_path is not None and Path(resume.weights_path, "w").read_text() == "w"
    assert Path(weights, "w").read_text() == "w" and weights != resume.weights_path
    assert find_resume(CheckpointManager(CheckpointingConfig(enabled=False)), "toy").policy_paths(
        "critic"
    ) == (
        None,
        None,
    )
    with pytest.raises(ValueError, match="cannot be named 'policy'"):
        save_training_checkpoint(
            checkpointer,
            state=ToyState(step=2),
            run_config=checkpointer.cfg,
            policy=policy,  # type: ignore[arg-type]
            train_loader=_loader(),
            other_policies={"policy": critic},  # type: ignore[dict-item]
        )
