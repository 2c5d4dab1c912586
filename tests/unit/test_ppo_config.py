"""PPO's config: the critic section, the checks that need the whole config, the data or the tokenizers, and the
script's one-line exit for each mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.algorithms.ppo import _check_warm_up, check_critic, prev_logprobs_from_training_forward
from nemo_rl.config.errors import ConfigError, UserError
from nemo_rl.config.loader import load_and_validate, load_config, resolve_config
from nemo_rl.config.master import PPOMasterConfig
from nemo_rl.config.validation import validate_dict
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "configs" / "ppo_math_tiny.yaml"
NEMO_RL_RECIPE = ROOT / "examples" / "configs" / "ppo_math_1B.yaml"


def _tiny(*overrides: str) -> PPOMasterConfig:
    return load_and_validate(TINY, PPOMasterConfig, list(overrides))


def _resolved() -> dict[str, Any]:
    return resolve_config(load_config(TINY))


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        validate_dict(data, PPOMasterConfig)
    return str(err.value)


def test_the_critic_is_always_a_regression_head_on_the_policy_checkpoint() -> None:
    config = _tiny("ppo.ppo_epochs=1", "ppo.critic_ppo_epochs=3")
    assert config.value.model_name == config.policy.model_name
    assert config.value.reward_model_cfg.enabled
    assert config.value.reward_model_cfg.reward_model_type == "regression"
    assert config.ppo.critic_epochs == 3 and config.ppo.ppo_epochs == 1
    # NeMo RL's recipe: critic epochs follow the policy's when unset; its Megatron recipe's
    # reward_model_cfg.enabled=false still gives the critic its head.
    recipe = load_and_validate(NEMO_RL_RECIPE, PPOMasterConfig, ["ppo.critic_ppo_epochs=null"])
    assert recipe.ppo.critic_epochs == recipe.ppo.ppo_epochs
    off = load_and_validate(NEMO_RL_RECIPE, PPOMasterConfig, ["value.reward_model_cfg.enabled=false"])
    assert off.value.reward_model_cfg.enabled and off.value.reward_model_cfg.reward_model_type == "regression"


def test_a_run_without_a_critic_says_how_to_add_one() -> None:
    data = _resolved()
    del data["value"]
    assert "PPO needs a critic: add a value section with value.model_name" in _error(data)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["value.reward_model_cfg.reward_model_type=bradley_terry"], "the critic is a regression head"),
        (
            [
                "ppo.skip_reference_policy_logprobs_calculation=true",
                "loss_fn.reference_policy_kl_penalty=0.01",
            ],
            "set one of them off",
        ),
        (
            ["value.max_total_sequence_length=32"],
            "value.max_total_sequence_length=32 is shorter than the policy's 64",
        ),
        (["value.train_global_batch_size=384"], "must be a multiple of value.train_global_batch_size=384"),
        (["policy.train_global_batch_size=96"], "must be a multiple of policy.train_global_batch_size=96"),
        (["ppo.max_num_steps=5", "ppo.policy_training_start_step=5"], "the policy would never train"),
        (["ppo.async_ppo.enabled=true"], "ppo.async_ppo.enabled"),
        (["ppo.value_colocated.enabled=false"], "needs ppo.value_colocated.resources.gpus_per_node"),
        (
            [
                "ppo.value_colocated.enabled=false",
                "++ppo.value_colocated.resources.gpus_per_node=1",
                "++ppo.value_colocated.resources.num_nodes=1",
            ],
            "leave it null",
        ),
        (["ppo.seq_logprob_error_threshold=0.5"], "seq_logprob_error_threshold"),
    ],
)
def test_config_mistakes_are_named(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _tiny(*overrides)
    assert message in str(err.value), str(err.value)


def test_the_warm_up_must_end_before_a_run_bounded_by_its_epochs() -> None:
    config = _tiny("ppo.max_num_epochs=2", "ppo.policy_training_start_step=3")
    prompts = config.ppo.prompts_per_generation_batch
    _check_warm_up(config, [None] * (2 * prompts))  # type: ignore[arg-type]  # 4 steps: fine
    with pytest.raises(
        UserError, match=r"policy_training_start_step=3 is not before the run's last step \(2"
    ):
        _check_warm_up(config, [None] * prompts)  # type: ignore[arg-type]


def test_a_critic_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    config = _tiny()
    tokenizer = get_policy_tokenizer(config.policy)
    check_critic(config, tokenizer)
    other = get_policy_tokenizer(config.policy)
    other.add_tokens(["<critic_only>"])
    other.save_pretrained(tmp_path)
    changed = _tiny(f"value.tokenizer.name={tmp_path}")
    with pytest.raises(UserError, match="maps tokens to ids differently from the policy's"):
        check_critic(changed, tokenizer)


def test_the_training_forward_gives_the_previous_logprobs_only_for_one_step_per_batch() -> None:
    assert prev_logprobs_from_training_forward(_tiny())
    assert not prev_logprobs_from_training_forward(_tiny("ppo.ppo_epochs=2"))
    assert not prev_logprobs_from_training_forward(_tiny("policy.train_global_batch_size=256"))


def test_the_script_exits_2_with_one_line() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "examples/run_ppo.py",
            "--config",
            str(TINY),
            "value.reward_model_cfg.reward_model_type=x",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "reward_model_type" in result.stderr, result.stderr
