"""Repository-level invariants: CI runs exactly the README's test command; no function or module in the
package is longer than a reader can hold in view."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's quick start has no bash block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def test_quick_start_is_two_commands() -> None:
    commands = _readme_quick_start_commands()
    assert len(commands) == 2, commands
    assert "examples/run_grpo_math.py" in commands[0]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = _readme_quick_start_commands()[1]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines, f"`.ci/run` must run the README's test command `{test_command}`"


MAX_FUNCTION_LINES = 80
"""Longest function (signature, docstring and body) in ``nemo_rl/``; a longer one is split into named steps."""


def test_no_function_in_the_package_is_longer_than_80_lines() -> None:
    too_long = []
    for path in sorted((ROOT / "nemo_rl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({num_lines} lines)")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


MAX_MODULE_LINES = 600
"""Longest module in ``nemo_rl/``; a longer one is split along a seam (STYLE.md, section 1)."""


def test_no_module_in_the_package_is_longer_than_600_lines() -> None:
    too_long = [
        f"{path.relative_to(ROOT)} ({num_lines} lines)"
        for path in sorted((ROOT / "nemo_rl").rglob("*.py"))
        if (num_lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_the_other_algorithms_are_near_the_top() -> None:
    """A reader finds how to run an algorithm other than the main job without scrolling past a page."""
    lines = (ROOT / "README.md").read_text().splitlines()
    quick_start = lines.index("## Quick start")
    main_job = _readme_quick_start_commands()[0].split("&&")[-1].strip()
    first = next(
        number
        for number, line in enumerate(lines[quick_start:], start=quick_start + 1)
        if re.match(r"uv run (--\S+ )*python examples/run_\w+\.py", line.strip()) and line.strip() != main_job
    )
    assert first <= 60, f"README line {first} is the first command running another algorithm"
