"""Refit scopes: what one refit moves, decided by the driver and passed to both ends.

A policy that trains LoRA adapters changes only the adapters; its base weights stay frozen. So after the
generation workers once hold the base weights, a refit needs to move only the adapters. The driver decides,
per refit, a :data:`RefitScope`:

- ``"full"``: every weight the generation workers need (with LoRA: the base weights *and* the adapters,
  unmerged, so a receiver can keep the base and re-merge exactly on later refits);
- ``"adapters"``: only the LoRA adapter tensors (``<module>.lora_A`` / ``<module>.lora_B``).

The driver passes the same scope to every sender (``refit_send(sender, scope)``) and every receiver
(``refit_receive(receiver, scope)``); each side builds its manifest for that scope, so the receiver's
integrity checks (missing, unexpected, mis-shaped weights) hold for a partial refit exactly as for a full
one, and a sender and a receiver can never disagree on what travels without the refit failing loudly.

:class:`RefitScopePlanner` is the driver's rule: ``"full"`` for the first refit, after any failed refit and
whenever the set of generation workers changed (a worker restarted or replaced is a fresh engine that must
never be sent adapters alone); ``"adapters"`` otherwise, when the policy trains adapters.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Literal, get_args

RefitScope = Literal["full", "adapters"]
"""What a refit moves: every weight the receivers need, or the LoRA adapters only."""

REFIT_SCOPES: tuple[str, ...] = get_args(RefitScope)


def check_scope(scope: str) -> RefitScope:
    """``scope`` itself when it names a refit scope; ``ValueError`` otherwise."""
    if scope not in REFIT_SCOPES:
        raise ValueError(f"unknown refit scope {scope!r}; expected one of {REFIT_SCOPES}")
    return scope  # type: ignore[return-value]


def worker_identities(workers: Sequence[Any]) -> list[str]:
    """Stable identities of Ray actor handles (their actor ids): a restarted or replaced worker gets a new one.
    A worker in the driver's process (:mod:`nemo_rl.distributed.single_process`) is the object itself."""
    return [
        worker._actor_id.hex() if hasattr(worker, "_actor_id") else f"in-process-{id(worker):x}"
        for worker in workers
    ]


class RefitScopePlanner:
    """The driver's choice of each refit's scope (see the module docstring).

    Args:
        adapters_only: whether the policy trains LoRA adapters (its base weights never change), so refits
            after the first may move the adapters alone. False: every refit is ``"full"``.
    """

    def __init__(self, adapters_only: bool) -> None:
        self.adapters_only = adapters_only
        # Identities of the generation workers the last successful refit reached; None: none yet.
        self._holders: tuple[Hashable, ...] | None = None

    def scope_for(self, workers: Sequence[Hashable]) -> RefitScope:
        """The scope of a refit into ``workers`` (stable identities in rank order, e.g. Ray actor ids)."""
        if self.adapters_only and self._holders is not None and tuple(workers) == self._holders:
            return "adapters"
        return "full"

    def succeeded(self, workers: Sequence[Hashable], scope: RefitScope) -> None:
        """Record a completed refit of ``scope`` into ``workers``: they now hold the base weights."""
        if scope == "full":
            self._holders = tuple(workers)
        elif self._holders != tuple(workers):
            raise AssertionError("an adapters-only refit reached workers that never got the base weights")

    def failed(self) -> None:
        """Forget what the workers hold: a failed refit may have left any of them half loaded."""
        self._holders = None
