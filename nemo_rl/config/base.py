"""Base class for every config section.

Each section of a recipe (``policy``, ``grpo``, ``logger``...) is a :class:`ConfigModel`. Field defaults live
here, in the schema, and nowhere else: library code reads ``cfg.field`` and never ``cfg.get(key, default)``.
Attribute docstrings become the field descriptions, so every field is documented where it is declared.

Sections can also be *read* like the dicts NeMo RL scripts pass around: ``cfg["policy"]["model_name"]``,
``"policy" in cfg``, ``cfg.get("checkpointing")``, ``cfg.keys()`` / ``cfg.items()``. Writing goes through
attributes (``cfg.policy.model_name = ...``), which are validated.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class ConfigModel(BaseModel):
    """A strict, documented config section: unknown keys are errors, field docstrings are descriptions."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        validate_assignment=True,
    )

    CONDITIONAL_NO_EFFECT: ClassVar[dict[str, str]] = {}
    """Keys below this section that do nothing in some combinations of the others: ``{key: where they work}``.
    :meth:`settings_without_effect` says when; ``nemo_rl.config.no_effect`` lists both with the keys that
    never have an effect."""

    def settings_without_effect(self) -> dict[str, str]:
        """``{key: why}`` of keys of :data:`CONDITIONAL_NO_EFFECT` this section sets but the rest of it leaves
        without effect (reported at start and by ``--dry-run``, never silently ignored)."""
        return {}

    def keys(self) -> list[str]:
        """The section's keys: its fields in declaration order, then any extra keys it allows."""
        return [*type(self).model_fields, *(self.model_extra or {})]

    def items(self) -> list[tuple[str, Any]]:
        """``(key, value)`` pairs, as :meth:`keys` orders them."""
        return [(key, self[key]) for key in self.keys()]

    def values(self) -> list[Any]:
        """The values, as :meth:`keys` orders them."""
        return [self[key] for key in self.keys()]

    def __getitem__(self, key: str) -> Any:
        """``cfg["key"]``: the value of field ``key``; a ``KeyError`` naming the closest keys otherwise."""
        if isinstance(key, str):
            if key in type(self).model_fields:
                return getattr(self, key)
            extra = self.model_extra or {}
            if key in extra:
                return extra[key]
        keys = self.keys()
        close = difflib.get_close_matches(str(key), keys, n=3)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise KeyError(f"{type(self).__name__} has no key {key!r}; {hint}its keys: {', '.join(keys)}")

    def __contains__(self, key: object) -> bool:
        """``"key" in cfg``: whether the section has that key (a field, or an allowed extra key)."""
        return isinstance(key, str) and (key in type(self).model_fields or key in (self.model_extra or {}))

    def get(self, key: str, default: Any = None) -> Any:
        """``cfg.get("key")``: the value of ``key``, or ``default`` when the section has no such key."""
        if key in self:
            return self[key]
        return default
