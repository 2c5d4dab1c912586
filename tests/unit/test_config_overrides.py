"""Hydra-grammar overrides: every form, value typing, schema-aware keys, shorthand keys and their errors."""

from __future__ import annotations

from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf
from pydantic import Field

from nemo_rl.config import ConfigError, ConfigModel, apply_overrides, parse_overrides, validate_config


class Parallel(ConfigModel):
    """Test parallelism section."""

    enabled: bool = True
    """Use it."""

    tensor_parallel_size: int = 1
    """TP degree."""


class Sampling(ConfigModel):
    """Test sampling section."""

    temperature: float = 1.0
    """Temperature."""

    tensor_parallel_size: int = 1
    """TP degree of the sampler."""

    stop_strings: list[str] | None = None
    """Stop strings."""


class Policy(ConfigModel):
    """Test policy section."""

    model_name: str
    """Model."""

    dtensor_cfg: Parallel = Field(default_factory=Parallel)
    """DTensor backend."""

    generation: Sampling = Field(default_factory=Sampling)
    """Sampling."""

    optimizer_kwargs: dict[str, Any] = Field(default_factory=lambda: {"lr": 1e-5, "weight_decay": 0.1})
    """Optimizer arguments."""


class Logger(ConfigModel):
    """Test logger section."""

    swanlab_enabled: bool = False
    """SwanLab."""

    log_dir: str = "logs"
    """Directory."""


class Env(ConfigModel):
    """Test environment section."""

    num_workers: int = 1
    """Workers."""


class Root(ConfigModel):
    """Test master config."""

    policy: Policy
    """Policy."""

    logger: Logger = Field(default_factory=Logger)
    """Logger."""

    env: dict[str, Env] = Field(default_factory=dict)
    """Environments by name."""

    extra: dict[str, Any] = Field(default_factory=dict)
    """Free-form values."""


BASE = {
    "policy": {"model_name": "m", "dtensor_cfg": {"enabled": True}, "generation": {"temperature": 0.7}},
    "logger": {"log_dir": "logs"},
    "env": {"math": {"num_workers": 2}},
}


def base() -> DictConfig:
    return OmegaConf.create(BASE)


def apply(*overrides: str) -> dict[str, Any]:
    out = OmegaConf.to_container(apply_overrides(base(), overrides, Root), resolve=True)
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("policy.model_name=7", 7),
        ("policy.model_name=1.5e-3", 1.5e-3),
        ("policy.model_name=true", True),
        ("policy.model_name=False", False),
        ("policy.model_name=null", None),
        ("policy.model_name=[1,2]", [1, 2]),
        ("policy.model_name=[]", []),
        ("policy.model_name={a: 1, b: [x, y]}", {"a": 1, "b": ["x", "y"]}),
        ("policy.model_name='123'", "123"),
        ('policy.model_name="with space"', "with space"),
        ("policy.model_name=Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B"),
        ("policy.model_name=1.0.0", "1.0.0"),
    ],
)
def test_values_are_typed_like_hydra(text: str, value: Any) -> None:
    (override,) = parse_overrides([text])
    assert override.kind == "change"
    assert override.key == "policy.model_name"
    assert override.value == value
    assert type(override.value) is type(value)


def test_change_existing_key() -> None:
    out = apply("policy.generation.temperature=0.3")
    assert out["policy"]["generation"] == {"temperature": 0.3}


def test_change_key_valid_in_schema_but_absent_from_yaml() -> None:
    out = apply("policy.dtensor_cfg.tensor_parallel_size=2", "logger.swanlab_enabled=true")
    assert out["policy"]["dtensor_cfg"] == {"enabled": True, "tensor_parallel_size": 2}
    assert out["logger"]["swanlab_enabled"] is True


def test_change_key_under_open_dict_field() -> None:
    assert apply("extra.anything.deep=1")["extra"] == {"anything": {"deep": 1}}
    assert apply("env.code.num_workers=4")["env"]["code"] == {"num_workers": 4}


def test_change_unknown_key_names_closest_keys() -> None:
    with pytest.raises(ConfigError) as info:
        apply("policy.dtensor_cfg.tensor_paralel_size=2")
    text = str(info.value)
    assert "'policy.dtensor_cfg.tensor_paralel_size'" in text
    assert "did you mean 'policy.dtensor_cfg.tensor_parallel_size'" in text
    assert "+policy.dtensor_cfg.tensor_paralel_size=2" in text


def test_unknown_key_with_matching_leaf_name_elsewhere() -> None:
    with pytest.raises(ConfigError) as info:
        apply("policy.tensor_parallel_size=2")
    hint = str(info.value).split("did you mean ", 1)[1].split("?")[0]
    # Keys ending in the same field name come first, before plain string-similarity matches.
    assert set(hint.split(" or ")[:2]) == {
        "'policy.dtensor_cfg.tensor_parallel_size'",
        "'policy.generation.tensor_parallel_size'",
    }


def test_add_new_key() -> None:
    out = apply("+policy.generation.stop_strings=[x]", "+extra.k=v")
    assert out["policy"]["generation"]["stop_strings"] == ["x"]
    assert out["extra"] == {"k": "v"}


def test_add_existing_key_is_an_error() -> None:
    with pytest.raises(
        ConfigError, match=r"cannot add 'policy.model_name'.*already set.*policy.model_name=x"
    ):
        apply("+policy.model_name=x")


def test_force_add_sets_existing_or_new_key() -> None:
    out = apply("++policy.model_name=x", "++policy.generation.tensor_parallel_size=4", "++new_root=1")
    assert out["policy"]["model_name"] == "x"
    assert out["policy"]["generation"]["tensor_parallel_size"] == 4
    assert out["new_root"] == 1


