"""Imports point down the layers of the package: a module never imports a package above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nemo_rl"

# Lowest first; packages on one line share a floor and may import each other.
LAYERS: list[set[str]] = [
    {"config"},
    {"distributed", "utils"},
    {"weight_sync"},
    {"models"},
    {"data"},
    {"environments"},
    {"experience"},
    {"algorithms"},
    {"evals"},
]
FLOOR = {package: floor for floor, packages in enumerate(LAYERS) for package in packages}


def _imported_packages(path: Path) -> set[str]:
    """Top-level ``nemo_rl`` sub-packages ``path`` imports (any import statement, anywhere in the file)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "nemo_rl" and len(parts) > 1 and parts[1] in FLOOR:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(FLOOR))
def test_package_imports_only_its_floor_and_below(package: str) -> None:
    upward = {
        f"{path.relative_to(PACKAGE.parent)} imports nemo_rl.{imported}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for imported in _imported_packages(path)
        if FLOOR[imported] > FLOOR[package]
    }
    assert not upward, sorted(upward)


def test_every_subpackage_has_a_floor() -> None:
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == set(FLOOR), subpackages ^ set(FLOOR)
