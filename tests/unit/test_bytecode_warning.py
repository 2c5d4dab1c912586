"""Start-up warns when the workers would compile their packages from source (bytecode neither cached nor written)."""

from __future__ import annotations

import py_compile
import sys
import tomllib
import types
from pathlib import Path

import pytest

from nemo_rl.distributed.ray_start import uncached_bytecode_warning


def _flags(dont_write_bytecode: bool) -> types.SimpleNamespace:
    """``sys.flags`` with only ``dont_write_bytecode`` changed (importlib reads the others)."""
    names = [n for n in dir(sys.flags) if not n.startswith("_") and not callable(getattr(sys.flags, n))]
    flags = {name: getattr(sys.flags, name) for name in names}
    return types.SimpleNamespace(**{**flags, "dont_write_bytecode": dont_write_bytecode})


def _package(root: Path) -> Path:
    source = root / "uncompiled_pkg" / "__init__.py"
    source.parent.mkdir()
    source.write_text("VALUE = 1\n")
    return source


def test_warns_only_without_cached_bytecode_when_none_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "flags", _flags(False))
    assert uncached_bytecode_warning("uncompiled_pkg") is None  # Python caches it on first import

    monkeypatch.setattr(sys, "flags", _flags(True))
    warning = uncached_bytecode_warning("uncompiled_pkg")
    assert warning is not None
    assert "uncompiled_pkg" in warning and "uv sync" in warning and "compileall" in warning

    py_compile.compile(str(source))
    assert uncached_bytecode_warning("uncompiled_pkg") is None
    assert uncached_bytecode_warning("no_such_package_here") is None


def test_the_project_compiles_bytecode_at_install() -> None:
    """The README's commands set no UV_COMPILE_BYTECODE: the project's own uv setting compiles the environment,
    which is what the warning above tells a user to rely on."""
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["tool"]["uv"]["compile-bytecode"] is True
