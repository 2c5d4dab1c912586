"""NeMo RL's config helpers under their usual names; the implementation lives in :mod:`nemo_rl.config`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from nemo_rl.config.loader import load_config, register_resolvers, save_config
from nemo_rl.config.overrides import apply_overrides

__all__ = [
    "load_config",
    "load_config_with_inheritance",
    "parse_hydra_overrides",
    "register_resolvers",
    "save_config",
]


def load_config_with_inheritance(path: str | Path) -> DictConfig:
    """Load a YAML recipe with its ``defaults:`` chain merged in (same as :func:`load_config`)."""
    return load_config(path)


def parse_hydra_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Return ``cfg`` with Hydra-grammar overrides applied (no schema: ``a=v`` needs ``a`` in the config)."""
    return apply_overrides(cfg, overrides)
