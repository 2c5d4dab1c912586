"""The Refitter's side of a generation pool that heals itself: a refit that fails because a generation worker was
lost is made again once the pool replaced it, over a transport rebuilt for the new workers; a failure without a
lost worker is raised as it is; ``refill`` sends every weight to the replaced workers alone, over a transport of
their own. (The pool's side is tests/distributed/test_generation_healing.py.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from test_refit_guard import HF, Policy, _Actor

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.weight_sync import refitter as refitter_module
from nemo_rl.weight_sync.errors import RefitError
from nemo_rl.weight_sync.interfaces import TransferStats
from nemo_rl.weight_sync.refitter import Refitter


class Pool:
    """Two generation workers; ``lose`` makes the next refit fail as a dead receiver's would."""

    hosted_in_policy = False

    def __init__(self) -> None:
        self.workers: list[Any] = [_Actor("g0"), _Actor("g1")]
        self.worker_node_ids = ["n0", "n0"]
        self.lost: int | None = None
        self.refill: Any = None

    def expected_weights_manifest(self, scope: str = "full") -> dict[str, Any]:
        return {name: (tuple(t.shape), "float32") for name, t in HF.items()}

    def held_weight_checksums(self) -> list[Any]:
        return []

    def set_refill(self, refill: Any) -> None:
        self.refill = refill

    def replace_lost_workers(self) -> bool:
        if self.lost is None:
            return False
        rank, self.lost = self.lost, None
        self.workers[rank] = _Actor(f"g{rank}-new")
        self.refill([rank])
        return True


class Transport:
    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.closed = False

    def shutdown(self) -> None:
        self.closed = True


def _refitter(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> tuple[Refitter, list[tuple[Any, ...]], list[Transport]]:
    refits: list[tuple[Any, ...]] = []
    transports: list[Transport] = []

    def fake_refit(
        senders: Any, receivers: Sequence[Any], transport: Transport, **kwargs: Any
    ) -> tuple[dict[str, float], list[TransferStats]]:
        if pool.lost is not None and pool.workers[pool.lost] in receivers:
            raise RefitError(f"generation worker {pool.lost} died during refit r0-test")
        refits.append((tuple(r._actor_id for r in receivers), transport, kwargs["scope"]))
        return {"refit/bytes": 1.0}, [TransferStats("receiver", 0, 0, 1, 0.0) for _ in receivers]

    def new_transport(*args: Any, generation_node_ids: list[str], **kwargs: Any) -> Transport:
        transports.append(Transport(list(generation_node_ids)))
        return transports[-1]

    monkeypatch.setattr(refitter_module, "create_refit_transport", new_transport)
    monkeypatch.setattr(refitter_module, "refit_with_stats", fake_refit)
    # The guard's checksums are tests/unit/test_refit_guard.py's subject.
    cfg = PolicyConfig.model_validate({"model_name": "unused", "refit": {"guard": {"checksums": False}}})
    return Refitter.create(cfg, Policy(), pool), refits, transports  # type: ignore[arg-type]


def test_a_refit_that_lost_a_worker_is_made_again_to_its_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool()
    refitter, refits, transports = _refitter(pool, monkeypatch)
    assert pool.refill == refitter.refill  # the pool refills its replacements through the refitter
    refitter.refit()
    pool.lost = 1
    refitter.mark_stale()
    refitter.refit()
    # The refill sent worker 1's replacement every weight over a transport of its own, closed after it; then
    # the whole refit ran again over a new transport for the new workers, full.
    _, refill, again = refits
    assert refill == ((b"g1-new",), transports[1], "full") and transports[1].nodes == ["n0"]
    assert transports[1].closed
    assert again == ((b"g0", b"g1-new"), transports[2], "full") and transports[2].nodes == ["n0", "n0"]
    assert transports[0].closed and not refitter.stale


def test_a_refit_failure_without_a_lost_worker_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool()
    refitter, _, _ = _refitter(pool, monkeypatch)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RefitError("policy worker 0 died during refit r1-test")

    monkeypatch.setattr(refitter_module, "refit_with_stats", broken)
    with pytest.raises(RefitError, match="policy worker 0 died"):
        refitter.refit()
    assert refitter.stale
