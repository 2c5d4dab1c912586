"""A model's Hugging Face config with ``policy.hf_config_overrides`` applied.

Every place that builds the policy's model from its Hugging Face config (the DTensor and Megatron policy
workers, the embedded generation engine, vLLM, checkpoint conversion) reads it through :func:`load_hf_config`,
so training and generation agree on the overridden architecture (e.g. a longer ``max_position_embeddings``
or another ``rope_parameters``).
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_rl.config.errors import UserError

OVERRIDES_KEY = "policy.hf_config_overrides"


def load_hf_config(
    model_name: str | Path,
    *,
    trust_remote_code: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """``AutoConfig.from_pretrained(model_name)`` with each attribute named in ``overrides`` replaced by its
    value (a mapping value replaces the attribute whole, as Hugging Face's ``from_pretrained(**kwargs)``).

    Raises:
        UserError: an override names an attribute the model's config does not have (a typo, or a key this
            transformers version spells differently, e.g. ``rope_theta`` inside ``rope_parameters``).
    """
    # Imported here: resolving ``AutoConfig`` makes transformers index every model folder it has (about 0.5 s
    # of CPU), which a driver that imports the policy workers' classes but builds no model never needs.
    index_model_folders_once()
    from transformers import AutoConfig

    config, unused = AutoConfig.from_pretrained(
        model_name, trust_remote_code=trust_remote_code, return_unused_kwargs=True, **dict(overrides or {})
    )
    if unused:
        known = sorted(config.to_dict())
        hints = []
        for name in sorted(unused):
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"{OVERRIDES_KEY}.{name}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise UserError(
            f"{', '.join(hints)}: {type(config).__name__} of {model_name} has no such attribute; override "
            "attributes its config.json has"
        )
    return config


def index_model_folders_once() -> None:
    """Make ``import transformers.models`` reuse the index of model folders ``import transformers`` built.

    transformers builds its lazy module tables by reading the ``__all__`` of every file under
    ``transformers/models`` (about 3,000 files; benchmarks/README.md has its CPU cost). Its package ``__init__`` scans that folder
    by path and ``transformers.models``' ``__init__`` scans it again by the path of its ``__init__.py``: the
    scan is cached, but the two spellings are two cache keys, so every process that builds a model (each policy
    worker) scanned the folder twice. This wraps the scan so the second spelling hits the first one's cache
    entry; the tables are the same folder's either way. It must run after ``import transformers`` and before
    ``transformers.models`` is imported (``load_hf_config`` calls it first), and does nothing otherwise or
    when this transformers version no longer scans that way.
    """
    import transformers

    if "transformers.models" in sys.modules:
        return
    from transformers.utils import import_utils

    scan = getattr(import_utils, "create_import_structure_from_path", None)
    if scan is None or not hasattr(scan, "cache_info") or getattr(scan, "_nemo_rl_one_scan", False):
        return
    models_dir = Path(transformers.__file__).parent / "models"

    @functools.wraps(scan)
    def scan_folder(module_path: Any) -> Any:
        if Path(module_path) == models_dir / "__init__.py":
            # The key ``transformers/__init__.py`` cached the folder's scan under.
            module_path = models_dir
        return scan(module_path)

    scan_folder._nemo_rl_one_scan = True  # type: ignore[attr-defined]
    import_utils.create_import_structure_from_path = scan_folder  # type: ignore[assignment]
