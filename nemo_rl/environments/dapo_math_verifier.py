"""DAPO's math check (``env.math.math_verify_impl: dapo_math_verify``): the last ``Answer: ...`` line of a
response, normalised, must equal the normalised ground truth as text.

This is the rule of DAPO's reward (verl's ``math_dapo``, which NeMo RL's ``dapo_math_verify`` follows), written
here from that rule:

- Only the response's last :data:`RESPONSE_TAIL_CHARS` characters are read (the final answer is at the end).
- The answer is what follows the last ``Answer:`` (any case, spaces and line breaks allowed before the
  value) up to the end of its line; a response without one answers ``[INVALID]``.
- Both answers are normalised the Minerva way (:func:`normalize_answer`: the part after the last ``=``, no
  spaces, units, ``\\text{}`` / ``\\boxed{}`` wrappers or ``$``, shorthand ``\\frac12`` spelled out,
  thousands separators dropped from integers) and compared as strings: ``0.5`` and ``\\frac{1}{2}`` differ,
  where math-verify (``hf_math_verify``) would call them equal, and ``\\boxed{}`` answers without an
  ``Answer:`` line score 0, where math-verify reads them.

Every step is a regular expression or a string operation on at most a few hundred characters, so it runs
in the environment itself, without verifier processes or a time limit.
"""

from __future__ import annotations

import re

RESPONSE_TAIL_CHARS = 300
"""Characters at the end of a response that are read (DAPO's: the longest MATH-500 answer is 159)."""

NO_ANSWER = "[INVALID]"
"""The answer of a response without an ``Answer:`` line (after normalisation, it equals no ground truth
that a dataset would hold)."""

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

_REPLACEMENTS = (
    # Articles, escaped dollars and every kind of space go first; "\text{and}" joins list items.
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
"""Substitutions applied in order (DAPO's list: order matters, ``"an "`` before ``"a "``)."""

_DROPPED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
"""Units, words and spacing macros removed wherever they occur, in order (DAPO's list)."""

_UNWRAP = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # keep the first $...$ span only
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    # Shorthand TeX: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}.
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),
)
"""Wrappers removed and shorthand spelled out, in order, by regular expression."""


def normalize_answer(answer: str) -> str:
    """``answer`` in DAPO's normal form (see the module docstring), so equal answers compare equal as text."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        answer = answer.replace(old, new)
    for word in _DROPPED:
        answer = answer.replace(word, "")
    for pattern, replacement in _UNWRAP:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(response: str) -> str:
    """The raw answer of ``response``: the rest of the line after its last ``Answer:`` within the last
    :data:`RESPONSE_TAIL_CHARS` characters, or :data:`NO_ANSWER`."""
    found = _ANSWER_LINE.findall(response[-RESPONSE_TAIL_CHARS:])
    return found[-1] if found else NO_ANSWER


def score_dapo_response(response: str, ground_truth: str) -> tuple[float, str]:
    """1.0 if the normalised answer of ``response`` equals the normalised ``ground_truth``, else 0.0, and the
    normalised answer (what the environment records as the extracted answer)."""
    answer = normalize_answer(extract_answer(response))
    return (1.0 if answer == normalize_answer(ground_truth) else 0.0), answer
