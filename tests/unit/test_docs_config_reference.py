"""docs/config_reference.md is generated from the config schema; it must match what the generator makes now."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "docs" / "gen_config_reference.py"


def _load_generator() -> ModuleType:
    # docs/ is not a package; load the script as a module by path.
    spec = importlib.util.spec_from_file_location("gen_config_reference", GENERATOR)
    assert spec is not None and spec.loader is not None, f"cannot load {GENERATOR}"
    module = importlib.util.module_from_spec(spec)
    # Dataclasses look their module up in sys.modules while the class is created.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_config_reference_is_up_to_date() -> None:
    generator = _load_generator()
    committed = generator.REFERENCE_PATH.read_text() if generator.REFERENCE_PATH.is_file() else ""
    assert committed == generator.render(), (
        f"{generator.REFERENCE_PATH.relative_to(ROOT)} does not match the config schema; regenerate it with "
        f"`{generator.REGENERATE_COMMAND}` and commit the result"
    )


def _section_blocks(text: str, heading: str) -> list[str]:
    """The body of every section of ``text`` under ``heading`` (a section ends at the next heading)."""
    return [part.split("\n#", 1)[0] for part in text.split(heading)[1:]]


def test_reference_documents_every_schema_key() -> None:
    # Guards the generator itself: every dotted key of every schema is a row of its section's table.
    from nemo_rl.config.keys import INDEX, NAME, schema_keys
    from nemo_rl.config.master import (
        DistillationMasterConfig,
        EvalMasterConfig,
        GRPOMasterConfig,
        SFTMasterConfig,
    )

    text = _load_generator().render()
    # A second section of an already listed schema (distillation's teacher) points to the first one.
    assert "## teacher\n\nThe same keys, types and defaults as [`policy`](#policy)." in text
    for master in (GRPOMasterConfig, SFTMasterConfig, EvalMasterConfig, DistillationMasterConfig):
        keys = {key.parts: key for key in schema_keys(master)}
        for parts, key in keys.items():
            if NAME in parts:
                continue
            if len(parts) == 1:
                assert f"| [`{parts[0]}`](#{parts[0]}" in text, f"top-level section {parts[0]} is missing"
                continue
            if parts[0] == "teacher":  # documented through policy (asserted above)
                continue
            parent = keys.get(parts[:-1])
            # Entries of a dict default (policy.optimizer.kwargs.lr) are values, not schema fields.
            if parent is not None and not parent.is_section:
                continue
            section = ".".join(parts[:-1]).replace(INDEX, "<index>")
            heading = f"## {section}\n" if len(parts) == 2 else f"### `{section}`\n"
            blocks = _section_blocks(text, heading)
            assert blocks, f"no table for section {section} (needed by {key.dotted})"
            assert any(f"| `{parts[-1]}` |" in block for block in blocks), f"{key.dotted} is not documented"
