"""The code environment: the model writes a Python function, and its reward is the fraction of the problem's
unit tests that pass, run in the sandbox.

Single turn, like the math environment. A problem's ground truth (``extra_env_info["ground_truth"]``, the
``expected_answer`` of a data row) is a JSON object::

    {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"], "setup": "import math"}

``tests`` are ``assert`` statements comparing what the solution computes with a literal (the forms are in
:mod:`nemo_rl.environments.code_tests`); ``setup`` (optional) runs before the solution. The solution is the
response's last fenced code block (```` ```python ```` or a bare ```` ``` ````); a response without one scores
0. Each response runs once in a fresh sandbox (:mod:`nemo_rl.environments.sandbox`, limits from
``env.code.sandbox``), which evaluates the solution's side of every test and prints the values as plain data;
this process then decides which tests passed. The reward is the share that did, in [0, 1]: the expected values
never enter the solution's process, so neither printing nor faking a verdict pays (docs/security.md). A run
that hits a limit scores the values it reported before.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch

from nemo_rl.config.env import CodeEnvConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.code_tests import HARNESS, UnitTest, parse_test, reported_values
from nemo_rl.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    check_ground_truths,
    check_step_batch,
)
from nemo_rl.environments.metrics import batch_rewards, group_ids, last_assistant_text, pass_at_samples
from nemo_rl.environments.sandbox import Sandbox

CodeMetadata = dict[str, Any]
"""Per-sample state: ``ground_truth`` (the tests, from the dataset); each step adds ``num_tests``,
``num_tests_passed``, ``has_code`` and ``timed_out``."""

_CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class UnitTests:
    """A problem's unit tests, read from its ground truth."""

    tests: list[UnitTest]
    """The tests, each split into what the solution computes and the check (:func:`parse_test`)."""

    setup: str = ""
    """Code run before the solution (imports the tests assume)."""

    @classmethod
    def from_ground_truth(cls, ground_truth: str) -> UnitTests:
        """Read ``{"tests": [...], "setup": "..."}``.

        Raises:
            ValueError: the ground truth is not such an object, has no tests, or a test is not of a form
                :func:`parse_test` accepts.
        """
        try:
            spec = json.loads(ground_truth)
        except json.JSONDecodeError as err:
            raise ValueError(f"a code problem's ground truth must be JSON with 'tests'; {err}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("tests"), list) or not spec["tests"]:
            raise ValueError(
                f"a code problem's ground truth needs a non-empty 'tests' list, got {ground_truth!r}"
            )
        if not all(isinstance(t, str) for t in spec["tests"]) or not isinstance(spec.get("setup", ""), str):
            raise ValueError("a code problem's 'tests' must be strings, and its 'setup' a string")
        unknown = set(spec) - {"tests", "setup"}
        if unknown:
            raise ValueError(f"a code problem's ground truth has unknown keys {sorted(unknown)}")
        return cls(tests=[parse_test(t) for t in spec["tests"]], setup=spec.get("setup", ""))


def extract_code(response: str) -> str | None:
    """The last fenced code block of ``response`` (```` ```python ```` or bare), or ``None``."""
    blocks = _CODE_BLOCK.findall(response)
    return blocks[-1] if blocks else None


@dataclass(frozen=True)
class UnitTestOutcome:
    """How one response fared."""

    num_passed: int
    """Tests that passed."""

    num_tests: int
    """Tests of its problem."""

    has_code: bool
    """The response had a code block."""

    timed_out: bool = False
    """Its run hit the wall-clock limit."""

    @property
    def reward(self) -> float:
        """The share of tests passed, in [0, 1]: ``num_passed`` counts distinct tests of the problem."""
        assert 0 <= self.num_passed <= self.num_tests, "each test counts at most once"
        return self.num_passed / self.num_tests


def run_tests(sandbox: Sandbox, code: str | None, spec: UnitTests) -> UnitTestOutcome:
    """Run ``spec``'s tests against ``code`` in ``sandbox`` (one run for all of them) and check the values it
    reports here, outside the sandbox (:mod:`nemo_rl.environments.code_tests`)."""
    if code is None:
        return UnitTestOutcome(0, len(spec.tests), has_code=False)
    tests_json = json.dumps({"expressions": [t.expression for t in spec.tests], "setup": spec.setup})
    result = sandbox.run_python(HARNESS, files={"solution.py": code, "tests.json": tests_json})
    values = reported_values(result.stdout, len(spec.tests))
    num_passed = sum(1 for i, test in enumerate(spec.tests) if i in values and test.passes(values[i]))
    return UnitTestOutcome(num_passed, len(spec.tests), has_code=True, timed_out=result.timed_out)


@ray.remote
class CodeEnvironment(EnvironmentInterface[CodeMetadata]):
    """Scores code responses by the unit tests they pass (a Ray actor: ``create_env("code", cfg)``).

    Args:
        cfg: The ``env.code`` section (a plain dict is accepted too).
    """

    def __init__(self, cfg: CodeEnvConfig | Mapping[str, Any]) -> None:
        self.cfg = cfg if isinstance(cfg, CodeEnvConfig) else CodeEnvConfig.model_validate(dict(cfg))
        self._sandbox = Sandbox(self.cfg.sandbox)
        self._executor = ThreadPoolExecutor(self.cfg.num_workers, thread_name_prefix="code-tests")

    def isolation(self) -> str:
        """What isolates the test runs on this machine (see docs/security.md)."""
        return self._sandbox.isolation.describe()

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[CodeMetadata]
    ) -> EnvironmentReturn[CodeMetadata]:
        """Run each conversation's last code block against its problem's tests."""
        check_step_batch(message_log_batch, metadata)
        check_ground_truths(metadata, "code", "it holds the unit tests (the data's expected_answer)")
        specs = [UnitTests.from_ground_truth(str(m["ground_truth"])) for m in metadata]
        codes = [extract_code(last_assistant_text(log)) for log in message_log_batch]
        outcomes = list(self._executor.map(functools.partial(run_tests, self._sandbox), codes, specs))
        rewards = [o.reward for o in outcomes]
        return EnvironmentReturn(
            observations=[
                {
                    "role": "environment",
                    "content": f"Environment: passed {o.num_passed} of {o.num_tests} tests",
                }
                for o in outcomes
            ],
            metadata=[
                {
                    **m,
                    "num_tests": o.num_tests,
                    "num_tests_passed": o.num_passed,
                    "has_code": o.has_code,
                    "timed_out": o.timed_out,
                }
                for m, o in zip(metadata, outcomes, strict=True)
            ],
            next_stop_strings=[self.cfg.stop_strings] * len(outcomes),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.ones(len(outcomes), dtype=torch.bool),
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """Share of responses passing every test (``accuracy``), the mean share of tests passed, pass@(samples
        per prompt), and the shares of responses without code and of runs stopped by the clock."""
        rewards_B = batch_rewards(batch)
        metrics: dict[str, float] = {
            "accuracy": (rewards_B >= 1.0).float().mean().item() if rewards_B.numel() else 0.0,
            "test_pass_rate": rewards_B.mean().item() if rewards_B.numel() else 0.0,
            "pass@samples_per_prompt": pass_at_samples(rewards_B, group_ids(batch), threshold=1.0),
            "num_samples": float(rewards_B.numel()),
        }
        infos = [i for i in batch.get("extra_env_info", []) if isinstance(i, Mapping) and "has_code" in i]
        if infos:
            metrics["no_code_fraction"] = sum(not i["has_code"] for i in infos) / len(infos)
            metrics["timeout_fraction"] = sum(bool(i["timed_out"]) for i in infos) / len(infos)
        return batch, metrics

    def shutdown(self) -> None:
        """Stop the test-run threads (runs in flight finish first)."""
        self._executor.shutdown(wait=True)
