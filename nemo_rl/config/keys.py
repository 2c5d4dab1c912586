"""Dotted keys of a config schema: which keys exist, which are closest to a typo, where a shorthand points.

A schema is a pydantic model class (normally a :class:`~nemo_rl.config.base.ConfigModel`). Its keys are found
by walking nested model fields, including ``Optional[Model]``, unions of models, ``list[Model | ...]`` (the
item's keys sit under an index, shown as ``<index>``) and ``dict[str, Model]`` (under a name, shown as
``<name>``). Fields typed ``Any``, bare ``dict`` or ``dict[str, Any]`` are open: any key below them is valid,
and so is any undeclared key of a model that allows extra keys (``extra="allow"``, e.g. ``env``).
"""

from __future__ import annotations

import difflib
import functools
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

INDEX = "<index>"
"""Placeholder for a list index in a schema path."""

NAME = "<name>"
"""Placeholder for a free dict key in a schema path."""

_SIMILARITY_MARGIN = 0.05
"""Suggestions scoring this much below the best :mod:`difflib` ratio are dropped."""

_OPEN = "open"
"""Marker: the position accepts any key below it (an ``Any``-typed value)."""


@dataclass(frozen=True)
class SchemaKey:
    """One dotted key of a schema, possibly with ``<index>`` / ``<name>`` placeholders."""

    parts: tuple[str, ...]
    """Key segments from the root."""

    annotation: Any
    """Declared type of the value at this key."""

    @property
    def dotted(self) -> str:
        """The key written with dots, e.g. ``policy.dtensor_cfg.enabled``."""
        return ".".join(self.parts)

    @property
    def is_concrete(self) -> bool:
        """Whether the key has no placeholder segment."""
        return INDEX not in self.parts and NAME not in self.parts

    @property
    def is_section(self) -> bool:
        """Whether the value is (or may be) a nested config model rather than a leaf value."""
        return any(_is_model(m) for m in _members(self.annotation))


