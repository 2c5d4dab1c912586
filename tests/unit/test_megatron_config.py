"""The ``policy.megatron_cfg`` schema: NeMo RL's keys load, unbuilt behaviour is refused, no-effect keys are listed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from nemo_rl.config.megatron import NO_EFFECT_KEYS, MegatronConfig, no_effect_settings
from nemo_rl.config.policy import PolicyConfig

# The megatron_cfg block of NeMo RL's examples/configs/grpo_math_1B_megatron.yaml (interpolations resolved).
NEMO_RL_1B_MEGATRON: dict[str, Any] = {
    "enabled": True,
    "force_reconvert_from_hf": False,
    "empty_unused_memory_level": 1,
    "activation_checkpointing": False,
    "cuda_graph_impl": "none",
    "cuda_graph_modules": [],
    "cuda_graph_warmup_steps": 3,
    "fine_grained_activation_offloading": False,
    "offload_modules": None,
    "recompute_granularity": "full",
    "recompute_modules": None,
    "tensor_model_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None,
    "context_parallel_size": 1,
    "pipeline_dtype": "bfloat16",
    "sequence_parallel": False,
    "freeze_moe_router": True,
    "moe_router_dtype": "fp64",
    "moe_router_load_balancing_type": "none",
    "moe_router_bias_update_rate": 0.0,
    "moe_permute_fusion": True,
    "moe_enable_deepep": False,
    "moe_token_dispatcher_type": "alltoall",
    "moe_shared_expert_overlap": False,
    "use_gloo_process_groups": False,
    "apply_rope_fusion": True,
    "peft": {
        "enabled": False,
        "target_modules": [],
        "exclude_modules": [],
        "dim": 8,
        "alpha": 32,
        "dropout": 0.0,
        "dropout_position": "post",
        "lora_A_init_method": "xavier",
        "lora_B_init_method": "zero",
        "a2a_experimental": False,
        "lora_dtype": None,
    },
    "optimizer": {
        "optimizer": "adam",
        "lr": 5.0e-6,
        "min_lr": 5.0e-7,
        "weight_decay": 0.01,
        "bf16": True,
        "fp16": False,
        "params_dtype": "float32",
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "sgd_momentum": 0.9,
        "use_distributed_optimizer": True,
        "use_precision_aware_optimizer": True,
        "clip_grad": 1.0,
    },
    "scheduler": {
        "start_weight_decay": 0.01,
        "end_weight_decay": 0.01,
        "weight_decay_incr_style": "constant",
        "lr_decay_style": "constant",
        "lr_decay_iters": 1000,
        "lr_warmup_iters": 13,
        "lr_warmup_init": 5.0e-7,
    },
    "distributed_data_parallel_config": {
        "grad_reduce_in_fp32": False,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
        "use_custom_fsdp": False,
        "data_parallel_sharding_strategy": "optim_grads_params",
    },
}


def megatron_policy(megatron: dict[str, Any], **policy: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {"model_name": "m", "optimizer": None, "dtensor_cfg": {"enabled": False}, "megatron_cfg": megatron}
        | policy
    )


def test_nemo_rl_1b_megatron_block_loads_and_reports_its_no_effect_keys() -> None:
    cfg = megatron_policy(NEMO_RL_1B_MEGATRON, precision="bfloat16", max_grad_norm=1.0).megatron_cfg
    assert cfg.optimizer.use_distributed_optimizer
    reported = " ".join(no_effect_settings(cfg))
    for key in ("apply_rope_fusion=True", "overlap_grad_reduce=True", "use_precision_aware_optimizer=True"):
        assert key in reported
    assert "tensor_model_parallel_size" not in reported  # built keys are never reported


@pytest.mark.parametrize(
    ("override", "key"),
    [
        pytest.param(
            {"context_parallel_size": 2},
            "context_parallel_size",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("transformer_engine") is not None,
                reason="Megatron's context parallelism is built where Transformer Engine is installed",
            ),
        ),
        ({"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2}, "expert_model_parallel_size"),
        ({"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, "expert_model_parallel_size"),
        ({"moe_token_dispatcher_type": "flex"}, "moe_token_dispatcher_type"),
        ({"moe_router_load_balancing_type": "seq_aux_loss"}, "router_aux_loss_coef"),
        ({"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size"),
        ({"fp8_cfg": {"enabled": True}}, "fp8_cfg.enabled"),
        ({"mtp_num_layers": 1}, "mtp_num_layers"),
        ({"distributed_data_parallel_config": {"use_custom_fsdp": True}}, "use_custom_fsdp"),
        ({"model_overrides": {"hidden_dropout": 0.1}}, "model_overrides"),
        ({"transformer_impl": "inference_optimized"}, "transformer_impl"),
        ({"freeze_config": {"freeze_language_model": True}}, "freeze_language_model"),
        ({"sequence_parallel": True}, "sequence_parallel"),
        ({"scheduler": {"lr_decay_style": "cosine"}}, "lr_decay_iters"),
    ],
)
def test_unbuilt_behaviour_is_refused_naming_the_key(override: dict[str, Any], key: str) -> None:
    with pytest.raises(ValidationError) as err:
        megatron_policy({"enabled": True, **override})
    message = str(err.value)
    assert key in message and ("set" in message or "needs" in message)


def test_disabled_section_is_not_checked() -> None:
    cfg = PolicyConfig.model_validate(
        {"model_name": "m", "megatron_cfg": {"enabled": False, "context_parallel_size": 8}}
    )
    assert cfg.dtensor_cfg.enabled


@pytest.mark.parametrize(
    ("megatron", "policy", "match"),
    [
        ({"optimizer": {"bf16": False}}, {"precision": "bfloat16"}, "optimizer.bf16"),
        ({"optimizer": {"bf16": True, "clip_grad": 1.0}}, {"precision": "float32"}, "optimizer.bf16"),
        ({"optimizer": {"clip_grad": 0.5}}, {"max_grad_norm": 1.0}, "clip_grad"),
        ({"optimizer": {"clip_grad": 1.0}}, {"max_grad_norm": None}, "clip_grad"),
        ({"pipeline_dtype": "bfloat16"}, {"precision": "float32"}, "pipeline_dtype"),
    ],
)
def test_cross_section_mismatches_are_refused(
    megatron: dict[str, Any], policy: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValidationError, match=match):
        megatron_policy({"enabled": True, **megatron}, **policy)


def test_value_models_are_built_and_reward_models_refused() -> None:
    """PPO's critic (regression) runs on Megatron; Bradley-Terry reward models and a LoRA critic do not."""
    value = {"enabled": True, "reward_model_type": "regression"}
    assert megatron_policy({"enabled": True}, reward_model_cfg=value).reward_model_cfg.enabled
    with pytest.raises(ValidationError, match=r"reward_model_cfg\.enabled=true needs the DTensor backend"):
        megatron_policy({"enabled": True}, reward_model_cfg={"enabled": True})
    with pytest.raises(ValidationError, match="scalar head untrained"):
        megatron_policy({"enabled": True, "peft": {"enabled": True}}, reward_model_cfg=value)


