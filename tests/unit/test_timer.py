"""Timer reductions and the checkpoint deadline check, on a fake clock so results are exact."""

from __future__ import annotations

import pytest

from nemo_rl.utils import timer as timer_module
from nemo_rl.utils.timer import TimeoutChecker, Timer, parse_deadline_s


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timer_module.time, "perf_counter", fake)
    monkeypatch.setattr(timer_module.time, "monotonic", fake)
    return fake


def test_nested_labels_and_reductions(clock: FakeClock) -> None:
    timer = Timer()
    with timer.time("train/step"):
        for seconds in (1.0, 3.0):
            with timer.time("train/generation"):
                clock.advance(seconds)
        clock.advance(0.5)
    assert timer.labels() == ["train/generation", "train/step"]
    assert timer.get_elapsed("train/generation") == [1.0, 3.0]
    assert timer.get_timing_metrics("sum") == {"train/generation": 4.0, "train/step": 4.5}
    assert timer.get_timing_metrics("mean") == {"train/generation": 2.0, "train/step": 4.5}
    assert timer.get_timing_metrics("max")["train/generation"] == 3.0
    assert timer.get_timing_metrics("min")["train/generation"] == 1.0
    with pytest.raises(ValueError, match="'sum', 'mean'"):
        timer.get_timing_metrics("median")  # type: ignore[arg-type]


def test_interval_recorded_when_body_raises(clock: FakeClock) -> None:
    timer = Timer()
    with pytest.raises(ZeroDivisionError), timer.time("crashy"):
        clock.advance(2.0)
        _ = 1 / 0
    assert timer.get_elapsed("crashy") == [2.0]


def test_start_stop_misuse_and_reset(clock: FakeClock) -> None:
    timer = Timer()
    timer.start("a")
    with pytest.raises(RuntimeError, match="already running"):
        timer.start("a")
    clock.advance(1.5)
    assert timer.stop("a") == 1.5
    with pytest.raises(RuntimeError, match="never started"):
        timer.stop("b")
    with timer.time("b"):
        clock.advance(1.0)
    timer.reset("a")
    assert timer.labels() == ["b"]
    with pytest.raises(KeyError, match="known labels"):
        timer.get_elapsed("a")
    timer.reset()
    assert timer.get_timing_metrics() == {}


def test_parse_deadline() -> None:
    assert parse_deadline_s("00:03:45:00") == 3 * 3600 + 45 * 60
    assert parse_deadline_s("1:0:0:7") == 86400 + 7
    with pytest.raises(ValueError, match="DD:HH:MM:SS"):
        parse_deadline_s("03:45:00")


def test_timeout_checker_reserves_longest_step(clock: FakeClock) -> None:
    checker = TimeoutChecker("00:00:01:40", fit_last_save_time=True)  # 100 s budget
    checker.start_iterations()
    clock.advance(30.0)
    checker.mark_iteration()
    clock.advance(20.0)
    checker.mark_iteration()
    assert not checker.check_save()  # 50 s spent + 30 s reserve < 100 s
    clock.advance(25.0)
    assert checker.check_save()  # 75 s + 30 s reserve >= 100 s

    plain = TimeoutChecker("00:00:01:40", fit_last_save_time=False)
    plain.start_iterations()
    clock.advance(99.0)
    assert not plain.check_save()
    clock.advance(1.0)
    assert plain.check_save()

    assert not TimeoutChecker(None, fit_last_save_time=True).check_save()


def test_stop_signal_asks_to_save_and_is_handed_back_after_close() -> None:
    import gc
    import signal

    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        checker = TimeoutChecker(None, fit_last_save_time=True)
        checker.stop_on_signals([signal.SIGUSR1])
        assert not checker.check_save()
        assert checker.stop_reason == "checkpointing.checkpoint_must_save_by reached"
        signal.raise_signal(signal.SIGUSR1)
        # Repeats (uv forwarding what SLURM also sent) still mean "save, then stop".
        signal.raise_signal(signal.SIGUSR1)
        assert checker.check_save() and checker.stop_reason == "SIGUSR1 received"
        assert seen == []
        checker.close()
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]

        # A checker dropped without close() no longer swallows the signal.
        dropped = TimeoutChecker(None, fit_last_save_time=True)
        dropped.stop_on_signals([signal.SIGUSR1])
        del dropped
        gc.collect()
        signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, previous)
