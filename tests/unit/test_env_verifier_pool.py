"""Math answer checking and the time-limited verifier pool.

This module imports nothing heavy (no torch, no Ray): its verify functions run in the pool's worker
processes, which import it, and every replaced worker would pay for heavy imports again.
"""

from __future__ import annotations

import os
import time

import pytest
from math_verify import LatexExtractionConfig, parse, verify

from nemo_rl.environments.math_verifier import extract_last_boxed, quick_verdict, verify_math_answer
from nemo_rl.environments.verifier_pool import VerifierPool

# sympy tries to evaluate this tower exactly and never returns: a real answer that hangs math-verify.
HANGING_ANSWER = "The answer is \\boxed{9^{9^{9^{9^{9}}}}}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} first, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("nested \\boxed{\\sqrt{x^{2}}} ok", "\\sqrt{x^{2}}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{3} then cut off \\boxed{\\frac{1", "3"),
        ("no box at all: 42", None),
        ("\\boxed{2} } \\boxed{5", "2"),
        ("\\boxed{" * 20_000 + "\\boxed{1}", "1"),  # many unclosed boxes: linear time
    ],
)
def test_extract_last_boxed(text: str, expected: str | None) -> None:
    assert extract_last_boxed(text) == expected


@pytest.mark.parametrize(
    ("response", "ground_truth", "score"),
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{2}{4}", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("The answer is 4.", "4", 0.0),  # no boxed answer
        ("\\boxed{4} wait, \\boxed{5}", "4", 0.0),  # the last box counts
        ("\\boxed{ 12 }", "Adding up, we get \\boxed{12}.", 1.0),  # ground truth given as a solution
        ("\\boxed{}", "", 0.0),  # an empty ground truth matches nothing
        ("\\boxed{}", " ", 0.0),
    ],
)
def test_verify_math_answer(response: str, ground_truth: str, score: float) -> None:
    assert verify_math_answer(response, ground_truth) == score


@pytest.mark.parametrize(
    ("answer", "gold", "verdict"),
    [
        (None, "4", 0.0),
        ("", "", 0.0),
        ("4", "4", 1.0),
        (" 4 ", "4", 1.0),
        ("\\frac{1}{2}", "\\frac{1}{2}", 1.0),
        ("56", "57", 0.0),
        ("+5", "5", 1.0),
        ("007", "7", 1.0),
        ("-0", "0", 1.0),
        ("-3", "3", 0.0),
        ("1" * 5000, "1" * 5000 + "0", 0.0),  # beyond int()'s digit limit
        ("0.5", "\\frac{1}{2}", None),  # needs math-verify
        ("5.0", "5", None),
        ("1,000", "1000", None),
        ("x+1", "1+x", None),
    ],
)
def test_quick_verdict_is_certain_or_defers(answer: str | None, gold: str, verdict: float | None) -> None:
    assert quick_verdict(answer, gold) == verdict
    if verdict is not None and answer is not None and len(answer) < 100:
        # Every certain verdict is what math-verify itself says.
        latex = [LatexExtractionConfig(boxed_match_priority=0)]
        expected = verify(
            parse(f"\\boxed{{{gold}}}", extraction_config=latex, parsing_timeout=None),
            parse(f"\\boxed{{{answer}}}", extraction_config=latex, parsing_timeout=None),
            timeout_seconds=None,
        )
        assert verdict == float(expected)


def raising_verify(response: str, ground_truth: str) -> float:
    raise ValueError(f"cannot verify {response!r}")


def crashing_verify(response: str, ground_truth: str) -> float:
    if response == "crash":
        os._exit(3)  # a verifier that dies hard (segfault, OOM kill)
    return float(response == ground_truth)


def hungry_verify(response: str, ground_truth: str) -> tuple[float, str]:
    if response == "hog":
        bytearray(2**30)  # an answer whose check allocates without bound
    return float(response == ground_truth), response.upper()


def test_pool_times_out_a_hanging_answer_and_keeps_working() -> None:
    # Started on first use (as the math environment's pool): nothing runs until an answer arrives. As there,
    # the fork server imports and warms up math-verify before it forks the verifier processes: a process that
    # imported it on its first answer would spend that answer's 2 s limit doing so on a loaded machine.
    with VerifierPool(
        verify_math_answer,
        num_workers=2,
        timeout_s=2.0,
        preload=["nemo_rl.environments.math_verifier_warm_up"],
        start_on_first_use=True,
    ) as pool:
        assert not pool.started and pool.verify([], []) == [] and not pool.started
        pool.verify(["\\boxed{1}"], ["1"])
        assert pool.started
        start = time.monotonic()
        outcomes = pool.verify(
            ["\\boxed{1}", HANGING_ANSWER, "\\boxed{2}", "\\boxed{3}", "\\boxed{5}"],
            ["1", "2", "2", "4", "5"],
        )
        elapsed = time.monotonic() - start
        assert [o.score for o in outcomes] == [1.0, 0.0, 1.0, 0.0, 1.0]
        assert [o.timed_out for o in outcomes] == [False, True, False, False, False]
        # One answer's limit plus scheduling slack; without the limit this call would never return.
        assert elapsed < 2.0 + 30.0
        assert pool.num_timeouts == 1 and pool.num_restarts == 1
        # The replacement process verifies normally.
        assert [o.score for o in pool.verify(["\\boxed{x+1}"] * 3, ["1+x"] * 3)] == [1.0, 1.0, 1.0]


def test_pool_survives_exceptions_and_crashing_processes() -> None:
    with VerifierPool(raising_verify, num_workers=1, timeout_s=30.0) as pool:
        (outcome,) = pool.verify(["a"], ["a"])
        assert outcome.score == 0.0 and outcome.error is not None and "cannot verify" in outcome.error
    with VerifierPool(crashing_verify, num_workers=1, timeout_s=30.0) as pool:
        outcomes = pool.verify(["x", "crash", "y", "crash", "z"], ["x", "crash", "y", "crash", "q"])
        assert [o.score for o in outcomes] == [1.0, 0.0, 1.0, 0.0, 0.0]
        assert outcomes[1].error is not None and "died" in outcomes[1].error
        assert pool.num_restarts == 2
    # A memory limit per process, responses cut to their tail, and the extracted answer sent back.
    with VerifierPool(
        hungry_verify, num_workers=1, timeout_s=30.0, memory_limit_mb=256, max_response_chars=4
    ) as pool:
        hog, tail = pool.verify(["hog", "abcdefgh"], ["hog", "efgh"])
        assert hog.score == 0.0 and hog.error is not None and "MemoryError" in hog.error
        assert (tail.score, tail.answer) == (1.0, "EFGH") and pool.num_restarts == 0


def test_pool_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        VerifierPool(verify_math_answer, num_workers=0, timeout_s=1.0)
    with pytest.raises(ValueError, match="positive"):
        VerifierPool(verify_math_answer, num_workers=1, timeout_s=0.0)
