"""Asynchronous GRPO's rollout side without workers: the trajectory buffer, the age rule that keeps generation
at most ``max_trajectory_age_steps`` ahead, version tags, refits at request boundaries (the run's
:class:`GenerationWeights`), failures, the schedule and seeds that do not depend on timing, and what a
checkpoint saves (the buffered batches and the loader position after them)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.generation_weights import GenerationWeights
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.async_rollouts import (
    AheadBatchesOnResume,
    AsyncRollouts,
    RolloutBatch,
    TrajectoryBuffer,
    sampling_seed,
)

TIMEOUT_S = 60.0
PROMPTS = 2
SEED = 7


def rollout_batch(version: int) -> RolloutBatch:
    return RolloutBatch(
        rollout=BatchedDataDict(idx=torch.arange(4)),
        metrics={},
        version=version,
        loader_state={"batch_index": 1},
        num_prompts=PROMPTS,
    )


def test_take_drops_batches_older_than_the_age_bound_and_returns_them() -> None:
    buffer = TrajectoryBuffer(capacity=3)
    for version in (0, 1, 2):
        buffer.put(rollout_batch(version))
    batch, dropped, _ = buffer.take(min_version=2, timeout_s=TIMEOUT_S)
    assert batch.version == 2
    assert [d.version for d in dropped] == [0, 1]
    assert len(buffer) == 0


def test_a_failure_of_the_generation_thread_is_raised_in_the_trainer() -> None:
    buffer = TrajectoryBuffer(capacity=1)
    buffer.fail(RuntimeError("worker died"))
    with pytest.raises(RuntimeError, match="worker died"):
        buffer.take(min_version=0, timeout_s=TIMEOUT_S)


def test_take_times_out_when_nothing_arrives() -> None:
    with pytest.raises(TimeoutError, match="no rollout batch arrived"):
        TrajectoryBuffer(capacity=1).take(min_version=0, timeout_s=0.05)


class FakeGeneration:
    """Records the call order; a call can be held until released (to check refit boundaries)."""

    def __init__(self, jitter_s: float = 0.0) -> None:
        self.calls: list[str] = []
        self.seeds: list[int | None] = []
        self.in_flight = False
        self.hold: threading.Event | None = None
        self.entered = threading.Event()
        self.jitter_s = jitter_s

    def enable_in_flight_weight_updates(self, recompute_kv_cache: bool) -> None:
        self.in_flight = True

    def generate(
        self, data: BatchedDataDict[Any], greedy: bool = False, seed: int | None = None
    ) -> BatchedDataDict[Any]:
        self.calls.append("generate")
        self.seeds.append(seed)
        self.entered.set()
        if self.hold is not None:
            assert self.hold.wait(TIMEOUT_S)
        if self.jitter_s:
            time.sleep(random.uniform(0.0, self.jitter_s))
        return data


def prompt_batches(index: int = 0) -> Iterator[BatchedDataDict[Any]]:
    while True:
        yield BatchedDataDict(
            idx=torch.arange(index * PROMPTS, (index + 1) * PROMPTS), message_log=[[]] * PROMPTS
        )
        index += 1


class FakeCopy:
    """The weight copy of :class:`GenerationWeights` (a Refitter): records each refit among the generation
    calls."""

    def __init__(self, generation: FakeGeneration) -> None:
        self.generation = generation
        self.refits = 0
        self.stale = True

    def refit(self) -> dict[str, float]:
        self.generation.calls.append("refit")
        self.refits += 1
        self.stale = False
        return {"refit/bytes": 1.0}

    def mark_stale(self) -> None:
        self.stale = True

    def shutdown(self) -> None:
        pass


class Harness:
    """An :class:`AsyncRollouts` over :class:`FakeGeneration` with a counting loader and the run's weights."""

    def __init__(
        self,
        *,
        max_age: int,
        num_batches: int = 6,
        start_version: int = 0,
        failures: int = 0,
        jitter_s: float = 0.0,
        drawn: int = 0,
        **kw: Any,
    ):
        self.generation = FakeGeneration(jitter_s)
        self.generated = 0
        self._generated_cond = threading.Condition()
        self.drawn = drawn
        self.fail_next = failures
        self.sync = FakeCopy(self.generation)
        self.weights = GenerationWeights(self.sync, self.generation)
        self.weights.publish(start_version)
        in_flight = kw.pop("in_flight", False)
        if in_flight:
            self.weights.enable_in_flight_updates(recompute_kv_cache=False)
        batches = prompt_batches(drawn)

        def draw() -> BatchedDataDict[Any]:
            self.drawn += 1
            return next(batches)

        self.rollouts = AsyncRollouts(
            self.generation,  # type: ignore[arg-type]
            self.weights,
            self.roll_out,
            batches=iter(draw, None),
            loader_state=lambda: {"batch_index": self.drawn},
            num_batches=num_batches,
            max_age=max_age,
            max_failures=kw.pop("max_failures", 0),
            take_timeout_s=TIMEOUT_S,
            seed=SEED,
            deterministic=not in_flight,
        )

    def roll_out(
        self, generation: Any, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        out = generation.generate(batch)
        with self._generated_cond:
            self.generated += 1
            self._generated_cond.notify_all()
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("environment unreachable")
        return out, {"reward": 1.0}

    def wait_generated(self, count: int) -> None:
        with self._generated_cond:
            assert self._generated_cond.wait_for(lambda: self.generated >= count, timeout=TIMEOUT_S)


@pytest.mark.parametrize("max_age", [1, 2])
def test_generation_runs_at_most_max_age_steps_ahead_and_every_trained_batch_is_young_enough(
    max_age: int,
) -> None:
    h = Harness(max_age=max_age)
    rollouts = h.rollouts
    rollouts.start()
    try:
        ages = []
        for step in range(1, 7):
            batch, metrics, dropped = rollouts.take(step)
            assert not dropped
            assert metrics["async/trajectory_age_max"] == step - 1 - batch.version
            ages.append(metrics["async/trajectory_age_max"])
            # The prompts come in loader order and the consumed position follows the batch trained on.
            assert batch.rollout["idx"].tolist() == list(range((step - 1) * PROMPTS, step * PROMPTS))
            assert rollouts.consumed_loader_state() == {"batch_index": step}
            # Let generation sample every batch the age rule allows before the new weights arrive.
            h.wait_generated(min(step + max_age, 6))
            h.weights.refit(version=step)
        assert max(ages) == max_age  # generation did run ahead, and no further
        assert ages[0] == 0
    finally:
        rollouts.close()


def test_before_its_first_refit_generation_draws_only_the_batches_the_age_bound_allows() -> None:
    h = Harness(max_age=1)
    h.rollouts.start()
    try:
        batch, _, _ = h.rollouts.take(1)
        second, _, _ = h.rollouts.take(2)
        assert (batch.version, second.version) == (0, 0)
        # Batch 2 would be trained at step 3 with age 2: it is not even drawn before the weights of step 1.
        assert h.drawn == 2
        h.weights.refit(version=1)
        third, _, _ = h.rollouts.take(3)
        assert third.version == 1
    finally:
        h.rollouts.close()


def test_a_refit_waits_for_the_generation_call_in_progress_unless_in_flight() -> None:
    for in_flight in (False, True):
        h = Harness(max_age=2, in_flight=in_flight)
        h.generation.hold = threading.Event()
        h.rollouts.start()
        try:
            assert h.generation.entered.wait(TIMEOUT_S)
            refit = threading.Thread(target=h.weights.refit, args=(1,))
            refit.start()
            refit.join(timeout=0.5 if not in_flight else TIMEOUT_S)
            # Without in-flight updates the refit is still blocked behind the held call.
            assert refit.is_alive() is (not in_flight)
            h.generation.hold.set()
            refit.join(TIMEOUT_S)
            assert h.sync.refits == 1
            calls = h.generation.calls
            assert calls.index("refit") == (1 if in_flight else calls.index("generate") + 1)
            assert h.generation.in_flight is in_flight
        finally:
            h.generation.hold.set()
            h.rollouts.close()


def test_failed_batches_are_sampled_again_up_to_max_generation_failures() -> None:
    h = Harness(max_age=1, failures=1, max_failures=1)
    h.rollouts.start()
    try:
        batch, metrics, _ = h.rollouts.take(1)
        assert batch.rollout["idx"].tolist() == [0, 1]  # the same prompts, not lost
        assert metrics["async/generation_failures"] == 1
        # The retry samples with the failed attempt's seed: what it gives does not depend on the failure.
        assert h.generation.seeds[0] == h.generation.seeds[1] == sampling_seed(SEED, [0, 1], 0, 0)
    finally:
        h.rollouts.close()

    h = Harness(max_age=1, failures=1, max_failures=0)
    h.rollouts.start()
    try:
        with pytest.raises(RuntimeError, match="max_generation_failures=0: environment unreachable"):
            h.rollouts.take(1)
    finally:
        h.rollouts.close()


def test_a_resumed_run_continues_its_versions_and_ages() -> None:
    h = Harness(max_age=1, start_version=10)
    h.rollouts.start()
    try:
        batch, metrics, _ = h.rollouts.take(11)
        assert batch.version == 10 and metrics["async/trajectory_age_mean"] == 0
    finally:
        h.rollouts.close()


def train(h: Harness, steps: range, *, jitter_s: float = 0.0) -> list[tuple[list[int], int]]:
    """The trainer's side of a run over ``h``: each step takes its batch, waits as a deterministic schedule
    asks and refits; returns each step's (prompt indices, version)."""
    trained = []
    for step in steps:
        batch, _, dropped = h.rollouts.take(step)
        assert not dropped
        trained.append((batch.rollout["idx"].tolist(), batch.version))
        time.sleep(random.uniform(0.0, jitter_s))
        h.rollouts.wait_before_refit(step)
        h.weights.refit(version=step)
    return trained


@pytest.mark.parametrize("max_age", [1, 2])
def test_without_in_flight_updates_each_batch_is_sampled_by_a_version_and_seeds_that_timing_never_changes(
    max_age: int,
) -> None:
    # Generation faster than training, then training faster than generation: the same versions and seeds.
    runs = []
    for gen_jitter_s, train_jitter_s in ((0.0, 0.02), (0.02, 0.0)):
        h = Harness(max_age=max_age, jitter_s=gen_jitter_s)
        h.rollouts.start()
        try:
            trained = train(h, range(1, 7), jitter_s=train_jitter_s)
        finally:
            h.rollouts.close()
        # Batch g (step g + 1) is sampled by version max(g - max_age, 0), its seed a function of its prompts,
        # that version and the turn.
        assert [version for _, version in trained] == [max(g - max_age, 0) for g in range(6)]
        assert h.generation.seeds == [sampling_seed(SEED, idx, version, 0) for idx, version in trained]
        runs.append((trained, h.generation.calls))
    # The refits fall between the same generation calls too.
    assert runs[0] == runs[1]


def test_a_checkpoint_saves_the_buffered_batches_and_a_resumed_run_continues_as_the_uninterrupted_one() -> (
    None
):
    max_age = 2
    whole = Harness(max_age=max_age)
    whole.rollouts.start()
    try:
        expected = train(whole, range(1, 7))
    finally:
        whole.rollouts.close()

    first = Harness(max_age=max_age)
    first.rollouts.start()
    try:
        assert train(first, range(1, 3)) == expected[:2]
        # After step 2's refit, batches 2 and 3 (versions 0 and 1) are sampled; batch 4 may be in progress.
        with first.rollouts.snapshot() as position:
            state = first.rollouts.state_dict()
            loader = position.state_dict()
        assert [b["version"] for b in state["batches"]][:2] == [0, 1]
        saved = len(state["batches"])
        assert loader == {"batch_index": 2 + saved}
    finally:
        first.rollouts.close()

    # A fresh process: weights of step 2, the loader at the saved position, the buffered batches put back.
    resumed = Harness(max_age=max_age, start_version=2, num_batches=4, drawn=loader["batch_index"])
    resumed.rollouts.load_state_dict(state)
    resumed.rollouts.start()
    try:
        assert train(resumed, range(3, 7)) == expected[2:]
    finally:
        resumed.rollouts.close()
    assert resumed.drawn == 6 and len(resumed.generation.seeds) == 6 - (2 + saved)


@pytest.mark.parametrize("checkpoint_step", [1, 2, 3])
def test_with_in_flight_updates_a_checkpoint_anywhere_then_a_resume_trains_every_prompt_once(
    checkpoint_step: int,
) -> None:
    # In flight, the trainer does not wait for generation: what the buffer holds at the checkpoint depends on
    # timing (jittered here). Whatever it holds, the resumed run trains on the loader's prompts in order.
    max_age = 2
    first = Harness(max_age=max_age, in_flight=True, jitter_s=0.01)
    first.rollouts.start()
    try:
        trained = train(first, range(1, checkpoint_step + 1), jitter_s=0.01)
        with first.rollouts.snapshot() as position:
            state = first.rollouts.state_dict()
            loader = position.state_dict()
    finally:
        first.rollouts.close()
    resumed = Harness(
        max_age=max_age,
        in_flight=True,
        start_version=checkpoint_step,
        num_batches=6 - checkpoint_step,
        drawn=loader["batch_index"],
    )
    resumed.rollouts.load_state_dict(state)
    resumed.rollouts.start()
    try:
        trained += train(resumed, range(checkpoint_step + 1, 7))
    finally:
        resumed.rollouts.close()
    prompts = [i for idx, _ in trained for i in idx]
    assert prompts == list(range(6 * PROMPTS))
    # Never older than the bound, however far generation had got.
    assert all(step - 1 - version <= max_age for step, (_, version) in enumerate(trained, start=1))


def test_a_synchronous_run_resumed_from_an_async_checkpoint_samples_the_batches_ahead_again() -> None:
    from nemo_rl.data.dataloader import StatefulDataLoader

    def loader() -> StatefulDataLoader[int, list[int]]:
        return StatefulDataLoader(
            range(8), batch_size=2, shuffle=False, seed=0, drop_last=True, collate_fn=list
        )

    # The asynchronous run trained on batch 0 and had sampled batches 1 and 2 ahead: its checkpoint's loader
    # position is after batch 2, the consumed one after batch 0.
    async_loader = loader()
    batches = iter(async_loader)
    next(batches)
    consumed = async_loader.state_dict()
    next(batches), next(batches)
    sync_loader = loader()
    sync_loader.load_state_dict(async_loader.state_dict())
    saved = {"batches": [rollout_batch(0).to_plain()] * 2, "consumed_loader_state": consumed}
    AheadBatchesOnResume(sync_loader).load_state_dict(saved)
    assert next(iter(sync_loader)) == [2, 3]
    assert AheadBatchesOnResume(sync_loader).state_dict()["batches"] == []


def test_a_rollout_that_cannot_be_loaded_back_safely_is_refused_when_saved() -> None:
    batch = rollout_batch(0)
    batch.rollout["extra_env_info"] = [{"image": object()}]
    with pytest.raises(TypeError, match=r"rollout\['extra_env_info'\]\[0\]\['image'\] is a object"):
        batch.to_plain()
    plain = rollout_batch(3).to_plain()
    assert RolloutBatch.from_plain(plain).version == 3


BASE = {
    "policy": {
        "model_name": "m",
        "generation": {"colocated": {"enabled": False, "resources": {"gpus_per_node": 1, "num_nodes": 1}}},
    },
    "cluster": {"gpus_per_node": 2},
    "grpo": {"async_grpo": {"enabled": True}},
    "loss_fn": {"use_importance_sampling_correction": True},
}


def config(**changes: Any) -> dict[str, Any]:
    import copy

    cfg = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return cfg


def test_a_valid_async_config_loads() -> None:
    cfg = GRPOMasterConfig.model_validate(config())
    assert cfg.grpo.async_grpo.enabled and cfg.grpo.async_grpo.max_trajectory_age_steps == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"policy__generation__colocated": {"enabled": True}}, "policy.generation.colocated.enabled=false"),
        (
            {"loss_fn__use_importance_sampling_correction": False},
            "loss_fn.use_importance_sampling_correction",
        ),
        ({"grpo__async_grpo__max_trajectory_age_steps": 0}, "max_trajectory_age_steps"),
        (
            {"grpo__async_grpo__recompute_kv_cache_after_weight_updates": True},
            "in_flight_weight_updates=true",
        ),
        ({"grpo__use_dynamic_sampling": True}, "grpo.use_dynamic_sampling"),
        (
            {
                "policy__generation__backend": "vllm",
                "grpo__async_grpo__in_flight_weight_updates": True,
                "grpo__async_grpo__recompute_kv_cache_after_weight_updates": True,
            },
            "built for the embedded engine",
        ),
        (
            {
                "policy__generation__backend": "vllm",
                "policy__generation__vllm_cfg": {"tensor_parallel_size": 2},
                "grpo__async_grpo__in_flight_weight_updates": True,
            },
            "tensor_parallel_size=1",
        ),
    ],
)
def test_combinations_that_cannot_work_fail_at_config_time(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        GRPOMasterConfig.model_validate(config(**changes))


def test_the_run_weights_track_staleness_versions_and_hold_refits_out_of_a_validation() -> None:
    generation = FakeGeneration()
    copy = FakeCopy(generation)
    weights = GenerationWeights(copy)
    assert weights.stale and weights.version == 0
    assert weights.refit(version=3) == {"refit/bytes": 1.0}
    assert not weights.stale and weights.version == 3
    weights.mark_stale()
    assert weights.stale
    # A validation holds the generation workers: a refit waits for it to end.
    with weights.exclusive():
        refit = threading.Thread(target=weights.refit, args=(4,))
        refit.start()
        refit.join(timeout=0.2)
        assert refit.is_alive() and weights.version == 3
    refit.join(TIMEOUT_S)
    assert weights.version == 4 and copy.refits == 2
    with pytest.raises(RuntimeError, match="in-flight weight updates need the generation backend"):
        weights.enable_in_flight_updates(recompute_kv_cache=False)
