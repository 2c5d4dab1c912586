"""Every YAML under examples/configs loads, inherits and validates against its algorithm's schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_rl.config.algorithms import NO_STEP_LIMIT
from nemo_rl.config.errors import ConfigError
from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.master import (
    DistillationMasterConfig,
    DPOMasterConfig,
    EvalMasterConfig,
    GRPOMasterConfig,
    PPOMasterConfig,
    RMMasterConfig,
    SFTMasterConfig,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "examples" / "configs"
ALL_CONFIGS = sorted(p for p in CONFIG_DIR.rglob("*.yaml"))


Master = (
    type[SFTMasterConfig]
    | type[GRPOMasterConfig]
    | type[DPOMasterConfig]
    | type[RMMasterConfig]
    | type[EvalMasterConfig]
    | type[DistillationMasterConfig]
    | type[PPOMasterConfig]
)


def _schema_for(path: Path) -> Master:
    name = path.name
    if path.parent.name == "evals":
        return EvalMasterConfig
    if name.startswith("distillation"):
        return DistillationMasterConfig
    if name.startswith(("grpo", "vlm_grpo")):
        return GRPOMasterConfig
    if name.startswith(("sft", "vlm_sft")):
        return SFTMasterConfig
    if name.startswith("dpo"):
        return DPOMasterConfig
    if name.startswith("rm"):
        return RMMasterConfig
    if name.startswith("ppo"):
        return PPOMasterConfig
    raise AssertionError(
        f"no schema known for {path}: name it after its algorithm (grpo*, ppo*, sft*, dpo*, rm*, distillation*)"
    )


def test_there_are_configs() -> None:
    assert {p.name for p in ALL_CONFIGS} >= {
        "sft.yaml",
        "sft_tiny_math.yaml",
        "grpo_math_1B.yaml",
        "grpo_math_tiny.yaml",
        "dpo.yaml",
        "dpo_tiny_math.yaml",
        "rm.yaml",
        "rm_tiny_math.yaml",
        "grpo_rm_1B.yaml",
        "grpo_rm_tiny.yaml",
    }


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_config_validates(path: Path) -> None:
    config = load_and_validate(path, _schema_for(path))
    model_name = (
        config.generation.model_name if isinstance(config, EvalMasterConfig) else config.policy.model_name
    )
    assert model_name


def test_public_grpo_recipe_defaults() -> None:
    config = load_and_validate(CONFIG_DIR / "grpo_math_1B.yaml", GRPOMasterConfig)
    assert config.policy.model_name == "Qwen/Qwen2.5-1.5B"
    assert config.policy.generation.backend == "vllm"
    assert config.data.dataset_name == "OpenMathInstruct-2"
    assert config.data.prompt_file == "examples/prompts/cot.txt"
    # Interpolations resolve against the final config.
    assert config.policy.generation.max_new_tokens == config.policy.max_total_sequence_length


def test_tiny_recipes_run_on_cpu_defaults() -> None:
    grpo = load_and_validate(CONFIG_DIR / "grpo_math_tiny.yaml", GRPOMasterConfig)
    sft = load_and_validate(CONFIG_DIR / "sft_tiny_math.yaml", SFTMasterConfig)
    assert grpo.policy.generation.backend == "embedded"
    assert grpo.policy.precision == sft.policy.precision == "float32"
    assert grpo.data.dataset_name == sft.data.dataset_name == "tiny_math"
    assert Path(grpo.policy.model_name).name == "tiny_math_sft"


def test_megatron_recipes() -> None:
    # NeMo RL's grpo_math_1B_megatron.yaml GPU defaults.
    gpu = load_and_validate(CONFIG_DIR / "grpo_math_1B_megatron.yaml", GRPOMasterConfig).policy
    megatron = gpu.megatron_cfg
    assert megatron.enabled and not gpu.dtensor_cfg.enabled
    assert (gpu.precision, gpu.train_global_batch_size, gpu.logprob_batch_size) == ("bfloat16", 512, 4)
    assert megatron.optimizer.use_distributed_optimizer and megatron.optimizer.bf16
    assert (megatron.optimizer.lr, megatron.optimizer.min_lr, megatron.scheduler.lr_warmup_iters) == (
        5.0e-6,
        5.0e-7,
        13,
    )
    assert megatron.empty_unused_memory_level == 1 and megatron.pipeline_dtype == "bfloat16"
    # The CPU recipes: GRPO in two pipeline stages, SFT with tensor (and sequence) parallelism.
    grpo = load_and_validate(CONFIG_DIR / "grpo_math_tiny_megatron.yaml", GRPOMasterConfig).policy
    sft = load_and_validate(CONFIG_DIR / "sft_tiny_math_megatron.yaml", SFTMasterConfig).policy
    assert grpo.megatron_cfg.pipeline_model_parallel_size == 2 and grpo.generation.backend == "embedded"
    assert sft.megatron_cfg.tensor_model_parallel_size == 2 and sft.megatron_cfg.sequence_parallel
    assert grpo.precision == sft.precision == "float32"


def test_public_preference_recipe_defaults() -> None:
    dpo = load_and_validate(CONFIG_DIR / "dpo.yaml", DPOMasterConfig)
    assert dpo.dpo.max_num_steps == 150 and dpo.dpo.reference_policy_kl_penalty == 0.05
    assert dpo.policy.train_global_batch_size == 128 and dpo.data.dataset_name == "HelpSteer3"
    # sft_average_log_probs follows preference_average_log_probs, as in NeMo RL's recipe.
    flipped = load_and_validate(
        CONFIG_DIR / "dpo.yaml", DPOMasterConfig, ["dpo.preference_average_log_probs=true"]
    )
    assert flipped.dpo.sft_average_log_probs
    rm = load_and_validate(CONFIG_DIR / "rm.yaml", RMMasterConfig)
    assert rm.policy.reward_model_cfg.enabled and rm.rm.max_num_steps == NO_STEP_LIMIT  # the recipe's -1
    assert rm.checkpointing.save_period == rm.rm.val_period == 16


def test_grpo_reward_model_recipes() -> None:
    for name in ("grpo_rm_1B.yaml", "grpo_rm_tiny.yaml"):
        config = load_and_validate(CONFIG_DIR / name, GRPOMasterConfig)
        assert config.data.env_name == "reward_model" and config.env.reward_model.enabled
    tiny = load_and_validate(CONFIG_DIR / "grpo_rm_tiny.yaml", GRPOMasterConfig)
    assert (CONFIG_DIR.parents[1] / str(tiny.env.reward_model.model_name) / "config.json").is_file()
    with pytest.raises(ConfigError, match=r"env\.reward_model\.enabled=true"):
        load_and_validate(
            CONFIG_DIR / "grpo_rm_tiny.yaml", GRPOMasterConfig, ["env.reward_model.enabled=false"]
        )


def test_reward_models_refuse_a_value_head() -> None:
    """``regression`` is PPO's value model: RM training and the reward-model environment refuse it."""

    def value_head(section: str) -> list[str]:
        return [
            f"{section}.reward_model_cfg.{key}" for key in ("enabled=true", "reward_model_type=regression")
        ]

    with pytest.raises(ConfigError, match=r"regression is PPO's value model"):
        load_and_validate(CONFIG_DIR / "rm.yaml", RMMasterConfig, value_head("policy"))
    with pytest.raises(ConfigError, match=r"is PPO's value model, which scores every token"):
        load_and_validate(CONFIG_DIR / "grpo_rm_tiny.yaml", GRPOMasterConfig, value_head("env.reward_model"))


