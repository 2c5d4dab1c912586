"""GRPO on the sliding puzzle: a multi-turn game environment driven by a NeMo RL-style user script.

    uv run python examples/run_grpo_sliding_puzzle.py [--config PATH] [--dry-run] [key=value ...]
    uv run python examples/run_grpo_sliding_puzzle.py --config PATH --write-warmup-data OUT.jsonl [key=value ...]

The script reads like NeMo RL's ``examples/run_grpo_sliding_puzzle.py``: it loads its recipe with
``load_config`` / ``parse_hydra_overrides``, builds the puzzle prompts and the environment actor itself, and
hands both to ``grpo.setup`` (``task_to_env``), or to ``ppo.setup`` for a recipe with a ``ppo`` section
(``ppo_sliding_puzzle_tiny.yaml``). ``examples/configs/grpo_sliding_puzzle.yaml`` is NeMo RL's recipe
(Qwen2.5-1.5B-Instruct on a GPU); ``grpo_sliding_puzzle_tiny.yaml`` runs on a CPU with the committed tiny
checkpoint ``examples/assets/tiny_sliding_puzzle_sft`` (see docs/porting.md for its reward curve).

``--write-warmup-data OUT.jsonl`` writes puzzles of the config as chat data (``openai_format``) answered with
a random legal move in the action format, for a supervised warm start of a model that has never seen the
game (it learns the format, not how to solve), and exits.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from omegaconf import OmegaConf
from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms import ppo
from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup
from nemo_rl.config.loader import format_config
from nemo_rl.config.no_effect import format_no_effect, no_effect_settings
from nemo_rl.config.validation import validate_dict
from nemo_rl.data.interfaces import DatumSpec
from nemo_rl.distributed.ray_start import init_ray
from nemo_rl.environments.games.sliding_puzzle import (
    ACTION_STOP_STRINGS,
    SlidingPuzzleConfig,
    SlidingPuzzleEnv,
    SlidingPuzzleGameLogic,
    SlidingPuzzleMetadata,
)
from nemo_rl.models.tokenizer import get_policy_tokenizer
from nemo_rl.utils.config import load_config, parse_hydra_overrides
from nemo_rl.utils.script_exit import run_script

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo_sliding_puzzle.yaml"
TASK_NAME = "sliding_puzzle_game"
_DIRECTIONS = ("up", "down", "left", "right")


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """``--config``, ``--dry-run``, ``--write-warmup-data``; everything else is a Hydra-style override."""
    parser = argparse.ArgumentParser(description="GRPO on the sliding puzzle")
    parser.add_argument("--config", type=str, default=str(DEFAULT_CONFIG), help="YAML recipe")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--write-warmup-data", type=str, default=None, metavar="OUT.jsonl")
    parser.add_argument("--num-warmup-samples", type=int, default=4096)
    return parser.parse_known_args(argv)


def random_game_config(max_config: Mapping[str, Any], rng: random.Random) -> SlidingPuzzleConfig:
    """One puzzle's size (2 .. ``size``) and scrambling moves (odd, 1 .. ``shuffle_moves``)."""
    moves = rng.randint(1, int(max_config["shuffle_moves"]))
    return SlidingPuzzleConfig(size=rng.randint(2, int(max_config["size"])), shuffle_moves=moves | 1)


def puzzle_prompt(game_state: Mapping[str, Any]) -> str:
    """The user's first message: the rules, the board and the answer format."""
    return (
        f"{SlidingPuzzleGameLogic.init(game_state)}\n{SlidingPuzzleGameLogic.render(game_state)}\n"
        "Answer <action>move</action>."
    )


def generate_puzzle_datum(
    tokenizer: PreTrainedTokenizerBase,
    game_config: Mapping[str, Any],
    max_moves: int,
    idx: int,
    seed: str,
    add_system_prompt: bool,
) -> DatumSpec:
    """Puzzle ``idx`` of the stream named ``seed`` (the same puzzle every time it is read)."""
    rng = random.Random(f"{seed}/{idx}")
    game_state = SlidingPuzzleGameLogic.generate(random_game_config(game_config, rng), rng)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": puzzle_prompt(game_state)}],
        tokenize=False,
        add_generation_prompt=True,
        add_system_prompt=add_system_prompt,
    )
    token_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    return {
        "message_log": [{"role": "user", "content": text, "token_ids": token_ids}],
        "length": len(token_ids),
        "extra_env_info": dict(
            SlidingPuzzleMetadata(game_state=game_state, num_moves=0, max_moves=max_moves)
        ),
        "loss_multiplier": 1.0,
        "idx": idx,
        "task_name": TASK_NAME,
        "stop_strings": list(ACTION_STOP_STRINGS),
    }


