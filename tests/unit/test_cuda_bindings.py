"""One copy of ``cuda.bindings`` in every environment the lock installs.

The monolithic ``cuda-python`` 12.x ships its own ``cuda/bindings`` files; installed next to ``cuda-bindings``
13 (torch's dependency) one overwrites the other, in whatever order the installer happens to unpack them,
and megatron-core -> flashinfer -> the CUTLASS DSL then fails on a missing attribute. ``pyproject.toml``
overrides ``cuda-python`` to the 13.x metapackage, which only depends on ``cuda-bindings``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def test_the_lock_has_no_cuda_python_that_ships_its_own_bindings() -> None:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    versions = [Version(p["version"]) for p in lock["package"] if p["name"] == "cuda-python"]
    assert versions, "the lock no longer pulls cuda-python: drop its override in pyproject.toml"
    # 13.0 and later are metapackages over cuda-bindings; 12.x carries the module files itself.
    assert all(v >= Version("13") for v in versions), versions


def test_only_cuda_bindings_installs_the_cuda_bindings_files() -> None:
    if importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip("cuda.bindings is not installed in this environment")
    owners: dict[str, int] = {}
    for dist in importlib.metadata.distributions():
        for path in dist.files or ():
            if str(path).startswith("cuda/bindings/"):
                name = dist.metadata["Name"]
                owners[name] = owners.get(name, 0) + 1
    assert set(owners) == {"cuda-bindings"}, owners

    import cuda.bindings

    # The module that imports is the one cuda-bindings' metadata declares (not a file overwritten by another).
    assert cuda.bindings.__version__ == importlib.metadata.version("cuda-bindings")
