"""Refit scopes (:mod:`nemo_rl.weight_sync.scope`) and the generation side of LoRA refits
(:mod:`nemo_rl.models.generation.lora`): the driver's choice, the manifests of each scope, the exact merge."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.config.lora import LoraConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.generation.lora import AdapterLayout, MergedAdapters, base_manifest_for
from nemo_rl.models.lora import apply_lora, merge_lora
from nemo_rl.weight_sync.errors import RefitIntegrityError
from nemo_rl.weight_sync.refit import refit
from nemo_rl.weight_sync.scope import RefitScopePlanner


def test_planner_sends_adapters_only_to_the_workers_that_got_the_base() -> None:
    planner = RefitScopePlanner(adapters_only=True)
    assert planner.scope_for(["a", "b"]) == "full"
    planner.succeeded(["a", "b"], "full")
    assert planner.scope_for(["a", "b"]) == "adapters"
    planner.succeeded(["a", "b"], "adapters")
    # A restarted or replaced worker is a fresh engine: full again.
    assert planner.scope_for(["a", "c"]) == "full"
    assert planner.scope_for(["a"]) == "full"
    planner.failed()
    assert planner.scope_for(["a", "b"]) == "full"
    with pytest.raises(AssertionError):
        planner.succeeded(["a", "b"], "adapters")


def test_planner_without_lora_always_sends_everything() -> None:
    planner = RefitScopePlanner(adapters_only=False)
    planner.succeeded(["a"], "full")
    assert planner.scope_for(["a"]) == "full"


def test_refit_rejects_an_unknown_scope() -> None:
    class Transport:
        num_senders = num_receivers = 1

    with pytest.raises(ValueError, match="unknown refit scope"):
        refit([object()], [object()], Transport(), timeout_s=1.0, scope="merged")  # type: ignore[arg-type]


def _lora_policy_cfg(model_dir: Path, **lora: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "train_global_batch_size": 2,
            "train_micro_batch_size": 1,
            "max_total_sequence_length": 32,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
            "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 4, "alpha": 8, **lora}},
            "generation": {"embedded_cfg": {"precision": "float32"}},
        }
    )


@pytest.mark.parametrize("lora", [{}, {"match_all_linear": False, "target_modules": ["q_proj", "down_proj"]}])
def test_engine_manifests_match_the_lora_policy(tiny_assets: tuple[Path, Any], lora: dict[str, Any]) -> None:
    """The engine picks the policy's adapted layers from its own weight names, so both ends' manifests of
    each scope agree (the receiver's integrity checks depend on it)."""
    from transformers import AutoModelForCausalLM

    model_dir, _ = tiny_assets
    cfg = _lora_policy_cfg(model_dir, **lora)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    base = {name: (tuple(p.shape), "float32") for name, p in hf.named_parameters()}
    apply_lora(hf, LoraConfig.model_validate(cfg.dtensor_cfg.lora_cfg.model_dump()))
    policy_full = {name: (tuple(p.shape), "float32") for name, p in hf.named_parameters()}
    layout = AdapterLayout.from_policy_config(cfg, base, "float32")
    assert layout is not None and layout.scale == 2.0
    assert layout.manifest(base, "full") == policy_full
    adapters = {name: spec for name, spec in policy_full.items() if ".lora_" in name}
    assert layout.manifest(base, "adapters") == adapters
    assert layout.adapter_nbytes() == sum(4 * a * b for (a, b), _ in adapters.values())
    with pytest.raises(ValueError, match="without LoRA"):
        base_manifest_for(None, base, "adapters")


def _layout() -> AdapterLayout:
    return AdapterLayout(scale=0.5, dim=2, targets={"l.q": (3, 4), "l.v": (5, 4)}, dtype_name="float32")


def _stream(
    base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    return [("l.norm.weight", torch.ones(4)), *base.items(), *adapters.items()]


def _adapters(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "l.q.lora_A": torch.randn(2, 4, generator=g),
        "l.q.lora_B": torch.randn(3, 2, generator=g),
        "l.v.lora_A": torch.randn(2, 4, generator=g),
        "l.v.lora_B": torch.randn(5, 2, generator=g),
    }


def test_merge_is_exact_from_the_kept_base_on_every_refit() -> None:
    merger = MergedAdapters(_layout())
    base = {"l.q.weight": torch.randn(3, 4), "l.v.weight": torch.randn(5, 4)}
    with pytest.raises(RefitIntegrityError, match="holds no base weights"):
        list(merger.merge(_stream({}, _adapters(0)), "adapters"))
    out = dict(merger.merge(_stream(base, _adapters(0)), "full"))
    assert set(out) == {"l.norm.weight", "l.q.weight", "l.v.weight"} and merger.holds_base
    for seed in (1, 2):  # later refits start again from the base: no drift
        adapters = _adapters(seed)
        out = dict(merger.merge(adapters.items(), "adapters"))
        for module in ("l.q", "l.v"):
            expected = merge_lora(
                base[f"{module}.weight"], adapters[f"{module}.lora_A"], adapters[f"{module}.lora_B"], 0.5
            )
            assert torch.equal(out[f"{module}.weight"], expected)
    with pytest.raises(RefitIntegrityError, match="did not arrive"):
        list(merger.merge([("l.q.lora_A", torch.zeros(2, 4))], "adapters"))
    merger.forget_base()
    assert not merger.holds_base
