"""Reward functions of the vision-language environments (NeMo RL's names; see
:data:`nemo_rl.config.vlm_env.RewardFunctionName`), and their weighted combination.

Each function takes ``(ground_truth, response)`` and returns a :class:`RewardTerm`: the score, whether the
answer is correct (``None`` for a term that does not judge correctness, such as the format), and the answer it
read (for cons@k's majority vote).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from nemo_rl.config.vlm_env import RewardFunctionConfig
from nemo_rl.environments.math_verifier import extract_last_boxed, verify_math_answer


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """What one reward function says about one response."""

    score: float
    correct: bool | None
    """Whether the answer is right; ``None`` when the function does not judge correctness."""
    answer: str | None = None
    """The answer the function read from the response, if any."""


RewardFn = Callable[[str, str], RewardTerm]
"""``fn(ground_truth, response)``."""


def _tagged(response: str, tag: str) -> str | None:
    """The text between the first ``<tag>`` and the last ``</tag>`` (NeMo RL's greedy match), or ``None``."""
    match = re.search(rf"<{tag}>([\s\S]*)</{tag}>", response)
    return match.group(1) if match else None


def format_reward(
    ground_truth: str, response: str, think_tag: str = "think", answer_tag: str = "answer"
) -> RewardTerm:
    """0.25 for a ``<think>`` span plus 0.75 for an ``<answer>`` span; says nothing about correctness."""
    del ground_truth
    score = 0.25 * (_tagged(response, think_tag) is not None) + 0.75 * (
        _tagged(response, answer_tag) is not None
    )
    return RewardTerm(score, None)


def _alnum(text: str) -> str:
    return "".join(c for c in text if c.isalnum()).lower()


def exact_alnum_reward(ground_truth: str, response: str, answer_tag: str = "answer") -> RewardTerm:
    """1 when the ``<answer>`` text equals the ground truth, comparing letters and digits only, any case."""
    answer = _tagged(response, answer_tag)
    correct = answer is not None and _alnum(answer) == _alnum(ground_truth)
    return RewardTerm(float(correct), correct, answer if answer is None else answer.strip())


def math_expr_reward(ground_truth: str, response: str, answer_tag: str = "answer") -> RewardTerm:
    """1 when the ``<answer>`` text equals the ground truth mathematically (math-verify, in this process)."""
    answer = _tagged(response, answer_tag)
    if answer is None:
        return RewardTerm(0.0, False)
    score = verify_math_answer(f"\\boxed{{{answer.strip()}}}", ground_truth)
    return RewardTerm(score, score > 0, answer.strip())


Box = tuple[float, float, float, float]
"""``(x1, y1, x2, y2)``."""


def _box(text: str) -> Box | None:
    parts = text.replace("[", "").replace("]", "").split(",")
    try:
        x1, y1, x2, y2 = (float(p) for p in parts)
    except ValueError:
        return None
    return x1, y1, x2, y2


def _area(box: Box) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def iou_and_giou(truth: Box, guess: Box) -> tuple[float, float]:
    """The IoU of two boxes, and their generalised IoU: the IoU minus the share of their enclosing box that
    neither covers (in [-1, 1], so it still ranks boxes that do not overlap)."""
    inter = _area(
        (max(truth[0], guess[0]), max(truth[1], guess[1]), min(truth[2], guess[2]), min(truth[3], guess[3]))
    )
    union = max(1e-3, _area(truth) + _area(guess) - inter)
    hull = max(
        1e-3,
        _area(
            (
                min(truth[0], guess[0]),
                min(truth[1], guess[1]),
                max(truth[2], guess[2]),
                max(truth[3], guess[3]),
            )
        ),
    )
    return inter / union, inter / union - (hull - union) / hull


def bbox_giou_reward(
    ground_truth: str, response: str, giou_penalty_thres: float = 10.0, answer_tag: str = "answer"
) -> RewardTerm:
    """The ``<answer>`` box's IoU with the ground truth's when it reaches ``giou_penalty_thres``, else their
    generalised IoU; correct above 0.5."""
    answer = _tagged(response, answer_tag)
    guess = None if answer is None else _box(answer)
    truth = _box(ground_truth)
    if answer is None or guess is None or truth is None:
        return RewardTerm(0.0, False, answer)
    iou, giou = iou_and_giou(truth, guess)
    score = iou if iou >= giou_penalty_thres else giou
    return RewardTerm(score, score > 0.5, answer.strip())


_INTEGER = re.compile(r"[+-]?\d+")


def boxed_integer_reward(ground_truth: str, response: str) -> RewardTerm:
    """1 when the response's last ``\\boxed{}`` holds an integer equal to the ground truth's (a count)."""
    answer = extract_last_boxed(response)
    text = None if answer is None else answer.strip()
    correct = (
        text is not None
        and _INTEGER.fullmatch(text) is not None
        and _INTEGER.fullmatch(ground_truth.strip()) is not None
        and int(text) == int(ground_truth.strip())
    )
    return RewardTerm(float(correct), correct, text)


REWARD_FUNCTIONS: dict[str, Callable[..., RewardTerm]] = {
    "format": format_reward,
    "exact_alnum": exact_alnum_reward,
    "math_expr": math_expr_reward,
    "bbox_giou": bbox_giou_reward,
    "boxed_integer": boxed_integer_reward,
}
"""The functions by their config name."""


@dataclasses.dataclass(frozen=True)
class CombinedReward:
    """The weighted sum of reward functions (weights renormalised to 1)."""

    terms: Sequence[tuple[RewardFn, float]]

    @classmethod
    def from_config(cls, functions: Sequence[RewardFunctionConfig]) -> CombinedReward:
        """The reward of an environment's ``reward_functions``."""
        total = sum(f.weight for f in functions)
        return cls(
            [(functools.partial(REWARD_FUNCTIONS[f.name], **f.kwargs), f.weight / total) for f in functions]
        )

    def __call__(self, ground_truth: str, response: str) -> RewardTerm:
        """The combined score; correct when every term that judges correctness says so (and one does); the
        first answer a term read."""
        results = [(fn(ground_truth, response), weight) for fn, weight in self.terms]
        verdicts = [r.correct for r, _ in results if r.correct is not None]
        answers: list[Any] = [r.answer for r, _ in results if r.answer is not None]
        return RewardTerm(
            score=sum(r.score * weight for r, weight in results),
            correct=bool(verdicts) and all(verdicts),
            answer=answers[0] if answers else None,
        )