def test_distillation_recipes() -> None:
    # NeMo RL's distillation_math.yaml values; the teacher inherits the student's section.
    public = load_and_validate(CONFIG_DIR / "distillation_math.yaml", DistillationMasterConfig)
    assert (public.policy.model_name, public.teacher.model_name) == ("Qwen/Qwen3-1.7B-Base", "Qwen/Qwen3-4B")
    assert public.teacher.tokenizer.name == "Qwen/Qwen3-4B"
    assert (
        public.policy.dtensor_cfg.tensor_parallel_size,
        public.teacher.dtensor_cfg.tensor_parallel_size,
    ) == (2, 4)
    assert public.distillation.topk_logits_k == 64 and public.distillation.num_prompts_per_step == 128
    assert (public.loss_fn.kl_type, public.loss_fn.mixed_kl_weight, public.loss_fn.zero_outside_topk) == (
        "mixed",
        0.5,
        False,
    )
    tiny = load_and_validate(CONFIG_DIR / "distillation_tiny_math.yaml", DistillationMasterConfig)
    assert tiny.policy.generation.backend == "embedded" and tiny.data.dataset_name == "tiny_math"
    assert Path(tiny.policy.model_name).name == "tiny_math_sft"
    assert (CONFIG_DIR.parents[1] / tiny.teacher.model_name / "model.safetensors").exists()
    teacher = load_and_validate(CONFIG_DIR / "sft_tiny_math_teacher.yaml", SFTMasterConfig)
    assert (
        teacher.sft.max_num_steps == 1500 and teacher.policy.model_name == "examples/assets/tiny_qwen2_init"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("teacher.generation.temperature=0.7", "teacher.generation.temperature=0.7 differs"),
        ("policy.generation.top_k=5", "policy.generation.top_k=5"),
        ("teacher.generation.top_p=0.9", "teacher.generation.top_k=None, top_p=0.9"),
        ("distillation.num_prompts_per_step=48", "48 responses per step must be a multiple"),
    ],
)
def test_distillation_config_checks(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_and_validate(CONFIG_DIR / "distillation_tiny_math.yaml", DistillationMasterConfig, [override])
