"""YAML loading: ``defaults:`` inheritance, resolvers, validation entry points, saving and flattening."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf
from pydantic import Field

from nemo_rl.config import (
    ConfigError,
    ConfigModel,
    flatten_config,
    format_config,
    load_and_resolve,
    load_and_validate,
    load_config,
    register_resolvers,
    resolve_config,
    save_config,
    to_dict,
    validate_config,
)
from nemo_rl.utils.config import OverridesError, parse_hydra_overrides
from nemo_rl.utils.config import load_config as nemo_rl_load_config


class Optim(ConfigModel):
    """Test optimizer section."""

    lr: float = 1e-3
    """Learning rate."""

    kwargs: dict[str, float] = Field(default_factory=lambda: {"eps": 1e-8})
    """Extra arguments."""


class Train(ConfigModel):
    """Test training section."""

    model_name: str
    """Model."""

    batch_size: int = 8
    """Global batch size."""

    micro_batch_size: int = 2
    """Micro-batch size."""

    optim: Optim = Field(default_factory=Optim)
    """Optimizer."""

    prompt: str = "Q: {question}"
    """Prompt template."""


class Root(ConfigModel):
    """Test master config."""

    train: Train
    """Training."""

    tags: list[str] = Field(default_factory=list)
    """Free-form tags."""

    seed: int = 0
    """Seed."""


def resolve_free(cfg: DictConfig) -> dict[str, Any]:
    """The config as a plain dict, interpolations kept as written."""
    out = OmegaConf.to_container(cfg)
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_load_plain_file_leaves_interpolations_unresolved(tmp_path: Path) -> None:
    path = write(tmp_path / "a.yaml", "train:\n  model_name: m\n  prompt: ${train.model_name}\n")
    cfg = load_config(path)
    assert isinstance(cfg, DictConfig)
    assert resolve_free(cfg)["train"]["prompt"] == "${train.model_name}"
    assert cfg.train.prompt == "m"
    assert nemo_rl_load_config(path) == cfg


def test_defaults_single_path_relative_to_including_file(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", "seed: 1\ntrain:\n  model_name: base\n  batch_size: 16\n")
    child = write(
        tmp_path / "recipes" / "llm" / "child.yaml",
        "defaults: ../../base.yaml\ntrain:\n  model_name: child\n",
    )
    cfg = load_config(child)
    assert "defaults" not in cfg
    assert OmegaConf.to_container(cfg) == {"seed": 1, "train": {"model_name": "child", "batch_size": 16}}


def test_defaults_list_later_entries_and_file_itself_win(tmp_path: Path) -> None:
    write(
        tmp_path / "a.yaml",
        "seed: 1\ntags: [a]\ntrain: {model_name: a, batch_size: 4, micro_batch_size: 1}\n",
    )
    write(tmp_path / "sub" / "b.yaml", "seed: 2\ntrain: {model_name: b, batch_size: 6}\n")
    top = write(
        tmp_path / "top.yaml",
        "defaults:\n  - a.yaml\n  - sub/b.yaml\ntrain:\n  model_name: top\n",
    )
    cfg = load_config(top)
    assert OmegaConf.to_container(cfg) == {
        "seed": 2,
        "tags": ["a"],
        "train": {"model_name": "top", "batch_size": 6, "micro_batch_size": 1},
    }


def test_defaults_nested_chain_and_diamond(tmp_path: Path) -> None:
    write(tmp_path / "root.yaml", "seed: 0\ntags: [root]\ntrain: {model_name: root}\n")
    write(tmp_path / "x" / "left.yaml", "defaults: ../root.yaml\nseed: 1\n")
    write(tmp_path / "y" / "right.yaml", "defaults: [../root.yaml]\ntags: [right]\n")
    top = write(tmp_path / "z" / "deep" / "top.yaml", "defaults: [../../x/left.yaml, ../../y/right.yaml]\n")
    cfg = load_config(top)
    # right.yaml re-applies root.yaml (seed 0) before its own keys, and comes after left.yaml.
    assert OmegaConf.to_container(cfg) == {"seed": 0, "tags": ["right"], "train": {"model_name": "root"}}


def test_defaults_cycle_is_reported_with_the_chain(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "defaults: b.yaml\nseed: 1\n")
    write(tmp_path / "b.yaml", "defaults: c.yaml\n")
    write(tmp_path / "c.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle: .*a\.yaml -> .*b\.yaml -> .*c\.yaml -> .*a\.yaml"):
        load_config(tmp_path / "a.yaml")


def test_defaults_self_reference_is_a_cycle(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "defaults: ./a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("defaults: 3\n", "must be a YAML file path or a list"),
        ("defaults: [{override: x}]\n", "must be a YAML file path or a list"),
        ("defaults: missing.yaml\n", "config file not found"),
        ("- a\n- b\n", "mapping of keys at the top level"),
        ("a: [1, 2\n", "cannot parse config file"),
    ],
)
def test_bad_files_raise_config_error(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_resolvers(tmp_path: Path) -> None:
    path = write(
        tmp_path / "r.yaml",
        "a: 3\nb: 4\nmul: ${mul:${a},${b}}\nmul3: ${mul:2,3,4}\nadd: ${add:${a},${b},1}\n"
        "div_exact: ${div:${b},2}\ndiv_frac: ${div:${a},2}\nmax: ${max:${a},${b},-1}\nfmul: ${mul:0.5,${b}}\n",
    )
    resolved = resolve_config(load_config(path))
    assert resolved["mul"] == 12
    assert resolved["mul3"] == 24
    assert resolved["add"] == 8
    assert resolved["div_exact"] == 2 and isinstance(resolved["div_exact"], int)
    assert resolved["div_frac"] == 1.5
    assert resolved["max"] == 4
    assert resolved["fmul"] == 2.0


def test_register_resolvers_is_idempotent() -> None:
    register_resolvers()
    register_resolvers()
    assert OmegaConf.create({"x": "${mul:2,5}"}).x == 10


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x: ${nope.key}\n", r"cannot resolve 'x': Interpolation key 'nope.key' not found"),
        ("x: ${div:1,0}\n", r"cannot resolve 'x': .*divides by zero"),
        ("x: ${frobnicate:1}\n", r"cannot resolve 'x': .*frobnicate.*known resolvers include mul"),
        ("x: ???\n", r"no value given for 'x': set it with `x=...`"),
    ],
)
def test_resolution_errors(tmp_path: Path, text: str, message: str) -> None:
    cfg = load_config(write(tmp_path / "r.yaml", text))
    with pytest.raises(ConfigError, match=message):
        resolve_config(cfg)


def test_interpolation_sees_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path / "c.yaml",
        "train:\n  model_name: base\n  micro_batch_size: 2\n  batch_size: ${mul:${train.micro_batch_size},4}\n"
        "  prompt: 'model ${train.model_name}'\n",
    )
    cfg, resolved = load_and_resolve(path, Root, ["train.model_name=other", "train.micro_batch_size=3"])
    assert cfg.train.batch_size == 12
    assert cfg.train.prompt == "model other"
    assert resolved.train.batch_size == 12
    assert resolve_free(resolved)["train"]["prompt"] == "model other"


def test_load_and_validate_applies_schema_defaults(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "train:\n  model_name: m\n")
    cfg = load_and_validate(path, Root)
    assert isinstance(cfg, Root)
    assert cfg.train.batch_size == 8
    assert cfg.train.optim.kwargs == {"eps": 1e-8}
    assert load_and_validate(path, Root, overrides=["seed=5"]).seed == 5


def test_load_and_validate_reports_file_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "train:\n  model_name: m\n  batch_sise: 3\n")
    with pytest.raises(ConfigError) as info:
        load_and_validate(path, Root, overrides=["seed=2"])
    text = str(info.value)
    assert str(path) in text and "seed=2" in text
    assert "unknown key 'train.batch_sise'; did you mean 'train.batch_size'" in text


def test_validate_config_takes_dictconfig_or_mapping() -> None:
    assert validate_config(OmegaConf.create({"train": {"model_name": "m"}}), Root).train.model_name == "m"
    assert validate_config({"train": {"model_name": "m"}, "seed": 3}, Root).seed == 3
    with pytest.raises(ConfigError, match="missing required key 'train'"):
        validate_config({}, Root)


def test_save_config_round_trip_from_model(tmp_path: Path) -> None:
    model = Root(
        train=Train(model_name="m", prompt="literal ${not_an_interpolation}", optim=Optim(lr=3e-5)),
        tags=["x", "y"],
        seed=7,
    )
    path = save_config(model, tmp_path / "run" / "logs")
    assert path == tmp_path / "run" / "logs" / "config.yaml"
    reloaded = load_and_validate(path, Root)
    assert reloaded == model
    assert reloaded.train.prompt == "literal ${not_an_interpolation}"


def test_save_config_resolves_dictconfig(tmp_path: Path) -> None:
    src = write(
        tmp_path / "c.yaml", "seed: ${add:1,2}\ntrain:\n  model_name: m\n  batch_size: ${mul:${seed},2}\n"
    )
    path = save_config(load_config(src), tmp_path / "out")
    text = path.read_text()
    assert "${" not in text
    assert OmegaConf.to_container(load_config(path)) == {
        "seed": 3,
        "train": {"model_name": "m", "batch_size": 6},
    }
    assert save_config({"a": {"b": [1, 2]}}, tmp_path / "plain").read_text() == "a:\n  b:\n  - 1\n  - 2\n"


def test_flatten_and_to_dict() -> None:
    model = Root(train=Train(model_name="m"), tags=["t"])
    flat = flatten_config(model)
    assert flat["train.model_name"] == "m"
    assert flat["train.optim.lr"] == 1e-3
    assert flat["train.optim.kwargs.eps"] == 1e-8
    assert flat["tags"] == ["t"]
    assert "train" not in flat and "train.optim" not in flat
    assert to_dict(model)["train"]["optim"] == {"lr": 1e-3, "kwargs": {"eps": 1e-8}}
    nested = flatten_config(OmegaConf.create({"a": {"l": [{"x": 1}, {"y": "${a.z}"}], "z": 2, "e": {}}}))
    assert nested == {"a.l.0.x": 1, "a.l.1.y": 2, "a.z": 2, "a.e": {}}
    assert format_config(model).startswith("train:\n  model_name: m\n")


def test_parse_hydra_overrides_without_schema() -> None:
    cfg = OmegaConf.create({"a": {"b": 1}})
    out = parse_hydra_overrides(cfg, ["a.b=2", "+a.c=[1,2]"])
    assert OmegaConf.to_container(out) == {"a": {"b": 2, "c": [1, 2]}}
    # As in NeMo RL: applied to the config itself, which is left in struct mode.
    assert out is cfg and OmegaConf.is_struct(cfg)
    parse_hydra_overrides(cfg, ["~a.c", "++a.d=1"])
    assert OmegaConf.to_container(cfg) == {"a": {"b": 2, "d": 1}}
    with pytest.raises(OverridesError, match="unknown key"):
        parse_hydra_overrides(cfg, ["a.x=2"])
    with pytest.raises(ConfigError, match="already set"):
        parse_hydra_overrides(cfg, ["+a.b=3"])


def test_escaped_interpolation_stays_literal_in_resolved_config(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "train:\n  model_name: m\n  prompt: 'keep \\${this}'\n")
    cfg, resolved = load_and_resolve(path, Root)
    assert cfg.train.prompt == "keep ${this}"
    assert resolved.train.prompt == "keep ${this}"
    assert load_and_validate(save_config(resolved, tmp_path / "out"), Root) == cfg
