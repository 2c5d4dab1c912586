"""Command-line overrides in Hydra's grammar, checked against the loaded YAML and the schema.

=============  ===================================================================================
``a.b=v``      change a key; it must exist in the YAML or be a valid key of the schema
``+a.b=v``     add a new key; an error if it is already set
``++a.b=v``    set a key whether or not it exists
``~a.b``       delete a key (``~a.b=v``: only if its value is ``v``)
=============  ===================================================================================

Values are typed by Hydra's own parser: ``1`` is an int, ``1e-5`` a float, ``true`` a bool, ``null`` None,
``[1,2]`` a list, ``{a: 1}`` a dict, ``'1'`` a string; ``${...}`` stays an interpolation. A dict value is
merged into an existing section, as in Hydra.

Shorthand: if a key does not start at the schema's root but is the suffix of exactly one valid key, it is
applied there with a notice on stderr (``swanlab_enabled=true`` -> ``logger.swanlab_enabled=true``).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel

from nemo_rl.config.errors import ConfigError
from nemo_rl.config.keys import check_key, closest_keys, container_default, shorthand_matches

OverrideKind = Literal["change", "add", "force_add", "delete"]

_GRAMMAR_HINT = "Overrides look like key=value, +new.key=value, ++key=value or ~key."


@dataclass(frozen=True)
class Override:
    """One parsed command-line override."""

    kind: OverrideKind
    """``change`` (``a=v``), ``add`` (``+a=v``), ``force_add`` (``++a=v``) or ``delete`` (``~a``)."""

    key: str
    """Dotted key as written."""

    value: Any
    """Parsed value (``None`` for a plain delete)."""

    has_value: bool
    """Whether a value was written (a delete may carry one: delete only if equal)."""

    text: str
    """The override as the user typed it."""

    def with_key(self, key: str) -> Override:
        """The same override on another key (used to expand a shorthand)."""
        prefix = {"change": "", "add": "+", "force_add": "++", "delete": "~"}[self.kind]
        value = self.text.split("=", 1)[1] if "=" in self.text else None
        text = f"{prefix}{key}" + (f"={value}" if value is not None else "")
        return Override(self.kind, key, self.value, self.has_value, text)


def parse_overrides(overrides: Sequence[str]) -> list[Override]:
    """Parse override strings with Hydra's override parser.

    Raises:
        ConfigError: for text that is not a valid override, a sweep (``a=1,2``), or a package/group override.
    """
    if not overrides:
        return []
    # Imported here: Hydra's parser pulls in the ANTLR runtime, which plain YAML loading does not need.
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    kinds: dict[OverrideType, OverrideKind] = {
        OverrideType.CHANGE: "change",
        OverrideType.ADD: "add",
        OverrideType.FORCE_ADD: "force_add",
        OverrideType.DEL: "delete",
    }
    out: list[Override] = []
    for text in overrides:
        try:
            (parsed,) = parser.parse_overrides([text])
        except HydraException as err:
            detail = str(err).splitlines()
            reason = detail[1].strip() if len(detail) > 1 else detail[0]
            raise ConfigError(f"cannot parse override {text!r}: {reason}. {_GRAMMAR_HINT}") from None
        key = parsed.key_or_group
        if not key:
            raise ConfigError(f"override {text!r} has no key. {_GRAMMAR_HINT}")
        if parsed.package is not None or "/" in key:
            raise ConfigError(
                f"override {text!r} uses a Hydra config group or package (`/`, `@`), which recipes do not "
                "have; write the dotted key of the value instead, e.g. policy.model_name=..."
            )
        if parsed.is_sweep_override():
            raise ConfigError(
                f"override {text!r} is a sweep, which is not supported; for a list value write "
                f"{key}=[{text.split('=', 1)[1]}] with brackets"
            )
        has_value = parsed.value_type is not None
        out.append(Override(kinds[parsed.type], key, parsed.value() if has_value else None, has_value, text))
    return out


_ABSENT = object()


def _child(node: Any, part: str) -> Any:
    """The child node of a config container, or ``_ABSENT``. Interpolations are not followed."""
    if isinstance(node, DictConfig):
        # `in` on a DictConfig is False for a `???` value; the key is still present.
        return node._get_node(part) if part in node.keys() else _ABSENT  # noqa: SIM118
    if isinstance(node, ListConfig) and part.isdigit() and int(part) < len(node):
        return node._get_node(int(part))
    return _ABSENT


def _walk(cfg: DictConfig, parts: Sequence[str]) -> Iterator[Any]:
    node: Any = cfg
    for part in parts:
        node = _child(node, part)
        yield node
        if node is _ABSENT:
            return


def _exists(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` is present in ``cfg`` (a ``null`` or ``???`` value counts as present)."""
    return all(node is not _ABSENT for node in _walk(cfg, key.split(".")))


def config_keys(cfg: DictConfig) -> list[str]:
    """Every dotted key present in ``cfg``, containers included (list items by index)."""
    out: list[str] = []

    def visit(prefix: str, node: Any) -> None:
        if isinstance(node, DictConfig):
            items: list[tuple[str, Any]] = [(str(k), node._get_node(k)) for k in node]
        elif isinstance(node, ListConfig):
            items = [(str(i), node._get_node(i)) for i in range(len(node))]
        else:
            return
        for name, child in items:
            key = f"{prefix}.{name}" if prefix else name
            out.append(key)
            visit(key, child)

    visit("", cfg)
    return out


