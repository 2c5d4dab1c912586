"""Errors raised by refit."""

from __future__ import annotations


class RefitError(RuntimeError):
    """A refit failed: a worker died or timed out, or the weights that arrived do not match the manifest."""


class RefitIntegrityError(RefitError):
    """The weights that arrived do not match what the receiver expects (corrupt, missing or unexpected)."""
