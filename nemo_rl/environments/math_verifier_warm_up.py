"""Imported by the fork server of the math environment's verifier processes (``VerifierPool(preload=...)``).

Importing it imports math-verify and sympy and verifies one answer of each kind whose first check is slow
(:data:`~nemo_rl.environments.math_verifier.MATH_VERIFY_WARM_UP`), so every verifier process forked from the
server, and every replacement of one that was killed, starts with those costs paid: once per environment
rather than once per process, and never on a training step's answers.
"""

from __future__ import annotations

from nemo_rl.environments.math_verifier import MATH_VERIFY_WARM_UP, verify_math_answer

for _response, _ground_truth in MATH_VERIFY_WARM_UP:
    verify_math_answer(_response, _ground_truth)
