"""pass@k and cons@k against brute force over every k-subset of the responses; summaries and their errors."""

from __future__ import annotations

import collections
import itertools
import math
import random

import pytest

from nemo_rl.evals.metrics import (
    cons_at_k,
    mean_and_stderr,
    metric_ks,
    pass_at_k,
    problem_metrics,
    summarize,
)


def _subsets(n: int, k: int) -> list[tuple[int, ...]]:
    return list(itertools.combinations(range(n), k))


def brute_pass_at_k(rewards: list[float], k: int) -> float:
    subsets = _subsets(len(rewards), k)
    return sum(any(rewards[i] >= 1.0 for i in s) for s in subsets) / len(subsets)


def brute_cons_at_k(answers: list[str | None], rewards: list[float], k: int) -> float:
    """Majority vote over every k-subset: abstentions do not vote, ties are shared equally."""
    subsets = _subsets(len(answers), k)
    total = 0.0
    for subset in subsets:
        votes = collections.Counter(answers[i] for i in subset if answers[i] is not None)
        if not votes:
            continue
        top = max(votes.values())
        tied = [a for a, c in votes.items() if c == top]
        for answer in tied:
            holders = [i for i, a in enumerate(answers) if a == answer]
            total += sum(rewards[i] >= 1.0 for i in holders) / len(holders) / len(tied)
    return total / len(subsets)


def test_pass_at_k_closed_forms() -> None:
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(8, 1, 8) == 1.0
    # 1 - C(5, 2) / C(8, 2)
    assert pass_at_k(8, 3, 2) == pytest.approx(1 - 10 / 28)
    # Large n keeps full precision (exact integer binomials).
    assert pass_at_k(1024, 1, 1) == pytest.approx(1 / 1024)


def test_pass_and_cons_match_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        answers = [rng.choice([None, "1", "2", "3", "-4"]) for _ in range(n)]
        rewards = [1.0 if a == "2" else 0.0 for a in answers]
        k = rng.randint(1, n)
        assert pass_at_k(n, sum(r >= 1.0 for r in rewards), k) == pytest.approx(brute_pass_at_k(rewards, k))
        assert cons_at_k(answers, rewards, k) == pytest.approx(
            brute_cons_at_k(answers, rewards, k), abs=1e-12
        )


def test_cons_at_k_votes_ties_and_abstentions() -> None:
    # A clear majority for the right answer wins every full vote; cons@1 is the accuracy.
    answers = ["5", "5", "5", "7"]
    rewards = [1.0, 1.0, 1.0, 0.0]
    assert cons_at_k(answers, rewards, 4) == 1.0
    assert cons_at_k(answers, rewards, 1) == pytest.approx(0.75)
    # A 2-2 tie is a coin flip.
    assert cons_at_k(["5", "5", "7", "7"], [1.0, 1.0, 0.0, 0.0], 4) == pytest.approx(0.5)
    # Responses without an answer do not vote: one correct vote against none wins.
    assert cons_at_k(["5", None, None], [1.0, 0.0, 0.0], 3) == 1.0
    # No answer at all: nothing wins.
    assert cons_at_k([None, None], [0.0, 0.0], 2) == 0.0
    # The majority can be wrong while pass@k is right.
    assert cons_at_k(["7", "7", "5"], [0.0, 0.0, 1.0], 3) == 0.0
    assert pass_at_k(3, 1, 3) == 1.0


def test_k_must_fit_the_samples() -> None:
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        cons_at_k(["1"], [1.0], 2)
    with pytest.raises(ValueError, match="answers but"):
        cons_at_k(["1", "2"], [1.0], 1)


def test_problem_metrics_and_summary() -> None:
    assert metric_ks(4, 8) == [1, 4, 8]
    assert metric_ks(1, 1) == [1]
    first = problem_metrics([1.0, 0.0, 1.0, 0.0], ["3", "4", "3", None], [1, 4])
    assert first == {
        "pass@1": 0.5,
        "cons@1": 0.5,
        "pass@4": 1.0,
        "cons@4": 1.0,
    }
    second = problem_metrics([0.0, 0.0, 0.0, 0.0], ["1", "1", "2", "2"], [1, 4])
    summary = summarize([first, second])
    assert summary["pass@1"] == pytest.approx(0.25)
    assert summary["pass@1_stderr"] == pytest.approx(0.25)
    assert summary["cons@4"] == pytest.approx(0.5)
    mean, stderr = mean_and_stderr([0.0, 1.0, 1.0, 0.0])
    assert mean == 0.5
    assert stderr == pytest.approx(math.sqrt(1 / 3) / 2)
    assert mean_and_stderr([0.3]) == (0.3, 0.0)