def _strip(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a (possibly optional) union, without ``None``; a non-union is its own member."""
    annotation = _strip(annotation)
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        out: list[Any] = []
        for arg in get_args(annotation):
            if arg is not type(None):
                out.extend(_members(arg))
        return out
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _children(annotation: Any, segment: str) -> list[Any] | str:
    """Declared types reachable from ``annotation`` through ``segment``; ``_OPEN`` if anything goes below."""
    out: list[Any] = []
    for member in _members(annotation):
        if member is Any or member is object:
            return _OPEN
        if _is_model(member):
            field = member.model_fields.get(segment)
            if field is not None:
                out.append(field.annotation)
            elif member.model_config.get("extra") == "allow":
                return _OPEN
            continue
        origin = get_origin(member)
        args = get_args(member)
        if member in (dict, list, tuple) or (origin in (dict, Mapping) and len(args) < 2):
            return _OPEN
        if origin in (dict, Mapping):
            if args[1] is Any:
                return _OPEN
            out.append(args[1])
        elif origin in (list, Sequence, tuple) and segment.isdigit():
            if not args:
                return _OPEN
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                index = int(segment)
                if index < len(args):
                    out.append(args[index])
            else:
                out.append(args[0])
    return out


@dataclass(frozen=True)
class _Reach:
    """Where following a dotted key through a schema ends up."""

    types: list[Any]
    """Declared types the key can denote (several below a union); empty when the key is invalid."""

    is_open: bool
    """The key passed through an ``Any``-typed field, below which every key is valid."""

    bad_index: int | None
    """Index of the first part that matches nothing, or ``None``."""


def _reach(schema: type[BaseModel], parts: Sequence[str]) -> _Reach:
    current: list[Any] = [schema]
    for i, part in enumerate(parts):
        nxt: list[Any] = []
        for annotation in current:
            reached = _children(annotation, part)
            if isinstance(reached, str):
                return _Reach([Any], True, None)
            nxt.extend(reached)
        if not nxt:
            return _Reach([], False, i)
        current = nxt
    return _Reach(current, False, None)


def check_key(schema: type[BaseModel], parts: Sequence[str]) -> int | None:
    """Return ``None`` if the dotted key ``parts`` is valid for ``schema``, else the index of the first bad part.

    A list position accepts a non-negative integer part; a ``dict[str, X]`` accepts any part.
    """
    return _reach(schema, parts).bad_index


def annotation_at(schema: type[BaseModel], parts: Sequence[str]) -> Any | None:
    """Declared type at a valid dotted key (``Any`` below an open field), or ``None`` if the key is invalid."""
    types = _reach(schema, parts).types
    if not types:
        return None
    return functools.reduce(lambda a, b: a | b, types)


def _field_default(field: FieldInfo) -> Any | None:
    """A field's default value (calling its factory), or ``None`` if it is required or needs other fields."""
    if field.is_required() or field.default_factory_takes_validated_data:
        return None
    return field.get_default(call_default_factory=True)


def _dict_value_type(annotation: Any) -> Any:
    for member in _members(annotation):
        args = get_args(member)
        if get_origin(member) in (dict, Mapping) and len(args) == 2:
            return args[1]
    return Any


def container_default(schema: type[BaseModel], parts: Sequence[str]) -> dict[str, Any] | list[Any] | None:
    """Schema default of the dict- or list-valued field at ``parts`` (as plain data), else ``None``.

    Used to seed a field absent from the YAML before an override sets one entry inside it, so
    ``policy.optimizer.kwargs.lr=1`` keeps the other default keyword arguments. Fields holding a nested
    model are not seeded (pydantic fills in their defaults itself), nor are required fields.
    """
    if not parts:
        return None
    parent = _reach(schema, parts[:-1])
    for member in (m for a in parent.types for m in _members(a)):
        if not _is_model(member) or parts[-1] not in member.model_fields:
            continue
        default = _field_default(member.model_fields[parts[-1]])
        if isinstance(default, BaseModel) or not isinstance(default, dict | list) or not default:
            return None
        return to_jsonable_python(default)
    return None


def schema_keys(schema: type[BaseModel]) -> list[SchemaKey]:
    """Every dotted key of ``schema``, sections included, in declaration order (depth first)."""
    out: dict[tuple[str, ...], SchemaKey] = {}
    _walk(schema, (), (), out)
    return list(out.values())


@functools.lru_cache(maxsize=64)
def _cached_schema_keys(schema: type[BaseModel]) -> tuple[SchemaKey, ...]:
    return tuple(schema_keys(schema))


def _walk(
    annotation: Any,
    prefix: tuple[str, ...],
    stack: tuple[type, ...],
    out: dict[tuple[str, ...], SchemaKey],
) -> None:
    for member in _members(annotation):
        if _is_model(member):
            # A model that contains itself would otherwise recurse forever.
            if member in stack:
                continue
            for name, field in member.model_fields.items():
                path = (*prefix, name)
                out.setdefault(path, SchemaKey(path, field.annotation))
                _walk(field.annotation, path, (*stack, member), out)
                # Keys of a dict default (``optimizer.kwargs.lr``) are known keys too, for hints and shorthand.
                default = _field_default(field)
                if isinstance(default, dict):
                    value_type = _dict_value_type(field.annotation)
                    for entry in default:
                        entry_path = (*path, str(entry))
                        out.setdefault(entry_path, SchemaKey(entry_path, value_type))
            continue
        origin = get_origin(member)
        args = get_args(member)
        if origin in (list, Sequence) and args:
            _walk(args[0], (*prefix, INDEX), stack, out)
        elif origin is tuple and args:
            for item in args:
                if item is not Ellipsis:
                    _walk(item, (*prefix, INDEX), stack, out)
        elif origin in (dict, Mapping) and len(args) == 2:
            _walk(args[1], (*prefix, NAME), stack, out)


def _instantiate(key: SchemaKey, user_parts: Sequence[str]) -> str | None:
    """Fill a schema key's placeholders from the user's key; ``None`` where the user's key does not supply one.

    A placeholder is filled only when everything before it equals the user's key, so ``env.<name>.x`` becomes
    ``env.math.x`` for ``env.math.y`` but not for ``policy.math.y``.
    """
    parts = list(key.parts)
    for i, part in enumerate(parts):
        if part not in (NAME, INDEX):
            continue
        if i >= len(user_parts) or parts[:i] != list(user_parts[:i]):
            return None
        if part == INDEX and not user_parts[i].isdigit():
            return None
        parts[i] = user_parts[i]
    return ".".join(parts)


def closest_keys(schema: type[BaseModel], key: str, max_results: int = 3) -> list[str]:
    """Valid dotted keys of ``schema`` closest to the (invalid) ``key``, best first.

    Keys ending in the same field name come first (``policy.tensor_parallel_size`` ->
    ``policy.dtensor_cfg.tensor_parallel_size``), then :mod:`difflib` matches over all keys. If nothing is
    close, the keys under the deepest valid prefix of ``key`` are ranked instead, so there is always a hint.
    """
    user_parts = key.split(".")
    filled = (_instantiate(k, user_parts) for k in _cached_schema_keys(schema))
    candidates = [c for c in dict.fromkeys(filled) if c is not None and c != key]

    def similarity(candidate: str) -> float:
        return difflib.SequenceMatcher(None, key, candidate).ratio()

    # An ancestor of the key (``policy.generation`` for ``policy.generation.top_kk``) is no useful hint.
    candidates = [c for c in candidates if not key.startswith(c + ".")]
    same_leaf = sorted(
        (c for c in candidates if c.split(".")[-1] == user_parts[-1]), key=similarity, reverse=True
    )
    close = difflib.get_close_matches(key, candidates, n=max_results, cutoff=0.6)
    if close:
        # Keep only matches about as good as the best one, so a clear typo gets a single answer.
        best = similarity(close[0])
        close = [c for c in close if similarity(c) >= best - _SIMILARITY_MARGIN]
    found = list(dict.fromkeys([*same_leaf, *close]))
    if not found:
        bad = check_key(schema, user_parts)
        prefix = ".".join(user_parts[:bad]) if bad else ""
        siblings = [
            c for c in candidates if (not prefix or c.startswith(prefix + ".")) and c.count(".") == (bad or 0)
        ]
        found = sorted(siblings, key=similarity, reverse=True)
    return found[:max_results]


def shorthand_matches(schema: type[BaseModel], key: str, extra_keys: Iterable[str] = ()) -> list[str]:
    """Full dotted keys that end with ``key`` (on segment boundaries), e.g. ``swanlab_enabled`` ->
    ``logger.swanlab_enabled``.

    Candidates are the schema's keys without placeholders plus ``extra_keys`` (e.g. the keys present in the
    loaded YAML, which fill in dict names such as ``env.math``). Only strictly longer keys match.
    """
    suffix = tuple(key.split("."))
    candidates = [k.dotted for k in _cached_schema_keys(schema) if k.is_concrete]
    candidates.extend(extra_keys)
    out: list[str] = []
    for candidate in dict.fromkeys(candidates):
        parts = tuple(candidate.split("."))
        if len(parts) > len(suffix) and parts[-len(suffix) :] == suffix and check_key(schema, parts) is None:
            out.append(candidate)
    return out


def format_type(annotation: Any) -> str:
    """Readable type name: ``int``, ``str | None``, ``list[int]``, ``'float32' | 'bfloat16'``."""
    annotation = _strip(annotation)
    if annotation is type(None) or annotation is None:
        return "None"
    if annotation is Any:
        return "Any"
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return " | ".join(format_type(a) for a in get_args(annotation))
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(annotation))
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        args = get_args(annotation)
        return (
            f"{name}[{', '.join('...' if a is Ellipsis else format_type(a) for a in args)}]" if args else name
        )
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


