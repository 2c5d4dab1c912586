"""Generate ``docs/config_reference.md`` from the typed config schema.

Walks the master configs of the driver scripts (:data:`MASTERS`),
section by section (nested config models become sub-sections), and writes one markdown table per section:
key, type (with range constraints), default and the field's docstring. The schema is the only source of
defaults, so this file is too; ``tests/unit/test_docs_config_reference.py`` fails when the committed
reference no longer matches the schema.

    python docs/gen_config_reference.py            # rewrite docs/config_reference.md
    python docs/gen_config_reference.py --check    # exit 1 if the committed file is out of date
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from nemo_rl.config.keys import format_type
from nemo_rl.config.master import (
    DistillationMasterConfig,
    DPOMasterConfig,
    EvalMasterConfig,
    GRPOMasterConfig,
    PPOMasterConfig,
    RMMasterConfig,
    SFTMasterConfig,
)

REFERENCE_PATH = Path(__file__).resolve().parent / "config_reference.md"
"""Where the generated reference is committed."""

REGENERATE_COMMAND = "uv run python docs/gen_config_reference.py"
"""The command that rewrites the reference (quoted in the file and in the drift test's message)."""

MASTERS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("examples/run_grpo_math.py", GRPOMasterConfig),
    ("examples/run_sft.py", SFTMasterConfig),
    ("examples/run_eval.py", EvalMasterConfig),
    ("examples/run_distillation_math.py", DistillationMasterConfig),
    ("examples/run_grpo_sliding_puzzle.py", GRPOMasterConfig),
    ("examples/run_dpo.py", DPOMasterConfig),
    ("examples/run_rm.py", RMMasterConfig),
    ("examples/run_ppo.py", PPOMasterConfig),
    ("examples/run_vlm_sft.py", SFTMasterConfig),
    ("examples/run_vlm_grpo.py", GRPOMasterConfig),
)
"""Each driver script and the master config it validates its YAML against."""


@dataclass(frozen=True)
class Section:
    """One table of the reference: a config model reached at a dotted path."""

    path: str
    """Dotted key of the section, e.g. ``policy.dtensor_cfg`` (``<index>`` marks a list item)."""

    model: type[BaseModel]
    """The config model whose fields the table lists."""


