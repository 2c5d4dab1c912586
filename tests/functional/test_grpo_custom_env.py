"""A NeMo RL-style user script with its own environment: ``examples/run_grpo_sliding_puzzle.py`` builds the
sliding-puzzle prompts and environment actor and hands them to ``grpo.setup`` (``task_to_env``), or to
``ppo.setup`` for a PPO recipe. Run in-process on the session Ray cluster with the tiny warm-started
checkpoint, with dynamic sampling on."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.algorithms.grpo import MasterConfig, setup
from nemo_rl.config import load_and_validate
from nemo_rl.config.errors import UserError
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_grpo_sliding_puzzle.py"
CONFIG = ROOT / "examples" / "configs" / "grpo_sliding_puzzle_tiny.yaml"


def overrides(tmp_path: Path) -> list[str]:
    return [
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_num_steps=1",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        # DAPO's dynamic sampling: generation batches of 4 prompts until 2 groups with distinct rewards remain.
        "grpo.use_dynamic_sampling=true",
        "grpo.batch_multiplier=2",
        "grpo.dynamic_sampling_max_gen_batches=6",
        # NeMo RL's reward scaling ([0, 1] onto [0, 2]) and top-k / top-p sampling, end to end.
        "++grpo.reward_scaling.enabled=true",
        "++grpo.reward_scaling.target_max=2.0",
        "policy.generation.top_k=20",
        "policy.generation.top_p=0.95",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        f"logger.log_dir={tmp_path / 'logs'}",
        "++logger.console_enabled=false",
        "++logger.progress_bar=false",
    ]


@pytest.mark.usefixtures("ray_cluster")
def test_ported_sliding_puzzle_script(tmp_path: Path) -> None:
    script: dict[str, Any] = runpy.run_path(str(SCRIPT))  # the user's script as a module, not run

    # A task the given environments do not cover fails in setup, before anything starts.
    config = load_and_validate(CONFIG, MasterConfig, overrides(tmp_path))
    tokenizer = get_policy_tokenizer(config.policy)
    puzzles = script["PuzzleDataset"](tokenizer, {"size": 2, "shuffle_moves": 1}, 1, 8, "t", False)
    with pytest.raises(UserError, match=r"task 'sliding_puzzle_game'.*cover"):
        setup(config, tokenizer, puzzles, None, task_to_env={"math": object()})

    metrics = script["main"](["--config", str(CONFIG), *overrides(tmp_path)])

    # Puzzles one move from solved: the warm-started model solves some, so groups with distinct rewards exist.
    success = metrics["sliding_puzzle_game/sliding_puzzle_success_rate"]  # the environment's own, raw
    assert 0.0 < success < 1.0
    assert metrics["reward"] == pytest.approx(2 * success)  # every response generated, scaled
    assert 0.0 < metrics["filtered_reward"] < 2.0  # only groups with distinct rewards are trained on
    assert 1 <= metrics["dynamic_sampling_num_gen_batches"] <= 6
    assert metrics["dynamic_sampling_num_discarded_valid_samples"] % 4 == 0
    assert metrics["advantages/min"] < 0.0 < metrics["advantages/max"]
    assert metrics["mean_turns_per_sample"] == 1.0
    # The policy scores the responses under the same top-k / top-p distribution they were sampled from.
    assert abs(metrics["gen_kl_error"]) < 1e-4


@pytest.mark.usefixtures("ray_cluster")
def test_the_same_script_runs_ppo_for_a_recipe_with_a_ppo_section(tmp_path: Path) -> None:
    # The user's script hands its puzzles and environment to ppo.setup: one step trains the critic and the
    # policy on them (no warm-up), with the critic's values and GAE between.
    script: dict[str, Any] = runpy.run_path(str(SCRIPT))
    metrics = script["main"](
        [
            "--config",
            str(ROOT / "examples" / "configs" / "ppo_sliding_puzzle_tiny.yaml"),
            "ppo.num_prompts_per_step=2",
            "ppo.num_generations_per_prompt=4",
            "ppo.max_num_steps=1",
            "ppo.policy_training_start_step=0",
            "ppo.val_at_start=false",
            "ppo.val_period=0",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=8",
            "value.train_global_batch_size=4",
            "value.train_micro_batch_size=4",
            f"logger.log_dir={tmp_path / 'logs'}",
            "++logger.console_enabled=false",
            "++logger.progress_bar=false",
        ]
    )
    success = metrics["sliding_puzzle_game/sliding_puzzle_success_rate"]
    assert metrics["reward"] == pytest.approx(2 * success - 1)  # NeMo RL's PPO scaling: [0, 1] onto [-1, 1]
    assert metrics["policy_trained"] == 1.0 and "critic/loss" in metrics and "critic/explained_var" in metrics
    assert abs(metrics["gen_kl_error"]) < 1e-4
