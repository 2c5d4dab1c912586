"""NeMo RL's config helpers under their usual names and signatures; the implementation lives in
:mod:`nemo_rl.config`.

A NeMo RL driver script reads its recipe like this, and the same lines work here::

    config = load_config(args.config)                      # DictConfig, `defaults:` chain merged in
    if overrides:
        config = parse_hydra_overrides(config, overrides)  # Hydra grammar: a=v, +a=v, ++a=v, ~a
    config = OmegaConf.to_container(config, resolve=True)

Here the resulting dict is then validated into the typed config, e.g.
``nemo_rl.algorithms.grpo.MasterConfig.model_validate(config)``.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from nemo_rl.config.errors import ConfigError
from nemo_rl.config.loader import load_config as _load_config
from nemo_rl.config.loader import register_resolvers, save_config
from nemo_rl.config.overrides import apply_overrides

__all__ = [
    "OverridesError",
    "load_config",
    "load_config_with_inheritance",
    "parse_hydra_overrides",
    "register_omegaconf_resolvers",
    "register_resolvers",
    "save_config",
]


class OverridesError(ConfigError):
    """An override could not be parsed or applied (NeMo RL's name for it)."""


def load_config_with_inheritance(config_path: str | Path, base_dir: str | Path | None = None) -> DictConfig:
    """Load a YAML recipe with its ``defaults:`` chain merged in (see :func:`nemo_rl.config.loader.load_config`).

    ``base_dir`` resolves the relative ``defaults:`` paths of ``config_path`` (default: its folder).
    """
    return _load_config(config_path, base_dir)


def load_config(config_path: str | Path) -> DictConfig:
    """Load a YAML recipe with its ``defaults:`` chain merged in and ``_override_`` sections applied;
    interpolations are left unresolved, so overrides applied afterwards reach them."""
    return _load_config(config_path)


def parse_hydra_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Apply Hydra-grammar ``overrides`` to ``cfg`` in place and return it, as NeMo RL does.

    ``a.b=v`` changes an existing key, ``+a.b=v`` adds a new one, ``++a.b=v`` sets either way, ``~a.b``
    deletes. ``cfg`` is left in OmegaConf's struct mode (setting an unknown attribute raises), as in NeMo RL.

    Raises:
        OverridesError: an override does not parse, changes a key ``cfg`` does not have, adds one it has,
            or deletes one it lacks; every failing override is listed.
    """
    try:
        apply_overrides(cfg, overrides, in_place=True)
    except ConfigError as err:
        raise OverridesError(str(err)) from None
    OmegaConf.set_struct(cfg, True)
    return cfg


def register_omegaconf_resolvers() -> None:
    """Register the ``add``, ``sub``, ``mul``, ``div`` and ``max`` resolvers (NeMo RL's name for
    :func:`nemo_rl.config.loader.register_resolvers`)."""
    register_resolvers()