class PuzzleDataset(Sequence[DatumSpec]):
    """``length`` puzzles generated on access (NeMo RL streams them from an ``IterableDataset``; a sequence
    lets the loader shuffle, and resume from a checkpoint, by index)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        game_config: Mapping[str, Any],
        max_moves: int,
        length: int,
        seed: str,
        add_system_prompt: bool,
    ) -> None:
        self.tokenizer, self.game_config, self.max_moves = tokenizer, dict(game_config), max_moves
        self.length, self.seed, self.add_system_prompt = length, seed, add_system_prompt
        self.task_names = {TASK_NAME}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> DatumSpec:  # type: ignore[override]
        if not 0 <= idx < self.length:
            raise IndexError(idx)
        return generate_puzzle_datum(
            self.tokenizer, self.game_config, self.max_moves, idx, self.seed, self.add_system_prompt
        )


def setup_puzzle_data(
    tokenizer: PreTrainedTokenizerBase,
    env_cfg: Mapping[str, Any],
    length: int,
    val_length: int,
    seed: int,
    add_system_prompt: bool,
) -> tuple[PuzzleDataset, PuzzleDataset, dict[str, Any], dict[str, Any]]:
    """The training and validation puzzles and the environment actor that plays them."""
    cfg = env_cfg[TASK_NAME]["cfg"]
    env = SlidingPuzzleEnv.options(num_gpus=0).remote(cfg=cfg)  # type: ignore[attr-defined]
    task_to_env = {TASK_NAME: env}
    game_config, max_moves = cfg["game_config"], cfg["max_moves"]
    train = PuzzleDataset(tokenizer, game_config, max_moves, length, f"train/{seed}", add_system_prompt)
    val = PuzzleDataset(
        tokenizer, game_config, max_moves, val_length, f"validation/{seed}", add_system_prompt
    )
    return train, val, task_to_env, task_to_env


def write_warmup_data(path: str, num_samples: int, env_cfg: Mapping[str, Any], seed: int) -> None:
    """Puzzles answered with a random legal direction, as ``openai_format`` rows (``messages``)."""
    cfg = env_cfg[TASK_NAME]["cfg"]
    rng = random.Random(f"warmup/{seed}")
    with open(path, "w") as out:
        for _ in range(num_samples):
            state = SlidingPuzzleGameLogic.generate(random_game_config(cfg["game_config"], rng), rng)
            legal = [d for d in _DIRECTIONS if SlidingPuzzleGameLogic.step(d, state)[3] != state]
            messages = [
                {"role": "user", "content": puzzle_prompt(state)},
                {"role": "assistant", "content": f"<action>{rng.choice(legal)}</action>"},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {num_samples} warm-up conversations to {path}")


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Load the recipe, then set up and run GRPO (or PPO, for a recipe with a ``ppo`` section, such as
    ``ppo_sliding_puzzle_tiny.yaml``); returns the last step's metrics."""
    args, overrides = parse_args(argv)
    config = load_config(args.config)
    if overrides:
        config = parse_hydra_overrides(config, overrides)
    algorithm = "ppo" if "ppo" in config else "grpo"
    resolved = OmegaConf.to_container(config, resolve=True)
    master: MasterConfig | ppo.MasterConfig = (
        validate_dict(resolved, ppo.MasterConfig, args.config)
        if algorithm == "ppo"
        else validate_dict(resolved, MasterConfig, args.config)
    )
    loop = master[algorithm]
    if args.dry_run:
        print(format_config(master), end="")  # every key, defaults included
        print(format_no_effect(no_effect_settings(master)), flush=True)
        sys.exit(0)
    if args.write_warmup_data:
        write_warmup_data(args.write_warmup_data, args.num_warmup_samples, master["env"], loop["seed"])
        return {}

    # Ray first: the environment actor starts before setup (which would start Ray itself otherwise).
    init_ray(master.cluster)
    tokenizer = get_policy_tokenizer(master.policy)
    length = loop["num_prompts_per_step"] * loop["num_generations_per_prompt"] * loop["max_num_steps"]
    dataset, val_dataset, task_to_env, val_task_to_env = setup_puzzle_data(
        tokenizer,
        master["env"],
        length,
        loop["max_val_samples"],
        loop["seed"],
        master["data"]["add_system_prompt"],
    )
    # The puzzles are a Sequence of samples, which is what setup reads of a dataset.
    start: Any = ppo.setup if algorithm == "ppo" else setup
    train: Any = ppo.ppo_train if algorithm == "ppo" else grpo_train
    components = start(master, tokenizer, dataset, val_dataset, task_to_env, val_task_to_env)
    try:
        metrics = train(components)
        print(f"{algorithm.upper()} finished at step {components.state.step}", flush=True)
    finally:
        components.shutdown()
        for env in task_to_env.values():
            ray.kill(env)
    return metrics


if __name__ == "__main__":
    run_script(main)