def _resolve_shorthand(
    override: Override, cfg: DictConfig, schema_cls: type[BaseModel] | None
) -> Override | None:
    """Expand a shorthand key; ``None`` if the key is not one (it starts at the root, or matches nothing)."""
    if schema_cls is None:
        return None
    parts = override.key.split(".")
    if parts[0] in schema_cls.model_fields or parts[0] in cfg.keys():  # noqa: SIM118 (a `???` root key is present too)
        return None
    matches = shorthand_matches(schema_cls, override.key, config_keys(cfg))
    if not matches:
        return None
    if len(matches) > 1:
        raise ConfigError(
            f"override {override.text!r} is ambiguous: '{override.key}' could be any of "
            f"{', '.join(matches)}; write the full key"
        )
    expanded = override.with_key(matches[0])
    print(f"nemo_rl.config: {override.text!r} applied as {expanded.text!r}", file=sys.stderr)
    return expanded


def _unknown_key(override: Override, schema_cls: type[BaseModel] | None, action: str) -> ConfigError:
    hint = ""
    if schema_cls is not None:
        suggestions = closest_keys(schema_cls, override.key)
        if suggestions:
            hint = f"; did you mean {' or '.join(repr(s) for s in suggestions)}?"
    add = f" (to add a new key write +{override.text})" if override.kind == "change" else ""
    return ConfigError(
        f"cannot {action} '{override.key}' in override {override.text!r}: unknown key{hint}{add}"
    )


def _seed_defaults(cfg: DictConfig, override: Override, schema_cls: type[BaseModel] | None) -> None:
    """Copy schema defaults of dict/list fields on the way to a new key into ``cfg`` before setting it."""
    if schema_cls is None:
        return
    parts = override.key.split(".")
    for depth in range(1, len(parts)):
        prefix = ".".join(parts[:depth])
        if _exists(cfg, prefix):
            continue
        default = container_default(schema_cls, parts[:depth])
        if default is not None:
            OmegaConf.update(cfg, prefix, default, merge=False, force_add=True)
            return


def _set(cfg: DictConfig, override: Override, schema_cls: type[BaseModel] | None) -> None:
    _seed_defaults(cfg, override, schema_cls)
    try:
        OmegaConf.update(cfg, override.key, override.value, merge=True, force_add=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot apply override {override.text!r}: {err}") from None


def _delete(cfg: DictConfig, override: Override) -> None:
    parts = override.key.split(".")
    nodes = list(_walk(cfg, parts))
    parent = cfg if len(parts) == 1 else nodes[-2]
    index: int | str = int(parts[-1]) if isinstance(parent, ListConfig) else parts[-1]
    if override.has_value:
        current = parent[index]
        if isinstance(current, DictConfig | ListConfig):
            current = OmegaConf.to_container(current, resolve=True)
        if current != override.value:
            raise ConfigError(
                f"override {override.text!r} deletes '{override.key}' only if it equals {override.value!r}, "
                f"but it is {current!r}"
            )
    # A struct-mode config (NeMo RL's parse_hydra_overrides leaves one) refuses deletion unless opened.
    with open_dict(parent):
        del parent[index]


def apply_override(cfg: DictConfig, override: Override, schema_cls: type[BaseModel] | None = None) -> None:
    """Apply one parsed override to ``cfg`` in place (see the module docstring for the rules).

    Raises:
        ConfigError: unknown key (with the closest valid keys), ``+`` on an existing key, ambiguous shorthand.
    """
    in_schema = schema_cls is not None and check_key(schema_cls, override.key.split(".")) is None
    exists = _exists(cfg, override.key)
    if not exists and not in_schema:
        expanded = _resolve_shorthand(override, cfg, schema_cls)
        if expanded is not None:
            apply_override(cfg, expanded, schema_cls)
            return
    if override.kind == "delete":
        if not exists:
            raise ConfigError(
                f"cannot delete '{override.key}' ({override.text!r}): it is not set in the config"
            )
        _delete(cfg, override)
    elif override.kind == "add":
        if exists:
            raise ConfigError(
                f"cannot add '{override.key}' ({override.text!r}): it is already set; "
                f"to change it write {override.text[1:]} (or ++{override.text[1:]} to set it either way)"
            )
        _set(cfg, override, schema_cls)
    elif override.kind == "change":
        if not exists and not in_schema:
            raise _unknown_key(override, schema_cls, "set")
        _set(cfg, override, schema_cls)
    else:
        _set(cfg, override, schema_cls)


def apply_overrides(
    cfg: DictConfig,
    overrides: Sequence[str],
    schema_cls: type[BaseModel] | None = None,
    *,
    in_place: bool = False,
) -> DictConfig:
    """Return a copy of ``cfg`` (``cfg`` itself with ``in_place``) with Hydra-grammar ``overrides`` applied in
    order.

    With ``schema_cls``, ``a.b=v`` may also set a key that is valid in the schema but absent from the YAML,
    and shorthand keys are expanded. Interpolations are left unresolved so they see the new values.

    Raises:
        ConfigError: for unparsable overrides, unknown keys, ``+`` on an existing key, ``~`` on a missing one;
            every failing override of the command line is listed, not just the first.
    """
    out = cfg if in_place else copy.deepcopy(cfg)
    problems: list[str] = []
    for override in parse_overrides(overrides):
        # Keep going so that one run of the script reports every mistyped override at once.
        try:
            apply_override(out, override, schema_cls)
        except ConfigError as err:
            problems.append(str(err))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} overrides cannot be applied:", problems)
    return out
