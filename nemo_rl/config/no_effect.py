"""Keys accepted for NeMo RL recipes that change nothing here, and keys refused unless left neutral.

NeMo RL's recipes carry keys for machinery this project does not build (NeMo-Gym, the TransferQueue data
plane, FP8, context parallelism, speculative decoding, other generation backends...) and knobs that only tune
NeMo RL's own kernels. So that those recipes load unchanged, every such key has a schema field in one of two
groups:

- **Accepted, no effect here**: knobs that do not change what is computed here (speed and memory knobs,
  settings of a disabled backend). The field's docstring starts with :data:`NO_EFFECT_PREFIX` followed by the
  reason; that docstring *is* the registry entry. :func:`no_effect_settings` lists the ones a config sets
  away from their default, and the example scripts print that list once at start (:func:`report_no_effect`).
  A key that works in some combinations only (``policy.sequence_packing.enabled`` packs on the DTensor
  backend, not on Megatron) is declared in its section's ``CONDITIONAL_NO_EFFECT`` and reported where the
  section's ``settings_without_effect`` says it does nothing.
- **Refused unless neutral**: keys that select behaviour this project does not build. The field accepts the
  neutral value (``enabled: false``, ``null``...) and a validator refuses any other with a one-line message
  naming the key and the value to set (:func:`refuse_unbuilt`).

A section switched off with ``enabled: false`` changes nothing, so the keys below it are never reported.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from nemo_rl.config.base import ConfigModel

NO_EFFECT_PREFIX = "Accepted, no effect here"
"""How the docstring of a field accepted with no effect starts; the rest of the sentence gives the reason."""


@dataclasses.dataclass(frozen=True)
class NoEffectSetting:
    """One key a config sets, away from its default, that has no effect here."""

    key: str
    """Full dotted key, e.g. ``policy.sequence_packing.enabled``."""

    value: Any
    """The value the config gives it."""

    reason: str
    """Why it changes nothing here."""

    def __str__(self) -> str:
        return f"{self.key}={_show(self.value)} ({self.reason})"


def _show(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def no_effect_reason(field: FieldInfo) -> str | None:
    """The reason a field has no effect here (from its docstring), or ``None`` for a field that has one."""
    description = (field.description or "").strip()
    if not description.startswith(NO_EFFECT_PREFIX):
        return None
    reason = " ".join(description[len(NO_EFFECT_PREFIX) :].split()).lstrip(":").strip()
    if reason.startswith("(") and ")" in reason:
        reason = reason[1 : reason.index(")")]
    return reason.rstrip(".") or "not used by this project"


def field_no_effect_reason(model: type[BaseModel], name: str) -> str | None:
    """:func:`no_effect_reason` of ``model``'s field ``name``, with a reason reading "see ``other``" replaced by
    the reason of the sibling field ``other`` (docstrings of related knobs point at one another)."""
    reason = no_effect_reason(model.model_fields[name])
    if reason is not None and reason.startswith("see ``") and reason.endswith("``"):
        other = reason[len("see ``") : -len("``")]
        if other in model.model_fields and other != name:
            return field_no_effect_reason(model, other) or reason
    return reason


def _default(field: FieldInfo) -> Any:
    return field.get_default(call_default_factory=True)


def _children(value: Any, key: str) -> Iterator[tuple[str, BaseModel]]:
    """Config sections held by a field value: a model, or models inside a list or a dict."""
    if isinstance(value, BaseModel):
        yield key, value
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if isinstance(item, BaseModel):
                yield f"{key}.{i}", item
    elif isinstance(value, dict):
        for name, item in value.items():
            if isinstance(item, BaseModel):
                yield f"{key}.{name}", item


def _is_disabled(section: BaseModel) -> bool:
    return "enabled" in type(section).model_fields and section.enabled is False  # type: ignore[attr-defined]


def no_effect_settings(cfg: BaseModel, prefix: str = "") -> list[NoEffectSetting]:
    """Every key of ``cfg`` documented as having no effect here that is set away from its default.

    Keys are written from ``cfg``'s root with ``prefix`` in front (``prefix="policy."`` for a policy section).
    Sections below ``cfg`` with ``enabled: false`` are skipped: nothing in them is used.
    """
    found: list[NoEffectSetting] = []
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        key = f"{prefix}{name}"
        reason = field_no_effect_reason(type(cfg), name)
        if reason is not None:
            if value != _default(field):
                found.append(NoEffectSetting(key, value, reason))
            continue
        for child_key, child in _children(value, key):
            if not _is_disabled(child):
                found.extend(no_effect_settings(child, child_key + "."))
    if isinstance(cfg, ConfigModel):
        for key, reason in cfg.settings_without_effect().items():
            assert key in type(cfg).CONDITIONAL_NO_EFFECT, (
                f"{type(cfg).__name__}.CONDITIONAL_NO_EFFECT lacks {key}"
            )
            found.append(NoEffectSetting(f"{prefix}{key}", _value_at(cfg, key), reason))
    return found


def _value_at(cfg: BaseModel, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def no_effect_keys(schema: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """``{dotted key: reason}`` of every field of ``schema`` (and the sections below it) accepted with no
    effect here: the registry, as the docstrings declare it."""
    from nemo_rl.config.keys import _members  # the one place that knows how annotations nest

    found: dict[str, str] = {}
    stack: list[tuple[type[BaseModel], str, tuple[type, ...]]] = [(schema, prefix, ())]
    while stack:
        model, path, seen = stack.pop()
        if issubclass(model, ConfigModel):
            for key, where in model.CONDITIONAL_NO_EFFECT.items():
                found[f"{path}{key}"] = f"no effect unless {where}"
        for name, field in model.model_fields.items():
            key = f"{path}{name}"
            reason = field_no_effect_reason(model, name)
            if reason is not None:
                found[key] = reason
                continue
            for member in _members(field.annotation):
                for nested in _nested_models(member):
                    if nested not in seen:
                        stack.append((nested, f"{key}.", (*seen, model)))
    return dict(sorted(found.items()))


def _nested_models(annotation: Any) -> Iterable[type[BaseModel]]:
    from typing import get_args, get_origin

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    if get_origin(annotation) in (list, dict, tuple):
        for arg in get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield arg


def refusal(key: str, fix: str) -> ValueError:
    """The one-line error for ``key`` (full dotted path) selecting behaviour this project does not build;
    ``fix`` says what to set."""
    return ValueError(f"{key} selects behaviour nemo_rl does not build: {fix}")


def refuse_unbuilt(section: str, checks: Iterable[tuple[str, bool, str]]) -> None:
    """Raise :func:`refusal` for the first ``(key, is_set, fix)`` whose key selects unbuilt behaviour.

    ``section`` is the dotted path of the section the keys belong to (``"grpo"``); ``fix`` says what to set.
    """
    for key, is_set, fix in checks:
        if is_set:
            raise refusal(f"{section}.{key}", fix)


_reported: set[str] = set()


def report_no_effect(cfg: BaseModel, file: TextIO | None = None) -> list[NoEffectSetting]:
    """Print the keys of ``cfg`` that have no effect here, once per process and config; return them."""
    settings = no_effect_settings(cfg)
    fingerprint = json.dumps([str(s) for s in settings])
    if settings and fingerprint not in _reported:
        _reported.add(fingerprint)
        out = file if file is not None else sys.stderr
        print(format_no_effect(settings), file=out, flush=True)
    return settings


def format_no_effect(settings: list[NoEffectSetting]) -> str:
    """The report :func:`report_no_effect` prints (one line per key)."""
    if not settings:
        return "Every key of the config is used (none is on the list of keys that have no effect here)."
    lines = [f"{len(settings)} key(s) of the config are accepted but have no effect here:"]
    lines += [f"  - {s}" for s in settings]
    return "\n".join(lines)
