"""Checks that a config's model sources can be loaded, cheap enough to run before anything starts.

A local folder that does not exist (a typo in ``policy.model_name``) is found from the path alone, so scripts
check it right after loading the config, before Ray's start and the heavy imports: the error comes at once.
Hub names are left to the loader (whether the hub or its cache has them is only known by trying).
"""

from __future__ import annotations

import os
import pathlib

from nemo_rl.config.errors import UserError
from nemo_rl.config.lora_targets import check_lora_targets
from nemo_rl.config.policy import PolicyConfig


def looks_local(name: str) -> bool:
    """Whether ``name`` is meant as a folder rather than a hub id (``name`` or ``org/name``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or pathlib.Path(name).exists()


def check_model_source(name: str, key: str, *, need_config: bool = True) -> None:
    """Raise :class:`UserError` naming ``key`` when ``name`` is meant as a local folder (an absolute,
    relative or home path, or an existing path) that does not exist, is not a readable folder, or (with
    ``need_config``) has no ``config.json``. Hub names are left to the loader."""
    if not looks_local(name):
        return
    path = pathlib.Path(name).expanduser()
    if not path.exists():
        raise UserError(f"{key}={name} does not exist; give an existing model folder or a hub name")
    if not path.is_dir() or not os.access(path, os.R_OK | os.X_OK):
        raise UserError(f"{key}={name} is not a readable folder; give a Hugging Face model folder")
    if need_config and not (path / "config.json").is_file():
        raise UserError(
            f"{key}={name} has no config.json, so it is not a Hugging Face model folder; point it at the "
            "folder that holds config.json and the weights"
        )


def check_policy_sources(policy: PolicyConfig) -> None:
    """:func:`check_model_source` of ``policy.model_name`` and of ``policy.tokenizer.name`` when it is set, then
    the LoRA targets against the model's layers (:func:`~nemo_rl.config.lora_targets.check_lora_targets`)."""
    check_model_source(policy.model_name, "policy.model_name")
    if policy.tokenizer.name is not None:
        check_model_source(policy.tokenizer.name, "policy.tokenizer.name", need_config=False)
    check_lora_targets(policy)
