"""Evaluation metrics over n sampled responses per problem.

For one problem with ``n`` responses of which ``c`` are correct (reward >= :data:`CORRECT_REWARD`):

- **pass@k** is the chance that at least one of ``k`` responses drawn without replacement from the ``n`` is
  correct, ``1 - C(n - c, k) / C(n, k)``: the unbiased estimator of Chen et al. (2021), exact for every
  ``k <= n`` (pass@1 is the fraction correct).
- **cons@k** (majority vote) is the chance that the most frequent extracted answer among ``k`` responses
  drawn without replacement is correct. Responses with no extracted answer do not vote (a draw with no votes
  scores 0); a tie between answers is broken uniformly at random, so a tie counts the tied correct answer's
  share. It is computed exactly, by counting subsets, not by sampling. Answers vote together only when their
  extracted strings are equal.

Benchmark metrics are the means over problems, each with its standard error (the standard deviation of the
per-problem values over the square root of the number of problems): the uncertainty from the choice of
problems and samples, which is what decides whether two models differ.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

CORRECT_REWARD = 1.0
"""A response is correct when its reward reaches this (the math environment gives 1 or 0)."""


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)``: the chance that some of ``k`` of the ``n`` samples is correct."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct={num_correct} is outside [0, n={num_samples}]")
    if num_samples - num_correct < k:
        return 1.0
    # Exact integers: the ratio is formed once, so large n loses no precision.
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def _ways_others_at_most(others: Sequence[int], cap: int, budget: int) -> dict[tuple[int, int], int]:
    """``{(chosen, ties): ways}``: ways to draw ``chosen <= budget`` responses from answer groups of sizes
    ``others`` taking at most ``cap`` from each, ``ties`` of them taking exactly ``cap``."""
    ways: dict[tuple[int, int], int] = {(0, 0): 1}
    for size in others:
        grown: dict[tuple[int, int], int] = defaultdict(int)
        for (chosen, ties), count in ways.items():
            for x in range(min(size, cap, budget - chosen) + 1):
                grown[(chosen + x, ties + (x == cap))] += count * math.comb(size, x)
        ways = grown
    return ways


def cons_at_k(answers: Sequence[str | None], rewards: Sequence[float], k: int) -> float:
    """The chance that the majority answer of ``k`` of the responses, drawn without replacement, is correct
    (see the module docstring for abstentions and ties).

    Args:
        answers: Each response's extracted answer (``None``: none could be extracted).
        rewards: Each response's reward; an answer's correctness is the share of its responses that are
            correct (the same for all of them when the reward depends on the answer only).
        k: Responses per vote, ``1 <= k <= len(answers)``.
    """
    n = len(answers)
    if len(rewards) != n:
        raise ValueError(f"{n} answers but {len(rewards)} rewards")
    if not 1 <= k <= n:
        raise ValueError(f"cons@k needs 1 <= k <= n, got k={k}, n={n}")
    groups: dict[str, list[float]] = defaultdict(list)
    num_abstaining = 0
    for answer, reward in zip(answers, rewards, strict=True):
        if answer is None:
            num_abstaining += 1
        else:
            groups[answer].append(float(reward >= CORRECT_REWARD))
    sizes = {answer: len(scores) for answer, scores in groups.items()}
    expected = 0.0
    for answer, scores in groups.items():
        share_correct = sum(scores) / len(scores)
        if share_correct == 0.0:
            continue
        others = [size for other, size in sizes.items() if other != answer]
        wins = 0.0
        # The answer wins a draw that takes t of its responses when no other answer gets more than t;
        # with j others at exactly t it wins 1 / (j + 1) of such draws.
        for t in range(1, min(sizes[answer], k) + 1):
            for (chosen, ties), ways in _ways_others_at_most(others, t, k - t).items():
                rest = k - t - chosen
                if rest <= num_abstaining:
                    wins += math.comb(sizes[answer], t) * ways * math.comb(num_abstaining, rest) / (ties + 1)
        expected += share_correct * wins / math.comb(n, k)
    return expected


def metric_ks(k_value: int, num_samples: int) -> list[int]:
    """The k of the reported pass@k and cons@k: 1, ``k_value`` and ``num_samples``."""
    return sorted({1, k_value, num_samples})


def problem_metrics(
    rewards: Sequence[float], answers: Sequence[str | None], ks: Iterable[int]
) -> dict[str, float]:
    """One problem's ``pass@k`` and ``cons@k`` for each ``k`` from its responses' rewards and answers."""
    num_correct = sum(r >= CORRECT_REWARD for r in rewards)
    metrics: dict[str, float] = {}
    for k in ks:
        metrics[f"pass@{k}"] = pass_at_k(len(rewards), num_correct, k)
        metrics[f"cons@{k}"] = cons_at_k(answers, rewards, k)
    return metrics


def mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error (0 for fewer than two values)."""
    if not values:
        raise ValueError("no values to average")
    mean = statistics.fmean(values)
    stderr = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, stderr


def summarize(per_problem: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Mean over problems of every per-problem metric, and its standard error as ``<name>_stderr``."""
    if not per_problem:
        raise ValueError("no problems to summarize")
    summary: dict[str, float] = {}
    for name in per_problem[0]:
        mean, stderr = mean_and_stderr([p[name] for p in per_problem])
        summary[name] = mean
        summary[f"{name}_stderr"] = stderr
    return summary
