"""Base class for every config section.

Each section of a recipe (``policy``, ``grpo``, ``logger``...) is a :class:`ConfigModel`. Field defaults live
here, in the schema, and nowhere else: library code reads ``cfg.field`` and never ``cfg.get(key, default)``.
Attribute docstrings become the field descriptions, so every field is documented where it is declared.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """A strict, documented config section: unknown keys are errors, field docstrings are descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        validate_assignment=True,
    )
