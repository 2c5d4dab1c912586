"""Typed configuration: schema sections, YAML loading with ``defaults:`` inheritance, overrides, validation.

Importing this package is cheap (no torch, ray or transformers), so a script can check its config and fail
fast before loading heavy libraries. The loading, override and command-line helpers (OmegaConf and Hydra's
override grammar) are imported on first use: worker processes import the schema sections only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.errors import ConfigError, UserError

if TYPE_CHECKING:
    from nemo_rl.config.cli import exit_on_user_error, parse_args_and_load, run_cli
    from nemo_rl.config.loader import (
        flatten_config,
        format_config,
        load_and_resolve,
        load_and_validate,
        load_config,
        register_resolvers,
        resolve_config,
        save_config,
        to_dict,
        validate_config,
    )
    from nemo_rl.config.overrides import apply_overrides, parse_overrides

_LAZY_EXPORTS = {
    "exit_on_user_error": "nemo_rl.config.cli",
    "parse_args_and_load": "nemo_rl.config.cli",
    "run_cli": "nemo_rl.config.cli",
    "flatten_config": "nemo_rl.config.loader",
    "format_config": "nemo_rl.config.loader",
    "load_and_resolve": "nemo_rl.config.loader",
    "load_and_validate": "nemo_rl.config.loader",
    "load_config": "nemo_rl.config.loader",
    "register_resolvers": "nemo_rl.config.loader",
    "resolve_config": "nemo_rl.config.loader",
    "save_config": "nemo_rl.config.loader",
    "to_dict": "nemo_rl.config.loader",
    "validate_config": "nemo_rl.config.loader",
    "apply_overrides": "nemo_rl.config.overrides",
    "parse_overrides": "nemo_rl.config.overrides",
}


def __getattr__(name: str) -> Any:
    """Import a loading / override / command-line helper on first use."""
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ConfigError",
    "ConfigModel",
    "UserError",
    "apply_overrides",
    "exit_on_user_error",
    "flatten_config",
    "format_config",
    "load_and_resolve",
    "load_and_validate",
    "load_config",
    "parse_args_and_load",
    "parse_overrides",
    "register_resolvers",
    "resolve_config",
    "run_cli",
    "save_config",
    "to_dict",
    "validate_config",
]
