"""The NeMo RL-style library surface: MasterConfig names, dict-style reading of configs, nemo_rl.utils.config,
user environment sections and the registry checks behind ``task_to_env``."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_rl.config import load_and_validate
from nemo_rl.config.env import EnvConfig, MathEnvConfig
from nemo_rl.config.errors import ConfigError, UserError
from nemo_rl.config.master import GRPOMasterConfig, SFTMasterConfig
from nemo_rl.data.datasets import dataset_task_names
from nemo_rl.environments.registry import (
    check_env_sections,
    check_task_envs,
    register_env,
    registered_envs,
)
from nemo_rl.utils.config import load_config, parse_hydra_overrides

ROOT = Path(__file__).resolve().parents[2]
TINY_GRPO = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"


def test_master_config_names() -> None:
    from nemo_rl.algorithms import grpo, sft

    assert grpo.MasterConfig is GRPOMasterConfig and callable(grpo.setup) and callable(grpo.grpo_train)
    assert sft.MasterConfig is SFTMasterConfig and callable(sft.setup) and callable(sft.sft_train)


def test_config_sections_read_like_dicts() -> None:
    cfg = load_and_validate(TINY_GRPO, GRPOMasterConfig)
    assert cfg["policy"]["model_name"] == cfg.policy.model_name == "examples/assets/tiny_math_sft"
    assert cfg["policy"]["generation"]["max_new_tokens"] == 24
    assert "policy" in cfg and "polcy" not in cfg and 3 not in cfg  # type: ignore[operator]
    assert cfg.get("checkpointing") is cfg.checkpointing
    assert cfg["grpo"].get("no_such_key") is None and cfg["grpo"].get("no_such_key", 7) == 7
    assert cfg["cluster"].keys()[:3] == ["gpus_per_node", "num_nodes", "placement_timeout_s"]
    assert dict(cfg["cluster"].items()) == {**cfg["cluster"]} == cfg.cluster.model_dump()
    assert cfg["cluster"].values()[:3] == [1, 1, cfg.cluster.placement_timeout_s]
    with pytest.raises(KeyError, match="did you mean 'policy'"):
        cfg["polcy"]
    with pytest.raises(KeyError, match="its keys: "):
        cfg["grpo"]["zzz"]
    with pytest.raises(TypeError):
        cfg["policy"] = cfg.policy  # type: ignore[index]


def test_user_environment_sections(tmp_path: Path) -> None:
    recipe = tmp_path / "custom.yaml"
    recipe.write_text(f"defaults: {TINY_GRPO}\nenv:\n  exact_match:\n    threshold: 0.5\n")
    cfg = load_and_validate(recipe, GRPOMasterConfig, ["env.exact_match.threshold=0.75", "+env.other.k=1"])
    assert cfg["env"]["exact_match"] == {"threshold": 0.75} == cfg.env.section("exact_match")
    assert cfg.env.user_sections() == ["exact_match", "other"]
    assert isinstance(cfg.env.section("math"), MathEnvConfig) and cfg.env.section("unknown") == {}
    # Declared sections stay strict.
    with pytest.raises(ConfigError, match="num_workerz"):
        load_and_validate(TINY_GRPO, GRPOMasterConfig, ["env.math.num_workerz=2"])
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_and_validate(TINY_GRPO, GRPOMasterConfig, ["+env.exact_match=3"])


def test_env_sections_and_tasks_must_name_registered_environments() -> None:
    check_env_sections(EnvConfig())
    check_task_envs(["math", "number_guessing"], EnvConfig())
    with pytest.raises(UserError) as err:
        check_env_sections(EnvConfig.model_validate({"maht": {"num_workers": 2}}))
    message = str(err.value)
    assert "env.maht" in message and "did you mean env.math" in message and "number_guessing" in message
    assert "\n" not in message
    with pytest.raises(UserError, match=r"task 'exact_match' has no registered environment.*math"):
        check_task_envs(["math", "exact_match"], EnvConfig())
    register_env("test_library_api_env", "tests.unit.test_library_api:NoSuchClass", overwrite=True)
    assert "test_library_api_env" in registered_envs()
    check_env_sections(EnvConfig.model_validate({"test_library_api_env": {}}))
    check_task_envs(["test_library_api_env"], EnvConfig())


def test_dataset_task_names() -> None:
    assert dataset_task_names(None) == set()
    rows = [{"task_name": "math"}, {"task_name": "game"}, {"task_name": "math"}]
    assert dataset_task_names(rows) == {"math", "game"}  # type: ignore[arg-type]
    with pytest.raises(UserError, match="sample 1 of the dataset has no 'task_name'"):
        dataset_task_names([{"task_name": "math"}, {"prompt": "x"}])  # type: ignore[list-item]


def test_nemo_rl_load_config_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(
        "grpo: {max_num_steps: 10, seed: 1}\ndata: {dataset_name: squad, shuffle: false}\n"
        "total: ${sub:${grpo.max_num_steps},4}\n"
    )
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "child.yaml").write_text(
        "defaults: ../base.yaml\ngrpo: {max_num_steps: 20}\ndata:\n  _override_: true\n  dataset_name: tiny_math\n"
    )
    cfg = load_config(tmp_path / "recipes" / "child.yaml")
    assert OmegaConf.to_container(cfg, resolve=True) == {
        "grpo": {"max_num_steps": 20, "seed": 1},
        "data": {"dataset_name": "tiny_math"},  # replaced, not merged
        "total": 16,
    }
    cfg = parse_hydra_overrides(cfg, ["grpo.max_num_steps=30", "+grpo.extra=1"])
    assert cfg.total == 26 and cfg.grpo.extra == 1


def test_grpo_setup_checks_environments_before_starting_anything() -> None:
    from nemo_rl.algorithms import grpo

    config = load_and_validate(TINY_GRPO, grpo.MasterConfig)
    rows = [{"task_name": "exact_match"}]
    with pytest.raises(UserError, match="task 'exact_match' has no registered environment"):
        grpo.setup(config, None, rows, None)  # type: ignore[arg-type]
    with pytest.raises(UserError, match="val_dataset has samples of task 'math'"):
        grpo.setup(config, None, rows, [{"task_name": "math"}], task_to_env={"exact_match": None})  # type: ignore[arg-type]
    bad_section = config.model_copy(update={"env": EnvConfig.model_validate({"maht": {}})})
    with pytest.raises(UserError, match=r"env\.maht"):
        grpo.setup(bad_section, None, rows, None, task_to_env={"exact_match": None})  # type: ignore[arg-type]