def _strip_annotated(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _union_members(annotation: Any) -> list[Any]:
    """Alternatives of a union without ``None``; a non-union is its own only member."""
    annotation = _strip_annotated(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return [m for arg in get_args(annotation) if arg is not type(None) for m in _union_members(arg)]
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _nested(path: str, annotation: Any) -> Iterator[Section]:
    """Sections below a field: the model itself, list items (``<index>``) or dict values (``<name>``)."""
    for member in _union_members(annotation):
        if _is_model(member):
            yield Section(path, member)
            continue
        origin, args = get_origin(member), get_args(member)
        if origin is list and args:
            for item in _union_members(args[0]):
                if _is_model(item):
                    yield Section(f"{path}.<index>", item)
        elif origin is dict and len(args) == 2:
            for value in _union_members(args[1]):
                if _is_model(value):
                    yield Section(f"{path}.<name>", value)


def walk(section: Section) -> Iterator[Section]:
    """``section`` and every section nested below it, depth first in declaration order."""
    yield section
    for name, field in section.model.model_fields.items():
        for child in _nested(f"{section.path}.{name}", field.annotation):
            yield from walk(child)


_BOUNDS: tuple[tuple[type, str, str], ...] = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


def _constraints(field: FieldInfo) -> str:
    """Range checks of a field (``Field(ge=1)``...) as ``>= 1``."""
    parts = []
    for item in field.metadata:
        for kind, attr, symbol in _BOUNDS:
            if isinstance(item, kind):
                bound = getattr(item, attr)
                parts.append(f"{symbol} {bound:g}" if isinstance(bound, float) else f"{symbol} {bound}")
    return ", ".join(parts)


def _format_default(field: FieldInfo) -> str:
    if field.is_required():
        return "*required*"
    if field.default is not PydanticUndefined:
        value = field.default
    else:
        value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "*(section)*"
    return f"`{json.dumps(to_jsonable_python(value))}`"


def _format_type(field: FieldInfo) -> str:
    members = _union_members(field.annotation)
    if members and all(_is_model(m) for m in members):
        return "section"
    text = f"`{format_type(field.annotation)}`"
    constraints = _constraints(field)
    return f"{text} ({constraints})" if constraints else text


def _markdown(text: str) -> str:
    """A docstring on one line, with reST literals and roles turned into markdown code spans."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r":(?:class|func|mod|meth|data|attr):`~?([^`]+)`", r"`\1`", text)
    return " ".join(text.split())


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell (a bare ``|`` would end the cell)."""
    return text.replace("|", "\\|")


def render_section(section: Section, heading: bool = True) -> str:
    """The markdown table of one section: its dotted path as a heading (unless ``heading`` is false),
    the model's docstring, then one row per field."""
    model = section.model
    lines = [f"### `{section.path}`", ""] if heading else []
    doc = (model.__doc__ or "").strip()
    if doc:
        lines += [_markdown(doc), ""]
    lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        description = _cell(_markdown(field.description or ""))
        lines.append(
            f"| `{name}` | {_cell(_format_type(field))} | {_cell(_format_default(field))} | {description} |"
        )
    return "\n".join(lines) + "\n"


def _top_level_sections() -> list[tuple[str, list[str], type[BaseModel]]]:
    """``(key, scripts reading it, model)`` for every top-level section schema, in first-declared order; a
    key whose scripts read it with different schemas (``data`` of training and of evaluation) appears once
    per schema."""
    found: dict[tuple[str, type[BaseModel]], list[str]] = {}
    for script, master in MASTERS:
        for name, field in _own_fields_first(master):
            (model,) = [m for m in _union_members(field.annotation) if _is_model(m)]
            found.setdefault((name, model), []).append(script)
    return [(name, scripts, model) for (name, model), scripts in found.items()]


def _own_fields_first(model: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    """``model``'s fields, those its own class declares first, then its base's, and so on (pydantic lists a
    base's fields first: the sections shared by every master config would lead every script's list)."""
    mro = [cls for cls in model.__mro__ if issubclass(cls, BaseModel)]

    def depth(name: str) -> int:
        return next(i for i, cls in enumerate(mro) if name in inspect.get_annotations(cls))

    return sorted(model.model_fields.items(), key=lambda item: depth(item[0]))


def _anchors(names: list[str]) -> list[str]:
    """Markdown heading anchors of ``names`` in order: a repeated heading gets ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    anchors = []
    for name in names:
        count = seen.get(name, 0)
        anchors.append(name if count == 0 else f"{name}-{count}")
        seen[name] = count + 1
    return anchors


def render() -> str:
    """The whole reference as markdown."""
    out = [
        "# Config reference",
        "",
        f"Generated from the schema in `nemo_rl/config/` by `{REGENERATE_COMMAND}`; do not edit by hand.",
        "`tests/unit/test_docs_config_reference.py` fails when this file and the schema disagree.",
        "See [config.md](config.md) for how configs are loaded, inherited and overridden.",
        "",
        "Types are Python annotations (`'a' | 'b'` lists the allowed strings); a range in parentheses is",
        "checked at load time. A *section* is a nested mapping with a table of its own below.",
        "`<index>` stands for a list position and `<name>` for a free mapping key. Every section rejects",
        "keys it does not declare. Checks that involve several keys at once are listed in",
        "[config.md](config.md#checks-across-keys).",
        "",
        "## Sections by script",
        "",
        "| section | read by | schema |",
        "| --- | --- | --- |",
    ]
    sections = _top_level_sections()
    for (name, scripts, model), anchor in zip(sections, _anchors([n for n, _, _ in sections]), strict=True):
        readers = ", ".join(f"`{s}`" for s in scripts)
        out.append(f"| [`{name}`](#{anchor}) | {readers} | `{model.__module__}.{model.__name__}` |")
    out.append("")
    rendered: dict[type[BaseModel], tuple[str, str]] = {}
    for (name, _, model), anchor in zip(sections, _anchors([n for n, _, _ in sections]), strict=True):
        out += [f"## {name}", ""]
        if model in rendered:
            # A second section of a schema already listed (distillation's teacher: a policy section).
            first, first_anchor = rendered[model]
            out += [f"The same keys, types and defaults as [`{first}`](#{first_anchor}).", ""]
            continue
        rendered[model] = (name, anchor)
        for index, section in enumerate(walk(Section(name, model))):
            out.append(render_section(section, heading=index > 0))
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the reference (or, with ``--check``, report whether the committed one is current)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed file is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = REFERENCE_PATH.read_text() if REFERENCE_PATH.is_file() else ""
        if current != text:
            print(f"{REFERENCE_PATH} is out of date; run `{REGENERATE_COMMAND}`", file=sys.stderr)
            return 1
        return 0
    REFERENCE_PATH.write_text(text)
    print(f"wrote {REFERENCE_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
