"""The Dockerfile installs what the README and CI install, and its build context keeps what it copies.

The install commands are read out of the Dockerfile by running its ``uv sync`` steps with a stand-in ``uv``
that records its arguments, once per combination of build arguments, so the check follows the shell logic
rather than the text. hadolint (from the dev group) lints the file when it is installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from itertools import product
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str, str]]:
    """(stage, instruction, arguments) for every instruction, continuation lines joined, comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        if raw.lstrip().startswith("#"):
            continue  # comments, also those inside a continued instruction
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    stage = ""
    out = []
    for line in lines:
        if not line.strip():
            continue
        keyword, _, rest = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.search(r"\bAS\s+(\S+)", rest, re.I)
            stage = match.group(1) if match else ""
        out.append((stage, keyword, rest.strip()))
    return out


def _args() -> dict[str, str]:
    """Defaults of the global ARGs (those before the first FROM)."""
    defaults = {}
    for _stage, keyword, rest in _instructions():
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value
    return defaults


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _readme_sync_commands() -> set[str]:
    """The README's `uv sync ...` commands (inline code), normalised."""
    return {" ".join(c.split()) for c in re.findall(r"`(uv sync[^`]*)`", _readme())}


def _uv_syncs(stage: str, build_args: dict[str, str], tmp_path: Path) -> list[list[str]]:
    """Arguments of every `uv sync` the stage's RUN steps make under ``build_args``."""
    record = tmp_path / "uv_calls"
    record.write_text("")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    uv = fake_bin / "uv"
    uv.write_text(
        '#!/bin/sh\nfor a in "$@"; do printf "%s\\t" "$a"; done >> "$UV_RECORD"; echo >> "$UV_RECORD"\n'
    )
    uv.chmod(0o755)
    env = {**os.environ, **build_args, "PATH": f"{fake_bin}:{os.environ['PATH']}", "UV_RECORD": str(record)}
    for run_stage, keyword, rest in _instructions():
        if run_stage != stage or keyword != "RUN" or "uv sync" not in rest:
            continue
        command = re.sub(r"^(--\S+\s+)+", "", rest)  # RUN flags such as --mount=type=cache,...
        subprocess.run(["bash", "-o", "pipefail", "-c", command], env=env, check=True)
    return [line.split("\t")[:-1] for line in record.read_text().splitlines()]


def _normalise_sync(args: list[str]) -> tuple[str, set[str]]:
    """('uv sync --locked', {extras}) for one recorded call; layer-caching flags do not count."""
    assert args[0] == "sync", args
    rest = [a for a in args[1:] if a != "--no-install-project"]
    extras = set()
    base = []
    i = 0
    while i < len(rest):
        if rest[i] == "--extra":
            extras.add(rest[i + 1])
            i += 2
        else:
            base.append(rest[i])
            i += 1
    return " ".join(["uv", "sync", *base]), extras


@pytest.mark.parametrize(
    ("stage", "build_args", "expected_extras"),
    [
        ("cpu", {}, set()),
        *[
            (
                "gpu",
                {"MCORE": mcore, "TE": te},
                {"vllm"} | ({"mcore"} if mcore == "1" else set()) | ({"te"} if te == "1" else set()),
            )
            for mcore, te in product(["0", "1"], repeat=2)
        ],
    ],
)
def test_uv_sync_steps_are_the_readme_commands(
    stage: str, build_args: dict[str, str], expected_extras: set[str], tmp_path: Path
) -> None:
    calls = _uv_syncs(stage, build_args, tmp_path)
    # One sync of the dependencies alone (a cached layer), one with the project.
    assert len(calls) == 2 and "--no-install-project" in calls[0], calls
    readme = _readme_sync_commands()
    optional = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for call in calls:
        base, extras = _normalise_sync(call)
        assert base == "uv sync --locked", f"the {stage} image runs `{' '.join(['uv', *call])}`"
        assert extras == expected_extras, (build_args, call)
        for extra in extras:
            assert extra in optional, f"--extra {extra} is not in pyproject.toml's optional-dependencies"
            assert f"{base} --extra {extra}" in readme, f"README does not list `{base} --extra {extra}`"
    assert "uv sync --locked" in _readme(), "README does not show `uv sync --locked`"


