"""Checking a math answer: the last ``\\boxed{...}`` of a response against a ground truth, with math-verify.

:func:`verify_math_answer` has no time limit of its own (math-verify's ``signal.alarm`` timeouts are turned
off because they fail outside a main thread): run it in a :class:`~nemo_rl.environments.verifier_pool.
VerifierPool`, which enforces one.

math-verify (and sympy, half a second of CPU) is imported on the first answer that needs it, not with this
module: the math environment's actor imports the module for the certain verdicts it decides itself
(:func:`quick_verdict`) and never runs math-verify; its verifier processes are forked from a server that
imported and warmed it up once (:mod:`nemo_rl.environments.math_verifier_warm_up`).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

# math-verify warns on every call that its timeouts are disabled; the pool enforces ours.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


@functools.cache
def _latex_only() -> list[Any]:
    """math-verify's extraction config for a bare boxed LaTeX answer."""
    from math_verify import LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0)]


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


_INTEGER = re.compile(r"[-+]?\d+")


MATH_VERIFY_WARM_UP = (("\\boxed{1/2}", "0.5"), ("\\boxed{x+1}", "4"), ("\\boxed{3.0}", "3"))
"""Answers verified once before any real one: math-verify's first fraction, symbol and decimal each take
about 0.3 s (parser construction, lazy sympy imports), later ones microseconds to milliseconds."""


def gold_answer(ground_truth: str) -> str:
    """The answer a ground truth stands for: its last boxed answer, or the whole (stripped) text."""
    return extract_last_boxed(ground_truth) or ground_truth.strip()


def quick_verdict(answer: str | None, gold: str) -> float | None:
    """The score of an extracted ``answer`` against ``gold`` when it is certain without math-verify, else None.

    No (or an empty) boxed answer and an empty ground truth score 0; the same text (ignoring whitespace, a
    final period and ``$``) scores 1; two plain integers score by value (math-verify compares integers
    exactly). Everything else (fractions,
    expressions, decimals) needs math-verify. Most answers of a trained model take this path, which is
    microseconds instead of a round trip to a verifier process and a sympy parse.
    """
    if not answer or not gold:
        # An empty ground truth matches nothing, not even an empty box.
        return 0.0
    answer, gold = _normalise(answer), _normalise(gold)
    if answer == gold:
        return 1.0
    if _INTEGER.fullmatch(answer) and _INTEGER.fullmatch(gold):
        return 1.0 if _canonical_integer(answer) == _canonical_integer(gold) else 0.0
    return None


def _canonical_integer(text: str) -> str:
    # By string, not int(): Python refuses to convert integers of more than 4300 digits.
    digits = text.lstrip("+-").lstrip("0") or "0"
    return f"-{digits}" if text.startswith("-") and digits != "0" else digits


def verify_math_answer(response: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer of ``response`` equals ``ground_truth`` mathematically, else 0.0.

    ``ground_truth`` is a bare answer (``"\\frac{1}{2}"``, ``"0.5"``) or a reference solution whose last
    boxed answer is used. A response without a boxed answer scores 0. Certain cases are decided by
    :func:`quick_verdict`, the rest by math-verify.
    """
    answer = extract_last_boxed(response)
    gold_answer_text = gold_answer(ground_truth)
    verdict = quick_verdict(answer, gold_answer_text)
    if verdict is not None:
        return verdict
    from math_verify import parse, verify

    gold = parse(f"\\boxed{{{gold_answer_text}}}", extraction_config=_latex_only(), parsing_timeout=None)
    predicted = parse(f"\\boxed{{{answer}}}", extraction_config=_latex_only(), parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0


def score_math_response(response: str, ground_truth: str) -> tuple[float, str | None]:
    """:func:`verify_math_answer` and the extracted answer, both computed in the verifier process (so both
    are under its time and memory limits)."""
    return verify_math_answer(response, ground_truth), extract_last_boxed(response)