@dataclass(frozen=True)
class LocatedKey:
    """Where a pydantic error location points in config terms."""

    dotted: str
    """Dotted config key, with union member tags removed (``policy.scheduler.0.name``)."""

    annotation: Any | None
    """Declared type at that key, or ``None`` if the key is not in the schema."""

    union_choices: tuple[tuple[str, str], ...]
    """``(dotted key of the union, member tag)`` for each union member the location went through."""


def locate(schema: type[BaseModel], loc: Sequence[int | str]) -> LocatedKey:
    """Map a pydantic error ``loc`` to a dotted config key.

    pydantic inserts a tag (the class name for a model, e.g. ``SchedulerEntry``) where it tried one member of
    a union; those tags are recorded in ``union_choices`` and left out of the key.
    """
    current: list[Any] = [schema]
    declared: Any | None = schema
    parts: list[str] = []
    choices: list[tuple[str, str]] = []
    for segment in loc:
        part = str(segment)
        alternatives = [m for a in current for m in _members(a)]
        if isinstance(segment, str) and len(alternatives) > 1:
            tagged = [m for m in alternatives if _is_model(m) and m.__name__ == segment]
            if tagged:
                choices.append((".".join(parts), segment))
                current = tagged
                continue
        reached: list[Any] = []
        is_open = False
        for annotation in current:
            found = _children(annotation, part)
            if isinstance(found, str):
                is_open = True
                break
            reached.extend(found)
        if is_open:
            current, declared = [Any], Any
        elif reached:
            current = reached
            declared = reached[0] if len(reached) == 1 else functools.reduce(lambda a, b: a | b, reached)
        elif isinstance(segment, str) and len(alternatives) > 1:
            # A tag of a scalar union member (``int``, ``list[int]``...): not part of the key.
            choices.append((".".join(parts), segment))
            continue
        else:
            current, declared = [], None
        parts.append(part)
    return LocatedKey(".".join(parts), declared, tuple(choices))
