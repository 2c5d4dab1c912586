"""Load YAML recipes with ``defaults:`` inheritance, resolve them and validate them against a schema.

A recipe may inherit from other YAML files::

    defaults: ../../grpo_math_1B.yaml          # or a list: [base.yaml, overrides.yaml]
    policy:
      model_name: Qwen/Qwen2.5-1.5B

Paths are relative to the including file; inheritance is recursive; later entries override earlier ones and
the file itself overrides all of them. Sections merge key by key; a section marked ``_override_: true``
replaces the inherited section of the same key instead (NeMo RL's marker; the marker itself is dropped)::

    defaults: grpo_math_1B.yaml
    data:
      _override_: true                        # the parent's other data keys are not inherited
      dataset_name: tiny_math

Interpolations (``${policy.model_name}``, ``${mul:${a},2}``) stay
unresolved until :func:`resolve_config`, so they see command-line overrides.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    UnsupportedInterpolationType,
)
from pydantic import BaseModel

from nemo_rl.config.errors import ConfigError
from nemo_rl.config.overrides import apply_overrides
from nemo_rl.config.validation import validate_dict

ModelT = TypeVar("ModelT", bound=BaseModel)

DEFAULTS_KEY = "defaults"
"""Top-level YAML key naming the file(s) a recipe inherits from."""

OVERRIDE_MARKER = "_override_"
"""Key marking a section that replaces the inherited section instead of merging into it."""

CONFIG_FILENAME = "config.yaml"
"""Name of the resolved config written by :func:`save_config`."""


def _mul(*values: Any) -> Any:
    return math.prod(values)


def _add(*values: Any) -> Any:
    return sum(values)


def _div(numerator: Any, denominator: Any) -> Any:
    if denominator == 0:
        raise ConfigError(f"${{div:{numerator},{denominator}}} divides by zero")
    # Counts such as batch sizes stay integers when they divide exactly, so int fields accept them.
    if isinstance(numerator, int) and isinstance(denominator, int) and numerator % denominator == 0:
        return numerator // denominator
    return numerator / denominator


def _sub(minuend: Any, subtrahend: Any) -> Any:
    return minuend - subtrahend


def _max(*values: Any) -> Any:
    return max(values)


_RESOLVERS = {"mul": _mul, "add": _add, "sub": _sub, "div": _div, "max": _max}


def register_resolvers() -> None:
    """Register the ``mul``, ``add``, ``sub``, ``div`` and ``max`` interpolation resolvers (safe to call
    repeatedly).

    ``${mul:a,b,...}`` multiplies, ``${add:a,b,...}`` sums, ``${sub:a,b}`` subtracts, ``${div:a,b}`` divides
    (an int when exact) and ``${max:a,b,...}`` takes the largest argument. A resolver of the same name
    registered elsewhere is kept.
    """
    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"cannot parse config file {path}: {err}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of keys at the top level, not a list")
    return loaded


def _defaults_of(cfg: DictConfig, path: Path, base_dir: Path | None = None) -> list[Path]:
    if DEFAULTS_KEY not in cfg:
        return []
    container = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(container, dict)
    raw = container[DEFAULTS_KEY]
    entries = [raw] if isinstance(raw, str) else raw
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(
            f"{path}: `defaults:` must be a YAML file path or a list of paths (relative to this file), "
            f"got {raw!r}"
        )
    return [((base_dir or path.parent) / Path(e).expanduser()).resolve() for e in entries]


def _load_recursive(path: Path, chain: tuple[Path, ...], base_dir: Path | None = None) -> DictConfig:
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain[chain.index(path) :], path))
        raise ConfigError(f"`defaults:` inheritance forms a cycle: {cycle}")
    cfg = _read_yaml(path)
    parents = _defaults_of(cfg, path, base_dir)
    if not parents:
        return cfg
    merged = OmegaConf.create({})
    for parent in parents:
        merged = _merge(merged, _load_recursive(parent, (*chain, path)), parent)
    own = _without_defaults(cfg)
    return _merge(merged, own, path)


def _without_defaults(cfg: DictConfig) -> DictConfig:
    return OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != DEFAULTS_KEY])


def _sections(node: DictConfig) -> list[tuple[str, DictConfig]]:
    """The child sections of ``node`` (values that are mappings), without resolving interpolations."""
    children = ((str(key), node._get_node(key)) for key in node.keys())  # noqa: SIM118 (`???` keys count)
    return [(key, child) for key, child in children if isinstance(child, DictConfig)]


def _drop_replaced_sections(base: DictConfig, top: DictConfig) -> None:
    """Remove from ``base`` every section that ``top`` marks ``_override_: true``, and the markers from
    ``top``, so the merge puts ``top``'s section in place of the inherited one."""
    for key, section in _sections(top):
        marker = section.pop(OVERRIDE_MARKER, None)
        inherited = base._get_node(key) if key in base.keys() else None  # noqa: SIM118 (`???` keys count)
        if marker is True and inherited is not None:
            del base[key]
        elif isinstance(inherited, DictConfig):
            _drop_replaced_sections(inherited, section)
        else:
            _drop_replaced_sections(OmegaConf.create({}), section)


def _merge(base: DictConfig, top: DictConfig, top_path: Path) -> DictConfig:
    base, top = copy.deepcopy(base), copy.deepcopy(top)
    _drop_replaced_sections(base, top)
    try:
        merged = OmegaConf.merge(base, top)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot merge {top_path} onto the configs it inherits from: {err}") from None
    assert isinstance(merged, DictConfig)
    return merged


