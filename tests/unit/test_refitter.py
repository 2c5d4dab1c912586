"""The one refit path: ``Refitter`` checks both ends' manifests at setup, builds the transport from the workers'
nodes (none for engines hosted in the policy), picks each refit's scope and offloads the policy around it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.weight_sync import refitter as refitter_module
from nemo_rl.weight_sync.errors import RefitIntegrityError
from nemo_rl.weight_sync.manifest import SpecLike
from nemo_rl.weight_sync.refitter import Refitter
from nemo_rl.weight_sync.scope import RefitScope

FULL = {"w": ((4, 2), "float32"), "w.lora_A": ((1, 2), "float32")}
ADAPTERS = {"w.lora_A": ((1, 2), "float32")}


class _Actor:
    """Stands in for a Ray actor handle: ``worker_identities`` reads its actor id."""

    def __init__(self, name: str) -> None:
        self._actor_id = bytes(name, "ascii")


class FakePolicy:
    def __init__(self, log: list[str], *, adapter_refits: bool, manifest: Mapping[str, SpecLike] = FULL):
        self.log = log
        self._adapter_refits = adapter_refits
        self._manifest = manifest
        self.workers: Sequence[Any] = [_Actor("p0"), _Actor("p1")]
        self.worker_node_ids = ["n0", "n1"]

    def refit_streams(self) -> list[int]:
        return [0, 1]

    def adapter_refits(self) -> bool:
        return self._adapter_refits

    def weights_manifest(self, dtype: torch.dtype, scope: RefitScope = "full") -> Mapping[str, SpecLike]:
        self.log.append(f"policy.manifest:{scope}:{dtype}")
        return self._manifest if scope == "full" else ADAPTERS

    def offload_before_refit(self) -> None:
        self.log.append("policy.offload_before_refit")

    def offload_after_refit(self) -> None:
        self.log.append("policy.offload_after_refit")


class FakeGeneration:
    def __init__(self, log: list[str], *, hosted_in_policy: bool, fail: bool = False) -> None:
        self.log = log
        self.hosted_in_policy = hosted_in_policy
        self.fail = fail
        self.workers: Sequence[Any] = [_Actor("g0")]
        self.worker_node_ids = ["n2"]

    def refit_in_process(self, scope: RefitScope) -> dict[str, float]:
        self.log.append(f"generation.refit_in_process:{scope}")
        if self.fail:
            raise RuntimeError("engine died")
        return {"refit/bytes": 8.0}

    def expected_weights_manifest(self, scope: RefitScope = "full") -> Mapping[str, SpecLike]:
        return FULL if scope == "full" else ADAPTERS

    def set_refill(self, refill: Any) -> None:
        self.log.append("generation.set_refill")

    def replace_lost_workers(self) -> bool:
        return False  # never loses a worker (tests/unit/test_refitter_healing.py does)


def policy_cfg(guard: bool = True) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {"model_name": "unused", "refit": {"timeout_s": 7.0, "guard": {"checksums": guard}}}
    )


def test_in_policy_engines_refit_in_process_between_the_offloads_with_no_transport() -> None:
    log: list[str] = []
    refitter = Refitter.create(
        policy_cfg(), FakePolicy(log, adapter_refits=True), FakeGeneration(log, hosted_in_policy=True)
    )
    assert refitter.transport is None
    assert log == ["policy.manifest:full:torch.float32", "policy.manifest:adapters:torch.float32"]
    log.clear()
    assert refitter.stale
    assert refitter.refit_if_stale() == {"refit/bytes": 8.0, "refit/adapters_only": 0.0}
    assert log == [
        "policy.offload_before_refit",
        "generation.refit_in_process:full",
        "policy.offload_after_refit",
    ]
    assert not refitter.stale and refitter.refit_if_stale() == {}
    refitter.mark_stale()
    assert refitter.refit_if_stale()["refit/adapters_only"] == 1.0
    assert log[-2] == "generation.refit_in_process:adapters"


def test_separate_workers_get_a_transport_placed_by_their_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    transport: Any = type("T", (), {"shutdown": lambda self: calls.append("shutdown")})()

    def create_transport(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return transport

    def fake_refit(
        policy_workers: Any, generation_workers: Any, t: Any, **kwargs: Any
    ) -> tuple[dict[str, float], list[Any]]:
        calls.append(("refit", t is transport, kwargs))
        return {"refit/bytes": 1.0}, []

    monkeypatch.setattr(refitter_module, "create_refit_transport", create_transport)
    monkeypatch.setattr(refitter_module, "refit_with_stats", fake_refit)
    log: list[str] = []
    cfg = policy_cfg(guard=False)  # the guard's own tests are in test_refit_guard.py
    refitter = Refitter.create(
        cfg, FakePolicy(log, adapter_refits=False), FakeGeneration(log, hosted_in_policy=False)
    )
    (args, kwargs) = calls[0]
    assert args == (cfg, cfg.refit)
    assert kwargs == {
        "policy_node_ids": ["n0", "n1"],
        "generation_node_ids": ["n2"],
        "policy_streams": [0, 1],
    }
    assert refitter.refit() == {"refit/bytes": 1.0, "refit/adapters_only": 0.0}
    assert calls[1] == ("refit", True, {"timeout_s": 7.0, "scope": "full"})
    # Without adapter refits every refit is full.
    assert refitter.refit()["refit/adapters_only"] == 0.0
    refitter.shutdown()
    refitter.shutdown()
    assert calls.count("shutdown") == 1


def test_a_failed_refit_keeps_the_run_stale_and_makes_the_next_one_full() -> None:
    log: list[str] = []
    generation = FakeGeneration(log, hosted_in_policy=True)
    refitter = Refitter.create(policy_cfg(), FakePolicy(log, adapter_refits=True), generation)
    refitter.refit()
    generation.fail = True
    with pytest.raises(RuntimeError, match="engine died"):
        refitter.refit()
    assert refitter.stale
    generation.fail = False
    assert refitter.refit()["refit/adapters_only"] == 0.0


def test_a_manifest_mismatch_fails_at_setup_naming_the_weights() -> None:
    log: list[str] = []
    wrong = {"w": ((4, 3), "float32"), "extra": ((1,), "float32")}
    with pytest.raises(RefitIntegrityError, match=r"missing: w\.lora_A.*unexpected: extra.*w \(expected"):
        Refitter.create(
            policy_cfg(),
            FakePolicy(log, adapter_refits=False, manifest=wrong),
            FakeGeneration(log, hosted_in_policy=True),
        )
