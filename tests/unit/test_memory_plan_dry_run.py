"""The memory plan ``--dry-run`` prints (``nemo_rl.config.memory_plan``): the recipes' verdicts, LoRA, unknown
models. ``tests/distributed/test_memory_plan.py`` checks its terms against what the workers allocate."""

from __future__ import annotations

import math
import runpy
import sys
from pathlib import Path

import pytest

from nemo_rl.config.cli import USER_ERROR_EXIT_CODE
from nemo_rl.config.memory_plan import device_memory_bytes
from nemo_rl.config.model_arch import KNOWN_ARCHS

ROOT = Path(__file__).parents[2]
GRPO = ROOT / "examples/run_grpo_math.py"
GRPO_1B = str(ROOT / "examples/configs/grpo_math_1B.yaml")


def dry_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *overrides: str
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", [str(GRPO), "--config", GRPO_1B, "--dry-run", *overrides])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(GRPO), run_name="__main__")
    out = capsys.readouterr()
    code = exit_info.value.code
    assert isinstance(code, int)
    return code, out.out, out.err


def test_grpo_1b_does_not_fit_8_gib_and_names_its_largest_term(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dry_run(monkeypatch, capsys, "cluster.device_memory_gb=8")
    assert code == USER_ERROR_EXIT_CODE
    assert "DOES NOT FIT" in out
    [line] = err.strip().splitlines()
    assert "policy training phase" in line and "largest term is optimizer state" in line
    assert "lora_cfg.enabled=true" in line and "cpu_offload=true" in line


def test_grpo_1b_fits_80_gib(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = dry_run(monkeypatch, capsys, "cluster.device_memory_gb=80")
    assert code == 0
    assert "memory plan (architecture from nemo_rl.config.model_arch.KNOWN_ARCHS" in out
    assert "peak: generation, 48.00 GiB of 80.00 GiB (cluster.device_memory_gb=80): fits" in out
    for worker in ("policy (training)", "reference:", "generation:", "refit (policy side)"):
        assert f"\n  {worker}" in out


def test_lora_trains_no_base_state_and_keeps_no_reference_copy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = dry_run(
        monkeypatch, capsys, "cluster.device_memory_gb=24", "policy.dtensor_cfg.lora_cfg.enabled=true"
    )
    assert code == 0, out
    assert "gradients (float32)                                         0.00 GiB" in out
    assert "LoRA adapters + gradients + optimizer" in out
    assert "reference: the base model itself with the adapters switched off: no copy" in out


def test_an_unknown_model_skips_the_plan_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = dry_run(monkeypatch, capsys, "policy.model_name=someone/unknown-model")
    assert code == 0
    assert "no memory plan: the architecture of policy.model_name is unknown" in out
    assert "memory plan (" not in out


def test_known_architectures_have_their_published_parameter_counts() -> None:
    assert KNOWN_ARCHS["Qwen/Qwen2.5-1.5B"].num_parameters == 1_543_714_304
    assert KNOWN_ARCHS["meta-llama/Llama-3.2-1B"].num_parameters == 1_235_814_400
    assert KNOWN_ARCHS["Qwen/Qwen2.5-7B-Instruct"].num_parameters == 7_615_616_512


def test_device_memory_comes_from_the_key_or_is_unknown_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert device_memory_bytes(80.0) == (80 * 2**30, "cluster.device_memory_gb=80")
    monkeypatch.setattr("shutil.which", lambda _: None)
    assert device_memory_bytes(None)[0] is None


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe"])
def test_one_architecture_record_from_config_json_and_from_transformers(family: str) -> None:
    # The memory plan reads a config.json dict, the decoders a transformers config: the same record.
    from transformers import AutoConfig

    from nemo_rl.config.model_arch import ModelArch
    from nemo_rl.models.hf_decoder import decoder_arch

    extra: dict[str, object] = {
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
    }
    if family == "glm4_moe":
        extra = {
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "n_group": 2,
            "topk_group": 1,
            "moe_intermediate_size": 16,
            "first_k_dense_replace": 1,
            "partial_rotary_factor": 1.0,
            "attention_bias": True,
        }
    config = AutoConfig.for_model(
        family,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
        **(extra if family.endswith("_moe") else {}),
    )
    from_json = ModelArch.from_hf_config(config.to_dict())
    assert from_json == decoder_arch(config)
    assert (from_json.moe is not None) == family.endswith("_moe")
    assert from_json.qkv_bias == (family in ("qwen2", "glm4_moe"))
    assert from_json.qk_norm == family.startswith("qwen3")


def test_parameter_counts_include_every_bias() -> None:
    # Llama with attention_bias and mlp_bias: q/k/v/o and gate/up/down biases, as transformers builds them.
    from transformers import LlamaConfig, LlamaForCausalLM

    from nemo_rl.config.memory import dtensor_parameters
    from nemo_rl.config.model_arch import ModelArch

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
    )
    expected = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    arch = ModelArch.from_hf_config(config.to_dict())
    assert arch.num_parameters == expected
    assert sum(p.count * math.prod(p.shape) for p in dtensor_parameters(arch)) == expected


def test_the_critic_shares_the_policy_devices_or_has_its_own() -> None:
    from nemo_rl.config.loader import load_and_validate
    from nemo_rl.config.master import PPOMasterConfig
    from nemo_rl.config.memory_plan import plan_config

    recipe = ROOT / "examples/configs/ppo_math_1B.yaml"
    shared = plan_config(load_and_validate(recipe, PPOMasterConfig, ["cluster.gpus_per_node=8"]))
    own = plan_config(
        load_and_validate(
            recipe,
            PPOMasterConfig,
            [
                "cluster.gpus_per_node=8",
                "ppo.value_colocated.enabled=false",
                "ppo.value_colocated.resources.gpus_per_node=4",
            ],
        )
    )
    assert not isinstance(shared, str) and not isinstance(own, str)
    critic = {w.kind: w for w in shared.workers}["value (critic training)"]
    own_critic = {w.kind: w for w in own.workers}["value (critic training)"]
    assert "critic training" in shared.phases and "critic training (critic devices)" in own.phases
    assert critic.note == "offloaded while the policy trains" and own_critic.note == "on slots of its own"
    # Four slots instead of eight: each holds twice the critic's FSDP shard of weights.
    shard = {t.name: t.nbytes for t in critic.terms}["weights (float32 master)"]
    own_shard = {t.name: t.nbytes for t in own_critic.terms}["weights (float32 master)"]
    assert own_shard == pytest.approx(2 * shard, rel=1e-3)
