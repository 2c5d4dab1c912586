"""Which Megatron layers ``policy.megatron_cfg.peft`` adapts, and the Hugging Face layers their adapters are."""

from __future__ import annotations

import pytest

from nemo_rl.config.lora import MegatronPeftConfig

pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")

from nemo_rl.models.megatron.lora import hf_modules, select_linears

ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def peft(**keys: object) -> MegatronPeftConfig:
    return MegatronPeftConfig.model_validate({"enabled": True, **keys})


def test_empty_targets_adapt_every_linear_layer_minus_exclusions() -> None:
    assert select_linears(peft(), 2) == {0: ALL, 1: ALL}
    assert select_linears(peft(exclude_modules=["*.layers.1.*", "linear_fc2"]), 2) == {0: ALL[:3]}


def test_targets_by_name_or_glob_over_global_layer_paths() -> None:
    selected = select_linears(peft(target_modules=["linear_proj", "*.layers.2.*.linear_qkv"]), 3)
    assert selected == {0: ["linear_proj"], 1: ["linear_proj"], 2: ["linear_qkv", "linear_proj"]}
    assert hf_modules({2: ["linear_qkv"], 0: ["linear_fc1"]}) == [
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.2.self_attn.q_proj",
        "model.layers.2.self_attn.k_proj",
        "model.layers.2.self_attn.v_proj",
    ]


def test_a_pattern_matching_no_layer_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'\*.layers.5.\*' matches no layer"):
        select_linears(peft(target_modules=["*.layers.5.*"]), 2)
    with pytest.raises(ValueError, match="excludes every linear layer"):
        select_linears(peft(exclude_modules=["linear_*"]), 2)