def load_config(path: str | Path, base_dir: str | Path | None = None) -> DictConfig:
    """Load a YAML recipe with its ``defaults:`` chain merged in; interpolations are left unresolved.

    ``base_dir`` resolves the relative ``defaults:`` paths of ``path`` itself (default: its folder); those
    of the files it inherits from are relative to each of them.

    Raises:
        ConfigError: missing or unparsable file, bad ``defaults:`` entry, or an inheritance cycle.
    """
    top_dir = None if base_dir is None else Path(base_dir).expanduser().resolve()
    cfg = _load_recursive(Path(path).expanduser().resolve(), (), top_dir)
    # The inheritance list has been applied; keeping it would make it look like a config section.
    cfg = _without_defaults(cfg)
    # Markers in a file that inherits nothing (or set to false) have nothing to replace.
    _drop_replaced_sections(OmegaConf.create({}), cfg)
    return cfg


def _first_line(message: str | None) -> str:
    # OmegaConf appends `full_key:` / `object_type=` lines; the key is reported separately.
    lines = (message or "").splitlines()
    return (lines[0] if lines else "").removeprefix("ConfigError raised while resolving interpolation: ")


def resolve_config(cfg: DictConfig) -> dict[str, Any]:
    """Resolve every interpolation of ``cfg`` and return it as a plain dict.

    Raises:
        ConfigError: an interpolation points to a missing key, a resolver failed, or a value is ``???``.
    """
    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as err:
        raise ConfigError(f"no value given for '{err.full_key}': set it with `{err.full_key}=...`") from None
    except UnsupportedInterpolationType as err:
        raise ConfigError(
            f"cannot resolve '{err.full_key}': {_first_line(err.msg)} "
            f"(known resolvers include {', '.join(_RESOLVERS)} and OmegaConf's oc.*)"
        ) from None
    except InterpolationResolutionError as err:
        raise ConfigError(f"cannot resolve '{err.full_key}': {_first_line(err.msg)}") from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve the config: {err}") from None
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}


def validate_config(
    cfg: DictConfig | Mapping[str, Any], schema_cls: type[ModelT], source: str = "config"
) -> ModelT:
    """Resolve ``cfg`` (if it is a DictConfig) and build the typed ``schema_cls`` from it.

    Raises:
        ConfigError: listing every unknown key (with the closest valid keys), wrong type and failed check.
    """
    data = resolve_config(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    return validate_dict(data, schema_cls, source)


def load_and_resolve(
    path: str | Path, schema_cls: type[ModelT], overrides: Sequence[str] = ()
) -> tuple[ModelT, DictConfig]:
    """Load ``path``, apply command-line ``overrides``, resolve and validate.

    Returns:
        The typed config and the resolved DictConfig (the latter is handy for logging and saving).

    Raises:
        ConfigError: for any problem in the file, the overrides or the values.
    """
    cfg = apply_overrides(load_config(path), overrides, schema_cls)
    source = f"config {path}" + (f" with overrides {' '.join(overrides)}" if overrides else "")
    resolved = resolve_config(cfg)
    model = validate_dict(resolved, schema_cls, source)
    return model, OmegaConf.create(_escape_interpolations(resolved))


def load_and_validate(path: str | Path, schema_cls: type[ModelT], overrides: Sequence[str] = ()) -> ModelT:
    """Load ``path``, apply ``overrides`` (Hydra grammar) and return the validated ``schema_cls`` instance.

    Raises:
        ConfigError: for any problem in the file, the overrides or the values.
    """
    return load_and_resolve(path, schema_cls, overrides)[0]


def to_dict(cfg: BaseModel | DictConfig | ListConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Plain nested dict of a config (a model, a DictConfig, resolved, or a mapping), JSON/YAML-safe values."""
    if isinstance(cfg, BaseModel):
        return cfg.model_dump(mode="json")
    if isinstance(cfg, DictConfig):
        return resolve_config(cfg)
    if isinstance(cfg, ListConfig):
        raise TypeError("to_dict takes a config mapping, not a list")
    return {str(k): v for k, v in cfg.items()}


def flatten_config(cfg: BaseModel | DictConfig | Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """Flatten a config into ``{"policy.dtensor_cfg.enabled": True, ...}`` for logging hyperparameters.

    Nested mappings are flattened; lists holding mappings are flattened by index (``policy.scheduler.0.name``);
    lists of plain values are kept as lists.
    """
    out: dict[str, Any] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            if not value and prefix:
                out[prefix] = {}
            for k, v in value.items():
                visit(f"{prefix}{sep}{k}" if prefix else str(k), v)
        elif isinstance(value, list) and any(isinstance(v, Mapping) for v in value):
            for i, v in enumerate(value):
                visit(f"{prefix}{sep}{i}", v)
        else:
            out[prefix] = value

    visit("", to_dict(cfg))
    return out


def format_config(cfg: BaseModel | DictConfig | Mapping[str, Any]) -> str:
    """The resolved config as YAML text, in declaration order (for printing at startup)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def save_config(cfg: BaseModel | DictConfig | Mapping[str, Any], directory: str | Path) -> Path:
    """Write the fully resolved config to ``directory/config.yaml`` (creating ``directory``) and return the path.

    The file loads back with :func:`load_config` into an equal config.
    """
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / CONFIG_FILENAME
    text = yaml.safe_dump(_escape_interpolations(to_dict(cfg)), sort_keys=False, default_flow_style=False)
    path.write_text(text)
    return path


def _escape_interpolations(value: Any) -> Any:
    # A resolved string may still contain `${` (e.g. a prompt template); escaped, it reloads verbatim.
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, dict):
        return {k: _escape_interpolations(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_interpolations(v) for v in value]
    return value