def test_dtensor_backend_needs_its_optimizer() -> None:
    with pytest.raises(ValidationError, match=r"policy.optimizer is null"):
        PolicyConfig.model_validate({"model_name": "m", "optimizer": None})


def _documented_no_effect(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted keys whose docstring says they are accepted with no effect."""
    found: set[str] = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found |= _documented_no_effect(annotation, f"{prefix}{name}.")
        elif (field.description or "").startswith("Accepted, no effect here"):
            found.add(prefix + name)
    return found


def test_no_effect_list_is_the_single_source() -> None:
    # Every listed key exists, and every field documented as having no effect is listed (and reported).
    default = MegatronConfig()
    for key in NO_EFFECT_KEYS:
        value: Any = default
        for part in key.split("."):
            value = getattr(value, part)
    assert _documented_no_effect(MegatronConfig) <= set(NO_EFFECT_KEYS)
    assert no_effect_settings(default) == []


def test_lora_is_built_with_nemo_rl_keys() -> None:
    peft = {
        "enabled": True,
        "target_modules": ["linear_qkv", "*.layers.0.*.linear_fc1"],
        "lora_dtype": "bfloat16",
    }
    cfg = megatron_policy({"enabled": True, "peft": peft, "optimizer": {"bf16": True}}, precision="bfloat16")
    lora = cfg.megatron_cfg.peft.lora_config(["model.layers.0.self_attn.q_proj"])
    assert (lora.dim, lora.alpha, lora.match_all_linear) == (8, 32, False)


@pytest.mark.parametrize(
    ("peft", "match"),
    [
        ({"target_modules": ["q_proj"]}, r"'q_proj' names no Megatron linear layer"),
        ({"target_modules": ["linear_qkv"], "exclude_modules": ["linear_fc2"]}, r"exclude_modules needs"),
        ({"lora_A_init_method": "normal"}, r"lora_A_init_method='normal'"),
        ({"lora_B_init_method": "xavier"}, r"lora_B_init_method='xavier'"),
        ({"a2a_experimental": True}, r"a2a_experimental"),
        ({"lora_dtype": "bfloat16"}, r"lora_dtype='bfloat16' differs from policy.precision='float32'"),
    ],
)
def test_lora_settings_not_built_are_refused_in_one_line(peft: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        megatron_policy({"enabled": True, "peft": {"enabled": True, **peft}})


ASSETS = Path(__file__).resolve().parents[2] / "examples" / "assets"


@pytest.mark.parametrize(
    ("model", "megatron", "match"),
    [
        (
            "tiny_qwen3_moe_init",
            {"expert_model_parallel_size": 3},
            r"expert_model_parallel_size=3 does not divide",
        ),
        (
            "tiny_qwen3_moe_init",
            {"moe_router_topk": 4},
            r"moe_router_topk=4 differs .* num_experts_per_tok=2",
        ),
        ("tiny_qwen3_moe_init", {"pipeline_model_parallel_size": 2}, r"TP=1 and PP=1"),
        ("tiny_qwen3_moe_init", {"tensor_model_parallel_size": 2}, r"TP=1 and PP=1"),
        ("tiny_qwen3_moe_init", {"peft": {"enabled": True}}, r"peft.enabled=true: LoRA .* dense models only"),
        ("tiny_qwen2_init", {"expert_model_parallel_size": 2}, r"the model is dense"),
    ],
)
def test_moe_keys_are_checked_against_a_local_checkpoint(
    model: str, megatron: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValidationError, match=match):
        PolicyConfig.model_validate(
            {
                "model_name": str(ASSETS / model),
                "optimizer": None,
                "dtensor_cfg": {"enabled": False},
                "megatron_cfg": {"enabled": True, **megatron},
            }
        )


def test_expert_parallelism_is_built_for_a_moe_checkpoint() -> None:
    cfg = PolicyConfig.model_validate(
        {
            "model_name": str(ASSETS / "tiny_qwen3_moe_init"),
            "optimizer": None,
            "dtensor_cfg": {"enabled": False},
            "megatron_cfg": {
                "enabled": True,
                "expert_model_parallel_size": 4,
                "moe_router_topk": 2,
                "moe_token_dispatcher_type": "allgather",
                "moe_router_dtype": "fp64",
                "freeze_moe_router": True,
            },
        }
    ).megatron_cfg
    assert cfg.expert_model_parallel_size == 4
    assert no_effect_settings(cfg) == []


def test_only_one_load_balancing_loss_is_trained() -> None:
    megatron = {"enabled": True, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}
    policy = {
        "model_name": str(ASSETS / "tiny_qwen3_moe_init"),
        "optimizer": None,
        "dtensor_cfg": {"enabled": False},
        "megatron_cfg": megatron,
    }
    assert PolicyConfig.model_validate(policy).megatron_cfg.moe_aux_loss_coeff == 0.01
    with pytest.raises(ValidationError, match=r"would train two load-balancing losses"):
        PolicyConfig.model_validate(policy | {"hf_config_overrides": {"output_router_logits": True}})