def _pip_install_uv(command: str) -> str:
    """`pip install uv`, whatever the interpreter prefix (`python3 -m`), flags and version pin."""
    words = [w for w in shlex.split(command) if not w.startswith("-") and not w.startswith("python")]
    return " ".join("uv" if w.startswith("uv==") else w for w in words)


def test_uv_is_installed_as_in_readme_and_ci() -> None:
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci = [line for line in ci_lines if re.match(r"(python3? -m )?pip install .*\buv\b", line)]
    assert len(ci) == 1, ci
    quick_start = _readme().split("## Quick start", 1)[1]
    readme = re.search(r"(pip install uv)\b", quick_start)
    assert readme, "README's quick start no longer installs uv with pip"
    # .ci/run runs the README's first command as written: `pip install uv && uv run ...`.
    assert _pip_install_uv(ci[0].split("&&")[0]) == _pip_install_uv(readme.group(1)) == "pip install uv"
    steps = {
        stage: part
        for stage, keyword, rest in _instructions()
        if keyword == "RUN"
        for part in re.split(r"&&|;", rest)
        if "uv==" in part
    }
    assert set(steps) == {"cpu", "gpu"}, steps
    for stage, step in steps.items():
        assert _pip_install_uv(step) == "pip install uv", (
            f"the {stage} image installs uv with `{step.strip()}`"
        )


def test_cpu_image_runs_the_readme_main_command_on_the_pinned_python() -> None:
    cmd = next(rest for stage, keyword, rest in _instructions() if stage == "cpu" and keyword == "CMD")
    quick_start = _readme().split("## Quick start", 1)[1]
    first = re.search(r"```bash\n(.*?)\n", quick_start).group(1)  # type: ignore[union-attr]
    main_command = first.split("&&", 1)[1].strip()
    assert " ".join(json.loads(cmd)) == main_command
    python = (ROOT / ".python-version").read_text().strip()
    assert f"python:{python}-" in _args()["CPU_BASE_IMAGE"]


@pytest.mark.parametrize("stage", ["cpu", "gpu"])
def test_each_image_installs_bubblewrap_for_the_sandbox(stage: str) -> None:
    # Without it the code environment and the python tool refuse to start (docs/security.md).
    installs = [
        rest
        for s, keyword, rest in _instructions()
        if s == stage and keyword == "RUN" and re.search(r"apt-get install\b[^;&|]*\bbubblewrap\b", rest)
    ]
    assert installs, f"the {stage} image does not apt-get install bubblewrap"
    assert all(re.search(r"apt-get update\b", rest) for rest in installs)


def test_cuda_base_matches_the_locked_cuda_wheels() -> None:
    lock = (ROOT / "uv.lock").read_text()
    runtime = re.search(r'name = "nvidia-cuda-runtime"\nversion = "(\d+)\.', lock)
    assert runtime, "uv.lock has no nvidia-cuda-runtime"
    image = re.search(r"cuda:(\d+)\.\d+", _args()["BASE_IMAGE"])
    assert image and image.group(1) == runtime.group(1), (_args()["BASE_IMAGE"], runtime.group(1))


def _pattern_regex(pattern: str) -> str:
    """A .dockerignore pattern (Go's filepath.Match plus `**`) as a regular expression over a relative path."""
    out, i = "", 0
    pattern = pattern.strip("/")
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves ``path`` out of the build context: a pattern matches it or one of its parents."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(re.fullmatch(_pattern_regex(p), c) for p in patterns for c in candidates)


def test_dockerignore_keeps_every_tracked_file_the_image_needs() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns), "the check below does not handle exceptions (!)"
    for local in (
        ".venv",
        "logs/grpo_math_tiny/metrics.jsonl",
        "results/x",
        "nemo_rl/__pycache__/a.pyc",
        ".git",
    ):
        assert _ignored(local, patterns), f"{local} would be sent to the build"
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: cannot list the tracked files")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    dropped = [f for f in tracked.splitlines() if _ignored(f, patterns)]
    assert set(dropped) <= {"Dockerfile", ".dockerignore"}, f"tracked files left out of the image: {dropped}"
    for stage, keyword, rest in _instructions():
        if keyword == "COPY" and "--from" not in rest:
            for source in shlex.split(rest)[:-1]:
                assert source == "." or not _ignored(source, patterns), (
                    f"{stage} copies {source}, which is ignored"
                )


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (it comes with the dev group: uv sync --locked)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
