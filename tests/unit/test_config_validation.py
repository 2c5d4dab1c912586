"""Schema keys and validation messages: unknown keys with suggestions, wrong types, validator failures."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from pydantic import Field, model_validator

from nemo_rl.config import ConfigError, ConfigModel, validate_config
from nemo_rl.config.keys import (
    annotation_at,
    check_key,
    closest_keys,
    container_default,
    format_type,
    schema_keys,
    shorthand_matches,
)


class Entry(ConfigModel):
    """A scheduler class."""

    name: str
    """Class path."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Arguments."""


class Milestones(ConfigModel):
    """Scheduler hand-over steps."""

    milestones: list[int]
    """Steps."""


class Vllm(ConfigModel):
    """Sampler backend settings."""

    gpu_memory_utilization: float = Field(default=0.6, gt=0.0, le=1.0)
    """Memory fraction."""


class Generation(ConfigModel):
    """Sampling."""

    backend: Literal["embedded", "vllm"] = "embedded"
    """Backend."""

    top_k: int | None = None
    """Top-k filter."""

    vllm_cfg: Vllm | None = None
    """vLLM settings."""


class Policy(ConfigModel):
    """Policy."""

    model_name: str
    """Model."""

    train_global_batch_size: int = 8
    """Global batch."""

    train_micro_batch_size: int = 2
    """Micro-batch."""

    scheduler: list[Entry | Milestones] = Field(default_factory=list)
    """Schedulers."""

    generation: Generation = Field(default_factory=Generation)
    """Sampling."""

    @model_validator(mode="after")
    def _check(self) -> Policy:
        if self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError("train_global_batch_size must be a multiple of train_micro_batch_size")
        return self


class Env(ConfigModel):
    """An environment."""

    num_workers: int = 1
    """Workers."""


class Root(ConfigModel):
    """Master config."""

    policy: Policy
    """Policy."""

    env: dict[str, Env] = Field(default_factory=dict)
    """Environments."""

    extra: dict[str, Any] = Field(default_factory=dict)
    """Open section."""

    @model_validator(mode="after")
    def _check_envs(self) -> Root:
        if "forbidden" in self.env:
            raise ValueError("env.forbidden is reserved")
        return self


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(data, Root)
    return info.value.problems


def test_schema_keys_walk_nested_optional_list_and_dict_models() -> None:
    keys = {k.dotted for k in schema_keys(Root)}
    assert {
        "policy",
        "policy.model_name",
        "policy.scheduler",
        "policy.scheduler.<index>.name",
        "policy.scheduler.<index>.kwargs",
        "policy.scheduler.<index>.milestones",
        "policy.generation.vllm_cfg",
        "policy.generation.vllm_cfg.gpu_memory_utilization",
        "env",
        "env.<name>.num_workers",
        "extra",
    } <= keys
    sections = {k.dotted for k in schema_keys(Root) if k.is_section}
    assert "policy.generation.vllm_cfg" in sections
    assert "policy.model_name" not in sections


@pytest.mark.parametrize(
    ("key", "bad_index"),
    [
        ("policy.model_name", None),
        ("policy.scheduler.0.milestones", None),
        ("policy.generation.vllm_cfg.gpu_memory_utilization", None),
        ("env.anything.num_workers", None),
        ("extra.a.b.c", None),
        ("policy.nope", 1),
        ("policy.scheduler.x", 2),
        ("env.math.nope", 2),
        ("policy.model_name.deeper", 2),
        ("nope", 0),
    ],
)
def test_check_key(key: str, bad_index: int | None) -> None:
    assert check_key(Root, key.split(".")) == bad_index


def test_annotation_and_type_names() -> None:
    assert annotation_at(Root, ["policy", "generation", "top_k"]) == int | None
    assert annotation_at(Root, ["extra", "x"]) is Any
    assert annotation_at(Root, ["policy", "nope"]) is None
    assert format_type(int | None) == "int | None"
    assert format_type(Literal["a", "b"]) == "'a' | 'b'"
    assert format_type(list[Entry | Milestones]) == "list[Entry | Milestones]"
    assert format_type(dict[str, Any]) == "dict[str, Any]"


def test_closest_keys() -> None:
    assert closest_keys(Root, "policy.model_nam")[0] == "policy.model_name"
    assert closest_keys(Root, "env.math.num_worker")[0] == "env.math.num_workers"
    assert closest_keys(Root, "policy.scheduler.1.nme")[0] == "policy.scheduler.1.name"
    # Nothing similar: fall back to the keys under the deepest valid prefix.
    far = closest_keys(Root, "policy.generation.zzzzzzzzzzzzzzzzzzzzzz")
    assert far and all(k.startswith("policy.generation.") for k in far)


def test_shorthand_matches() -> None:
    assert shorthand_matches(Root, "gpu_memory_utilization") == [
        "policy.generation.vllm_cfg.gpu_memory_utilization"
    ]
    assert shorthand_matches(Root, "math.num_workers", ["env.math", "env.math.num_workers"]) == [
        "env.math.num_workers"
    ]
    assert shorthand_matches(Root, "nope") == []


def test_container_default_seeds_only_non_model_defaults() -> None:
    class WithDefaults(ConfigModel):
        """Test."""

        kwargs: dict[str, float] = Field(default_factory=lambda: {"lr": 1.0})
        """Non-empty dict default."""

        sub: Env = Field(default_factory=Env)
        """Model default."""

    assert container_default(WithDefaults, ["kwargs"]) == {"lr": 1.0}
    assert container_default(WithDefaults, ["sub"]) is None
    assert container_default(Root, ["policy"]) is None


