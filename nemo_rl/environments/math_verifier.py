"""Checking a math answer: the last ``\\boxed{...}`` of a response against a ground truth, with math-verify.

:func:`verify_math_answer` has no time limit of its own (math-verify's ``signal.alarm`` timeouts are turned
off because they fail outside a main thread): run it in a :class:`~nemo_rl.environments.verifier_pool.
VerifierPool`, which enforces one.
"""

from __future__ import annotations

import logging
import re

from math_verify import LatexExtractionConfig, parse, verify

# math-verify warns on every call that its timeouts are disabled; the pool enforces ours.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_LATEX_ONLY = [LatexExtractionConfig(boxed_match_priority=0)]


def extract_last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    One pass pairs every brace with its match, so a response full of unclosed boxes costs linear time.
    """
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    closing: dict[int, int] = {}
    open_positions: list[int] = []
    for pos, char in enumerate(text):
        if char == "{":
            open_positions.append(pos)
        elif char == "}" and open_positions:
            closing[open_positions.pop()] = pos
    for match in reversed(matches):
        end = closing.get(match.end() - 1)
        if end is not None:
            return text[match.end() : end].strip()
        # Unbalanced (cut off by the length limit): try an earlier box.
    return None


def _normalise(answer: str) -> str:
    return re.sub(r"\s+", "", answer).rstrip(".").strip("$")


def verify_math_answer(response: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer of ``response`` equals ``ground_truth`` mathematically, else 0.0.

    ``ground_truth`` is a bare answer (``"\\frac{1}{2}"``, ``"0.5"``) or a reference solution whose last
    boxed answer is used. A response without a boxed answer scores 0.
    """
    answer = extract_last_boxed(response)
    if answer is None:
        return 0.0
    gold_answer = extract_last_boxed(ground_truth) or ground_truth.strip()
    if not answer or not gold_answer:
        # An empty ground truth matches nothing (not even an empty box).
        return 0.0
    if _normalise(answer) == _normalise(gold_answer):
        return 1.0
    gold = parse(f"\\boxed{{{gold_answer}}}", extraction_config=_LATEX_ONLY, parsing_timeout=None)
    predicted = parse(f"\\boxed{{{answer}}}", extraction_config=_LATEX_ONLY, parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


def score_math_response(response: str, ground_truth: str) -> tuple[float, str | None]:
    """:func:`verify_math_answer` and the extracted answer, both computed in the verifier process (so both
    are under its time and memory limits)."""
    return verify_math_answer(response, ground_truth), extract_last_boxed(response)
