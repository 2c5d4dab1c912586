"""Validate a plain config dict against a schema and explain failures in config terms.

pydantic's errors are rewritten into one line per problem that names the full dotted key:
an unknown key comes with the closest valid keys, a wrong type with the expected type and the given value,
a failed model validator with its message and the section it belongs to.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from nemo_rl.config.errors import ConfigError
from nemo_rl.config.keys import closest_keys, format_type, locate

ModelT = TypeVar("ModelT", bound=BaseModel)

_VALIDATOR_PREFIXES = ("Value error, ", "Assertion failed, ")


def validate_dict(data: Any, schema_cls: type[ModelT], source: str = "config") -> ModelT:
    """Build ``schema_cls`` from ``data`` (a plain, resolved dict).

    Raises:
        ConfigError: listing every problem found; ``source`` names the config in the message.
    """
    try:
        return schema_cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"Invalid {source}:", explain_validation_error(err, schema_cls)) from None


def _describe_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def explain_validation_error(err: ValidationError, schema_cls: type[BaseModel]) -> list[str]:
    """One readable line per problem of ``err``, keys written as full dotted config keys.

    Where a value matched no member of a union of models, only the errors of the member it came closest to
    (fewest errors) are kept, so a typo in one scheduler entry is not reported once per scheduler class.
    """
    errors = err.errors(include_url=False)
    located = [locate(schema_cls, e["loc"]) for e in errors]

    tally: Counter[tuple[str, str]] = Counter()
    for where in located:
        tally.update(where.union_choices)
    best: dict[str, str] = {}
    for (union_key, tag), count in tally.items():
        if union_key not in best or count < tally[(union_key, best[union_key])]:
            best[union_key] = tag

    problems: list[str] = []
    for error, where in zip(errors, located, strict=True):
        if any(best[union_key] != tag for union_key, tag in where.union_choices):
            continue
        line = _explain_one(error, where.dotted, where.annotation, schema_cls)
        if line not in problems:
            problems.append(line)
    return problems


def _explain_one(error: Any, key: str, annotation: Any, schema_cls: type[BaseModel]) -> str:
    kind = error["type"]
    message: str = error["msg"]
    if kind == "extra_forbidden":
        suggestions = closest_keys(schema_cls, key)
        hint = f"; did you mean {' or '.join(repr(s) for s in suggestions)}?" if suggestions else ""
        return f"unknown key '{key}'{hint}"
    if kind == "missing":
        return f"missing required key '{key}' (set it in the YAML or with `++{key}=...`)"
    if kind in ("value_error", "assertion_error"):
        for prefix in _VALIDATOR_PREFIXES:
            message = message.removeprefix(prefix)
        return f"{key}: {message}" if key else message
    expected = format_type(annotation) if annotation is not None else "?"
    return f"{key}: expected {expected}, got {_describe_value(error['input'])} ({message})"
