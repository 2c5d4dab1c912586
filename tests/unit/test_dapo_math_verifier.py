"""DAPO's answer check (``math_verify_impl: dapo_math_verify``) against math-verify's on the cases where they
differ, and its normalisation rules."""

from __future__ import annotations

import pytest

from nemo_rl.environments.dapo_math_verifier import (
    NO_ANSWER,
    RESPONSE_TAIL_CHARS,
    extract_answer,
    normalize_answer,
    score_dapo_response,
)
from nemo_rl.environments.math_verifier import verify_math_answer


@pytest.mark.parametrize(
    ("response", "ground_truth", "dapo", "hf"),
    [
        # DAPO's prompts ask for an "Answer:" line; math-verify reads only boxed answers.
        ("So the sum is 34.\nAnswer: 34", "34", 1.0, 0.0),
        ("The sum is \\boxed{34}.", "34", 0.0, 1.0),
        # DAPO compares normalised text; math-verify compares values.
        ("Answer: \\boxed{0.5}", "\\frac{1}{2}", 0.0, 1.0),
        # Both agree where the text is the same after normalisation.
        ("Answer: $\\boxed{12}$", "12", 1.0, 1.0),
    ],
)
def test_dapo_and_math_verify_differ_where_expected(
    response: str, ground_truth: str, dapo: float, hf: float
) -> None:
    assert score_dapo_response(response, ground_truth)[0] == dapo
    assert verify_math_answer(response, ground_truth) == hf


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("x = \\frac12", "\\frac{1}{2}"),  # the part after the last "=", shorthand spelled out
        ("1,000 dollars", "1000"),  # a unit dropped, then the thousands separator of an integer
        ("1,2", "12"),  # an "integer" once the commas go: DAPO's rule, not a list
        ("\\text{(B)}", "(B)"),
        ("90^\\circ", "90"),
        ("$\\sqrt2$", "\\sqrt{2}"),
        ("5 \\text{ cm}", "5"),
        (" 7 ", "7"),
    ],
)
def test_normalisation(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


def test_answer_extraction() -> None:
    # The last "Answer:" of any case wins; the value may start on the next line; it ends with its line.
    assert extract_answer("Answer: 3\nanswer: 4\nDone.") == "4"
    assert extract_answer("ANSWER:\n42\nthanks") == "42"
    assert extract_answer("no final line") == NO_ANSWER
    # Only the response's tail is read: an answer followed by a long text is not seen.
    late = "Answer: 7\n" + "x" * RESPONSE_TAIL_CHARS
    assert extract_answer(late) == NO_ANSWER
    assert score_dapo_response(late, "7") == (0.0, NO_ANSWER)
    assert score_dapo_response("Answer: 1,000", "1000") == (1.0, "1000")
