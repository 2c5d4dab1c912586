"""Typed configuration: schema sections, YAML loading with ``defaults:`` inheritance, overrides, validation.

Importing this package is cheap (no torch, ray or transformers), so a script can check its config and fail
fast before loading heavy libraries.
"""

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.cli import exit_on_user_error, parse_args_and_load, run_cli
from nemo_rl.config.errors import ConfigError, UserError
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
