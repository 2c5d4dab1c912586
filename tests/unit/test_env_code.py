"""The code environment: code extraction, the share of unit tests passed as the reward, runs that misbehave,
the reward hacks docs/security.md lists (each scores nothing it did not earn, under every isolation this
machine has), the environment actor's interface and metrics, and the bundled problems' tests (solvable, and
not by nothing)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from nemo_rl.config.env import CodeEnvConfig, EnvConfig, SandboxConfig
from nemo_rl.config.errors import UserError
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.code_environment import UnitTests, extract_code, run_tests
from nemo_rl.environments.code_tests import (
    RESULT_MARK,
    decode_value,
    parse_test,
    reported_values,
)
from nemo_rl.environments.interfaces import EnvironmentReturn
from nemo_rl.environments.registry import create_env, stop_envs
from nemo_rl.environments.sandbox import Sandbox, check_sandbox

RAY_TIMEOUT_S = 180
DATA_DIR = Path(__file__).resolve().parents[2] / "examples" / "data"
SANDBOX = SandboxConfig(
    wall_time_limit_s=2.0,
    cpu_time_limit_s=1,
    memory_limit_mb=256,
    max_output_bytes=4096,
)
ADD_TESTS = json.dumps(
    {
        "tests": [
            "assert add(1, 2) == 3",
            "assert add(-1, 1) == 0",
            "assert add(2, 2) == 4",
        ]
    }
)


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."


def conversation(response: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": "Write add(a, b)."},
        {"role": "assistant", "content": response},
    ]


@pytest.fixture(scope="module", params=["default", "rlimits"])
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    """The default isolation where this machine has one, and the weak mode: rewards hold in both."""
    if request.param == "rlimits":
        return Sandbox(SANDBOX.model_copy(update={"isolation": "rlimits"}))
    try:
        return Sandbox(SANDBOX)
    except UserError as err:
        pytest.skip(str(err))


def test_extract_the_last_code_block() -> None:
    assert extract_code(fenced("x = 1") + fenced("x = 2")) == "x = 2\n"
    assert extract_code("```\nbare = True\n```") == "bare = True\n"
    assert extract_code("```py\nshort = 1\n```") == "short = 1\n"
    assert extract_code("no code") is None
    assert extract_code("```python\nunclosed") is None


@pytest.mark.parametrize(
    ("code", "num_passed"),
    [
        ("def add(a, b):\n    return a + b", 3),
        ("def add(a, b):\n    return 3", 1),
        ("def add(a, b):\n    return a - b", 0),
        ("def add(a, b):\n    raise SystemExit(0)", 0),
        ("syntax error here", 0),
        # Runs that hit a limit keep the tests they finished.
        (
            "def add(a, b):\n    if a == 2:\n        while True: pass\n    return a + b",
            2,
        ),
        (
            "def add(a, b):\n    if a == -1:\n        import os; os._exit(0)\n    return a + b",
            1,
        ),
    ],
)
def test_reward_is_the_share_of_tests_passed(sandbox: Sandbox, code: str, num_passed: int) -> None:
    outcome = run_tests(sandbox, code, UnitTests.from_ground_truth(ADD_TESTS))
    assert (outcome.num_passed, outcome.num_tests, outcome.has_code) == (
        num_passed,
        3,
        True,
    )


WRONG_ADD = "def add(a, b):\n    return a - b\n"
"""Passes none of ADD_TESTS; each hack below starts from it."""

REWARD_HACKS = {
    "forged verdict lines": WRONG_ADD
    + "import sys\nfor i in range(3):\n    print('0' * 32, '[true, true, true]')\n"
    + f"    print('{RESULT_MARK}', i, 'true')\n    print('{RESULT_MARK}', i, '[\"bool\", true]')\n",
    "the harness's marker with the right values": WRONG_ADD
    + f"for i, v in enumerate([3, 0, 4]):\n    print('\\n{RESULT_MARK}', i, '[\"int\", \"%d\"]' % v)\n",
    "always-equal objects": "class Yes:\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = object.__hash__\ndef add(a, b):\n    return Yes()\n",
    "an int subclass equal to everything": "class Int(int):\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return Int(999)\n",
    "exiting early with status 0": "import os\nos._exit(0)\n" + WRONG_ADD,
    "sys.exit(0) while loading": "import sys\nsys.exit(0)\n",
    "monkeypatching the harness and builtins": WRONG_ADD
    + "import builtins, json, __main__\njson.dumps = lambda *a, **k: '[\"bool\", true]'\n"
    "__main__._plain = lambda v: True\nbuiltins.type = lambda v: int\nbuiltins.isinstance = lambda *a: True\n",
    # Looks for "add(1, 2) == <expected>" in every file it can list and every string in its memory.
    "reading the expected values from files and memory": "import gc, os, re\n"
    "def add(a, b):\n    key = re.escape(f'add({a}, {b}) ') + '=' * 2 + r' *(-?\\d+)'\n"
    "    texts = [o for o in gc.get_objects() if type(o) is str]\n"
    "    texts += [open(n, errors='replace').read() for n in os.listdir('.') if os.path.isfile(n)]\n"
    "    texts += [open('/proc/self/environ', errors='replace').read(), open('/proc/self/cmdline').read()]\n"
    "    for text in texts:\n        match = re.search(key, text)\n        if match:\n"
    "            return int(match.group(1))\n    return 999\n",
    "very long output": WRONG_ADD + "print('x' * 10_000_000)\n",
    "a huge value": "def add(a, b):\n    return [a + b] * 10_000_000\n",
}


@pytest.mark.parametrize("name", sorted(REWARD_HACKS))
def test_reward_hacks_earn_nothing(sandbox: Sandbox, name: str) -> None:
    outcome = run_tests(sandbox, REWARD_HACKS[name], UnitTests.from_ground_truth(ADD_TESTS))
    assert outcome.num_passed == 0 and outcome.reward == 0.0, name


def test_sys_exit_in_the_middle_keeps_only_the_tests_that_ran(sandbox: Sandbox) -> None:
    code = "import sys\ndef add(a, b):\n    if a == -1:\n        sys.exit(0)\n    return a + b\n"
    assert run_tests(sandbox, code, UnitTests.from_ground_truth(ADD_TESTS)).num_passed == 2


def test_the_reward_stays_in_its_range_whatever_is_printed(sandbox: Sandbox) -> None:
    # A correct solution that also prints result lines: the doubled indices count as not reported, and
    # indices past the problem's tests are ignored, so the reward never leaves [0, 1].
    spam = "".join(f"print('{RESULT_MARK}', {i}, '[\"int\", \"3\"]')\n" for i in range(-2, 50))
    outcome = run_tests(
        sandbox,
        "def add(a, b):\n    return a + b\n" + spam,
        UnitTests.from_ground_truth(ADD_TESTS),
    )
    assert 0.0 <= outcome.reward <= 1.0 and outcome.num_passed == 0
    stdout = (
        "".join(f"{RESULT_MARK} {i} true\n" for i in [0, 1, 2, 7, 99999999999, -1])
        + f"{RESULT_MARK} \u0663 true"
    )
    assert reported_values(stdout, 3) == {0: True, 1: True, 2: True}


@pytest.mark.parametrize(
    ("statement", "value", "passes"),
    [
        ("assert f(1) == 3", 3, True),
        ("assert f(1) == 3", 3.0, True),
        ("assert 3 == f(1)", 4, False),
        ("assert f('x') is True", 1, False),
        ("assert f('x') is True", True, True),
        ("assert f(1) is None", None, True),
        ("assert f(1) != [1, 2]", [1, 2], False),
        ("assert f(1) in (1, 2)", 2, True),
        ("assert 2 in f(1)", [1, 2], True),
        ("assert f(1) < -1.5", -2, True),
        ("assert f(1) < 'a'", 3, False),  # the assert would raise TypeError
        ("assert f(1)", [0], True),
        ("assert not f(1)", [], True),
        ("assert f(1) == {'a': (1, 2)}", {"a": (1, 2)}, True),
        ("assert f(1) == {'a': (1, 2)}", {"a": [1, 2]}, False),
        ("assert math.isclose(f(1), 2.5)", 2.5 + 1e-12, True),
        ("assert math.isclose(2.5, f(1), rel_tol=0.1)", 2.7, True),
        ("assert math.isclose(f(1), 2.5, abs_tol=0)", 2.6, False),
        ("assert math.isclose(f(1), 2.5)", "2.5", False),
        ("assert abs(f(1) - 2.5) < 1e-6", 2.5000001, True),
        ("assert abs(2.5 - f(1)) <= 0.5", 3.0, True),
        ("assert abs(f(1) - 2.5) < 0.5", 3.0, False),
    ],
)
def test_checks_apply_outside_on_plain_values(statement: str, value: Any, passes: bool) -> None:
    test = parse_test(statement)
    assert test.expression in ("f(1)", "f('x')")  # all the sandbox sees: never the expected side
    assert test.passes(value) is passes


@pytest.mark.parametrize(
    ("statement", "error"),
    [
        ("assert f(1) == g(1)", "compares the solution's value with a literal"),
        ("assert 0 < f(1) < 3", "compares once"),
        ("x = 1", "one assert statement"),
        ("assert f(1) == 3; assert f(2) == 4", "one assert statement"),
        ("assert (", "does not parse"),
        ("assert f(1) == 3 and f(2) == 4", "a truth test calls"),
        ("assert isinstance(f(1), int)", "a truth test calls"),
        ("assert (f(1) == 3) == True", "not comparisons or conditions inside it"),
        ("assert f(1 if x else 2) == 3", "not comparisons or conditions inside it"),
        ("assert abs(f(1) - g(1)) < 0.1", "measures from a number"),
    ],
)
def test_tests_of_other_forms_are_clear_errors(statement: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_test(statement)


def test_only_plain_data_decodes() -> None:
    assert decode_value('["dict", [[["tuple", [["int", "1"], "a"]], ["set", [["float", "inf"]]]]]]') == {
        (1, "a"): {float("inf")}
    }
    assert decode_value('["bytes", "00ff"]') == b"\x00\xff"
    for bad in (
        '["object", []]',
        '["dict", [[["list", []], 1]]]',
        "{}",
        '["int", "1e3"]',
        "[" * 5000,
    ):
        with pytest.raises(ValueError):
            decode_value(bad)


def test_setup_runs_before_the_solution(sandbox: Sandbox) -> None:
    spec = UnitTests.from_ground_truth(
        json.dumps({"tests": ["assert root(16) == 4"], "setup": "import math"})
    )
    assert run_tests(sandbox, "def root(x):\n    return math.isqrt(x)", spec).num_passed == 1


@pytest.mark.parametrize(
    ("ground_truth", "error"),
    [
        ("42", "non-empty 'tests' list"),
        ("not json", "must be JSON"),
        (json.dumps({"tests": []}), "non-empty"),
        (json.dumps({"tests": [1]}), "must be strings"),
        (json.dumps({"tests": ["assert True"], "extra": 1}), "unknown keys"),
    ],
)
def test_bad_ground_truths_are_clear_errors(ground_truth: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        UnitTests.from_ground_truth(ground_truth)


SOLUTIONS = {
    "add": "def add(a, b):\n    return a + b",
    "is_palindrome": "def is_palindrome(s):\n    return s == s[::-1]",
    "factorial": "import math\ndef factorial(n):\n    return math.factorial(n)",
    "fizzbuzz": (
        "def fizzbuzz(n):\n    return 'FizzBuzz' if n % 15 == 0 else 'Fizz' if n % 3 == 0 else "
        "'Buzz' if n % 5 == 0 else str(n)"
    ),
    "count_vowels": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)",
    "second_largest": "def second_largest(xs):\n    return sorted(set(xs))[-2]",
    "reverse_words": "def reverse_words(s):\n    return ' '.join(s.split(' ')[::-1])",
    "gcd": "import math\ndef gcd(a, b):\n    return math.gcd(a, b)",
    "primes_below": (
        "def primes_below(n):\n    return [p for p in range(2, n) if all(p % d for d in range(2, p))]"
    ),
    "mean": "def mean(xs):\n    return sum(xs) / len(xs)",
}


def test_the_bundled_problems_are_solvable(sandbox: Sandbox) -> None:
    rows = [
        json.loads(line)
        for name in ("train", "val")
        for line in (DATA_DIR / f"tiny_code_{name}.jsonl").open()
    ]
    assert len(rows) == len(SOLUTIONS)
    for row in rows:
        name = row["messages"][0]["content"].split("`")[1].split("(")[0]
        spec = UnitTests.from_ground_truth(row["expected_answer"])
        assert run_tests(sandbox, SOLUTIONS[name], spec).num_passed == len(spec.tests), name
        assert run_tests(sandbox, "pass", spec).num_passed == 0, name


@pytest.fixture(scope="module")
def code_env(ray_cluster: dict[str, float]) -> Any:
    try:
        check_sandbox(SANDBOX)
        sandbox = SANDBOX
    except UserError:  # no bubblewrap here: the weak mode, on purpose (tests/unit/test_security.py)
        sandbox = SANDBOX.model_copy(update={"isolation": "rlimits"})
    env = create_env("code", EnvConfig(code=CodeEnvConfig(num_workers=2, sandbox=sandbox)))
    yield env
    stop_envs([env], timeout_s=RAY_TIMEOUT_S)


def test_code_environment_step(code_env: Any) -> None:
    logs = [
        conversation(fenced("def add(a, b):\n    return a + b")),
        conversation(fenced("def add(a, b):\n    return 3")),
        conversation("I cannot write code."),
        [
            *conversation(fenced("def add(a, b):\n    return 0")),
            {"role": "user", "content": "again"},
            {
                "role": "assistant",
                "content": fenced("def add(a, b):\n    return b + a"),
            },
        ],
    ]
    metadata = [{"ground_truth": ADD_TESTS}] * 4
    ret: EnvironmentReturn[Any] = code_env.call("step", logs, metadata).result()
    assert ret.rewards.tolist() == pytest.approx([1.0, 1 / 3, 0.0, 1.0])
    assert ret.rewards.dtype == torch.float32
    assert ret.terminateds.tolist() == [True] * 4
    assert ret.observations[1] == {
        "role": "environment",
        "content": "Environment: passed 1 of 3 tests",
    }
    assert ret.metadata[2] == {
        "ground_truth": ADD_TESTS,
        "num_tests": 3,
        "num_tests_passed": 0,
        "has_code": False,
        "timed_out": False,
    }
    assert ret.next_stop_strings == [None] * 4
    assert "network: " in code_env.call("isolation").result()


def test_missing_tests_are_a_clear_error(code_env: Any) -> None:
    with pytest.raises(ray.exceptions.RayTaskError, match="ground_truth"):
        code_env.call("step", [conversation("x")], [{"answer": "2"}]).result()


def test_code_metrics(code_env: Any) -> None:
    batch = BatchedDataDict(
        {
            "total_reward": torch.tensor([1.0, 0.5, 0.0, 0.0]),
            "idx": torch.tensor([0, 0, 1, 1]),
            "extra_env_info": [
                {"has_code": True, "timed_out": False},
                {"has_code": True, "timed_out": True},
                {"has_code": False, "timed_out": False},
                {"has_code": True, "timed_out": False},
            ],
        }
    )
    _, metrics = code_env.call("global_post_process_and_metrics", batch).result()
    assert metrics["accuracy"] == pytest.approx(0.25)
    assert metrics["test_pass_rate"] == pytest.approx(0.375)
    assert metrics["pass@samples_per_prompt"] == pytest.approx(0.5)
    assert metrics["no_code_fraction"] == pytest.approx(0.25)
    assert metrics["timeout_fraction"] == pytest.approx(0.25)