def test_unknown_key_names_full_key_and_suggestion() -> None:
    found = problems({"policy": {"model_name": "m", "generation": {"top_kk": 3}}})
    assert found == ["unknown key 'policy.generation.top_kk'; did you mean 'policy.generation.top_k'?"]


def test_unknown_key_in_dict_of_models() -> None:
    found = problems({"policy": {"model_name": "m"}, "env": {"math": {"num_workrs": 2}}})
    assert found == ["unknown key 'env.math.num_workrs'; did you mean 'env.math.num_workers'?"]


def test_unknown_root_key() -> None:
    (found,) = problems({"policy": {"model_name": "m"}, "polcy": {}})
    assert found == "unknown key 'polcy'; did you mean 'policy'?"


def test_wrong_type_names_key_expected_type_and_value() -> None:
    (found,) = problems({"policy": {"model_name": "m", "train_micro_batch_size": "two"}})
    assert found.startswith("policy.train_micro_batch_size: expected int, got 'two' (")
    (found,) = problems({"policy": {"model_name": "m", "generation": {"top_k": [1]}}})
    assert found.startswith("policy.generation.top_k: expected int | None, got [1] (")
    (found,) = problems({"policy": {"model_name": "m", "generation": {"backend": "sglang"}}})
    assert found.startswith("policy.generation.backend: expected 'embedded' | 'vllm', got 'sglang'")


def test_constraint_violation_in_optional_section() -> None:
    (found,) = problems(
        {"policy": {"model_name": "m", "generation": {"vllm_cfg": {"gpu_memory_utilization": 2}}}}
    )
    assert found.startswith("policy.generation.vllm_cfg.gpu_memory_utilization: expected float, got 2 (")
    assert "less than or equal to 1" in found


def test_union_of_models_reports_only_the_closest_member() -> None:
    found = problems({"policy": {"model_name": "m", "scheduler": [{"name": "a"}, {"name": 3}]}})
    assert found == ["policy.scheduler.1.name: expected str, got 3 (Input should be a valid string)"]
    found = problems({"policy": {"model_name": "m", "scheduler": [{"milestone": [3]}]}})
    assert found == [
        "missing required key 'policy.scheduler.0.name' (set it in the YAML or with `++policy.scheduler.0.name=...`)",
        "unknown key 'policy.scheduler.0.milestone'; did you mean 'policy.scheduler.0.milestones'?",
    ]


def test_model_validator_message_carries_section_key() -> None:
    (found,) = problems({"policy": {"model_name": "m", "train_global_batch_size": 3}})
    assert found == "policy: train_global_batch_size must be a multiple of train_micro_batch_size"
    (found,) = problems({"policy": {"model_name": "m"}, "env": {"forbidden": {}}})
    assert found == "env.forbidden is reserved"


def test_several_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"policy": {"train_micro_batch_size": "x", "bogus": 1}}, Root, source="config a.yaml")
    text = str(info.value)
    assert text.splitlines()[0] == "Invalid config a.yaml:"
    assert len(info.value.problems) == 3
    assert "missing required key 'policy.model_name'" in text
    assert "unknown key 'policy.bogus'" in text
    assert "policy.train_micro_batch_size: expected int" in text


def test_loop_sections_declare_shared_keys_once() -> None:
    from nemo_rl.config.algorithms import (
        NO_STEP_LIMIT,
        DistillationConfig,
        DPOConfig,
        GRPOConfig,
        LoopConfig,
        RMConfig,
        RolloutLoopConfig,
        SFTConfig,
        SupervisedLoopConfig,
    )

    bases = (LoopConfig, SupervisedLoopConfig, RolloutLoopConfig)
    for loop in (SFTConfig, DPOConfig, RMConfig, GRPOConfig, DistillationConfig):
        for base in bases:
            if not issubclass(loop, base):
                continue
            own = set(loop.__annotations__) & set(base.model_fields)
            # GRPO narrows the sampled responses per prompt to at least 2; every other key is inherited.
            assert own <= {"num_generations_per_prompt"}, (loop.__name__, own)
    # NeMo RL's -1 spellings of "no step limit" and "the whole validation set" read the same on every loop.
    for loop in (SFTConfig, DPOConfig, RMConfig):
        cfg = loop.model_validate({"max_num_steps": -1, "val_batches": -1})
        assert (cfg.max_num_steps, cfg.val_batches) == (NO_STEP_LIMIT, 0)
    assert GRPOConfig.model_validate({"max_num_steps": -1}).max_num_steps == NO_STEP_LIMIT
    assigned = SFTConfig()
    assigned.max_num_steps = -1
    assert assigned.max_num_steps == NO_STEP_LIMIT
    with pytest.raises(ValueError, match="num_generations_per_prompt"):
        GRPOConfig(num_generations_per_prompt=1)
    assert DistillationConfig(num_generations_per_prompt=1).samples_per_step == 32


def test_data_add_system_prompt_reaches_every_chat_template_call() -> None:
    from nemo_rl.config.master import SFTMasterConfig

    cfg = SFTMasterConfig.model_validate({"policy": {"model_name": "m"}, "data": {"add_system_prompt": True}})
    assert cfg.policy.tokenizer.chat_template_kwargs == {"add_system_prompt": True}
    with pytest.raises(ValueError, match="set one of them"):
        SFTMasterConfig.model_validate(
            {
                "policy": {
                    "model_name": "m",
                    "tokenizer": {"chat_template_kwargs": {"add_system_prompt": False}},
                },
                "data": {"add_system_prompt": True},
            }
        )
