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
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:pos].strip()
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
    if _normalise(answer) == _normalise(gold_answer):
        return 1.0
    gold = parse(f"\\boxed{{{gold_answer}}}", extraction_config=_LATEX_ONLY, parsing_timeout=None)
    predicted = parse(f"\\boxed{{{answer}}}", extraction_config=_LATEX_ONLY, parsing_timeout=None)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0