def test_delete_key() -> None:
    out = apply("~policy.generation.temperature", "~logger")
    assert out["policy"]["generation"] == {}
    assert "logger" not in out


def test_delete_with_value_only_if_equal() -> None:
    assert "temperature" not in apply("~policy.generation.temperature=0.7")["policy"]["generation"]
    with pytest.raises(ConfigError, match=r"only if it equals 0\.5, but it is 0\.7"):
        apply("~policy.generation.temperature=0.5")


def test_delete_missing_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"cannot delete 'policy.nope'"):
        apply("~policy.nope")


def test_list_items_by_index() -> None:
    cfg = OmegaConf.create({"extra": {"items": [{"a": 1}, {"a": 2}]}, "policy": {"model_name": "m"}})
    out = apply_overrides(cfg, ["extra.items.1.a=5", "~extra.items.0"], Root)
    assert OmegaConf.to_container(out.extra) == {"items": [{"a": 5}]}


def test_dict_value_merges_into_section() -> None:
    out = apply("policy.generation={tensor_parallel_size: 2}")
    assert out["policy"]["generation"] == {"temperature": 0.7, "tensor_parallel_size": 2}


def test_setting_inside_absent_dict_field_keeps_schema_defaults() -> None:
    out = apply("policy.optimizer_kwargs.lr=0.5")
    assert out["policy"]["optimizer_kwargs"] == {"lr": 0.5, "weight_decay": 0.1}


def test_interpolation_value_resolves_after_all_overrides() -> None:
    out = apply("logger.log_dir=runs/${policy.model_name}", "policy.model_name=other")
    assert out["logger"]["log_dir"] == "runs/other"


def test_overrides_apply_in_order_and_do_not_mutate_input() -> None:
    cfg = base()
    out = apply_overrides(cfg, ["policy.model_name=a", "policy.model_name=b"], Root)
    assert out.policy.model_name == "b"
    assert cfg.policy.model_name == "m"
    assert "tensor_parallel_size" not in cfg.policy.dtensor_cfg


def test_shorthand_unique_suffix(capsys: pytest.CaptureFixture[str]) -> None:
    out = apply("swanlab_enabled=true", "dtensor_cfg.tensor_parallel_size=2")
    assert out["logger"]["swanlab_enabled"] is True
    assert out["policy"]["dtensor_cfg"]["tensor_parallel_size"] == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "nemo_rl.config: 'swanlab_enabled=true' applied as 'logger.swanlab_enabled=true'",
        "nemo_rl.config: 'dtensor_cfg.tensor_parallel_size=2' applied as "
        "'policy.dtensor_cfg.tensor_parallel_size=2'",
    ]


def test_shorthand_uses_dict_names_from_the_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert apply("math.num_workers=8")["env"]["math"]["num_workers"] == 8
    assert "'env.math.num_workers=8'" in capsys.readouterr().err


def test_shorthand_keeps_override_kind() -> None:
    assert "temperature" not in apply("~temperature")["policy"]["generation"]
    with pytest.raises(ConfigError, match=r"cannot add 'policy\.generation\.temperature'"):
        apply("+temperature=0.1")


def test_shorthand_ambiguous_lists_candidates() -> None:
    with pytest.raises(ConfigError) as info:
        apply("tensor_parallel_size=2")
    text = str(info.value)
    assert "ambiguous" in text
    assert "policy.dtensor_cfg.tensor_parallel_size" in text
    assert "policy.generation.tensor_parallel_size" in text


def test_root_key_is_never_treated_as_shorthand() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        apply("policy.swanlab_enabled=true")


def test_unknown_shorthand_is_unknown_key() -> None:
    with pytest.raises(ConfigError, match=r"cannot set 'nothing_like_this'.*unknown key"):
        apply("nothing_like_this=1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("policy.model_name==", "cannot parse override"),
        ("policy.model_name", "cannot parse override"),
        ("policy.model_name=1,2", r"is a sweep.*policy.model_name=\[1,2\]"),
        ("policy.model_name=choice(a,b)", "is a sweep"),
        ("policy@pkg=1", "config group or package"),
        ("db/mysql=x", "config group or package"),
        ("=3", "has no key"),
    ],
)
def test_bad_override_text(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_overrides([text])


def test_overridden_config_validates() -> None:
    out = apply_overrides(base(), ["policy.generation.temperature=0.2", "swanlab_enabled=true"], Root)
    model = validate_config(out, Root)
    assert model.policy.generation.temperature == 0.2
    assert model.logger.swanlab_enabled is True
    assert model.env["math"].num_workers == 2


def test_keys_of_dict_defaults_count_for_hints_and_shorthand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'policy\.optimizer_kwargs\.weight_decay'"):
        apply("policy.weight_decay=0.0")
    out = apply("weight_decay=0.0")
    assert out["policy"]["optimizer_kwargs"] == {"lr": 1e-5, "weight_decay": 0.0}
    assert "'policy.optimizer_kwargs.weight_decay=0.0'" in capsys.readouterr().err


def test_every_failing_override_is_reported() -> None:
    with pytest.raises(ConfigError) as info:
        apply("policy.model_nam=x", "policy.generation.temperature=0.1", "+policy.model_name=y", "~nope")
    assert str(info.value).splitlines()[0] == "3 overrides cannot be applied:"
    assert [p.split(" ", 2)[:2] for p in info.value.problems] == [
        ["cannot", "set"],
        ["cannot", "add"],
        ["cannot", "delete"],
    ]
