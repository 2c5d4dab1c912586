"""The sliding puzzle: a multi-turn game environment, under the names NeMo RL's sliding-puzzle example imports.

A ``size`` x ``size`` board holds the tiles ``1 .. size*size-1`` and one blank (``0``); it is solved when the
tiles read in order with the blank last. Each assistant turn names one action inside ``<action>...</action>``:

- ``up`` / ``down`` / ``left`` / ``right``: the tile below / above / right of / left of the blank slides
  into it (so ``up`` moves the blank down);
- ``slide R C``: the tile at row ``R``, column ``C`` (1-based), next to the blank, slides into it;
- ``view``: show the board (no move).

Solving the board ends the game with reward 1; after ``max_moves`` moves (unreadable replies count) it ends
with reward 0. A game's whole state is its :class:`SlidingPuzzleMetadata` (the sample's ``extra_env_info``),
so one environment actor serves any number of games.

A driver builds the prompts itself (see ``examples/run_grpo_sliding_puzzle.py``) from
:meth:`SlidingPuzzleGameLogic.generate`, :meth:`~SlidingPuzzleGameLogic.init` and
:meth:`~SlidingPuzzleGameLogic.render`.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import ray
import torch

from nemo_rl.config.env import SlidingPuzzleEnvConfig, SlidingPuzzleSettings
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    check_step_batch,
)
from nemo_rl.environments.metrics import batch_rewards, last_assistant_text

ACTION_STOP_STRINGS = ["</action>"]
"""Where a reply ends: right after its action."""

_ACTION = re.compile(r"<action>(.*?)</action>", re.IGNORECASE | re.DOTALL)
_SLIDE = re.compile(r"slide\s+(-?\d+)\s+(-?\d+)")
# The blank moves opposite to the direction the tile slides: "up" slides the tile below the blank up.
_BLANK_STEP = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}


class SlidingPuzzleConfig(TypedDict):
    """How to generate one puzzle: the board side and the number of random moves scrambling it."""

    size: int
    shuffle_moves: int


class SlidingPuzzleMetadata(TypedDict):
    """A game in progress: the board (:meth:`SlidingPuzzleGameLogic.generate`'s dict), the moves made and
    the moves allowed."""

    game_state: dict[str, Any]
    num_moves: int
    max_moves: int


class SlidingPuzzleGameLogic:
    """The rules, as pure functions of a game-state dict: ``size``, ``grid`` (rows of tile numbers, 0 the
    blank), ``solution`` (the solved grid) and ``empty_pos`` (``[row, col]`` of the blank, 0-based)."""

    @staticmethod
    def generate(config: Mapping[str, Any], rng: random.Random | None = None) -> dict[str, Any]:
        """A solved ``config["size"]`` board scrambled by ``config["shuffle_moves"]`` random moves of the
        blank (drawn from ``rng``, else Python's global generator)."""
        size = int(config["size"])
        moves = int(config["shuffle_moves"])
        if size < 2 or moves < 0:
            raise ValueError(f"a sliding puzzle needs size >= 2 and shuffle_moves >= 0, got {dict(config)}")
        draw = rng if rng is not None else random
        solution = [[(r * size + c + 1) % (size * size) for c in range(size)] for r in range(size)]
        grid = copy.deepcopy(solution)
        row, col = size - 1, size - 1
        for _ in range(moves):
            neighbours = [
                (row + dr, col + dc)
                for dr, dc in _BLANK_STEP.values()
                if 0 <= row + dr < size and 0 <= col + dc < size
            ]
            new_row, new_col = draw.choice(neighbours)
            grid[row][col], grid[new_row][new_col] = grid[new_row][new_col], 0
            row, col = new_row, new_col
        return {"size": size, "grid": grid, "solution": solution, "empty_pos": [row, col]}

    @staticmethod
    def init(game_state: Mapping[str, Any]) -> str:
        """The rules, as the first lines of a game's prompt."""
        size = int(game_state["size"])
        return (
            f"Sliding puzzle {size}x{size}: order tiles 1-{size * size - 1}, blank _ last. Moves: up down left "
            "right (a tile next to the blank slides that way), slide R C, view."
        )

    @staticmethod
    def render(game_state: Mapping[str, Any]) -> str:
        """The board, one line per row, the blank as ``_``."""
        width = len(str(int(game_state["size"]) ** 2 - 1))
        return "\n".join(
            " ".join(("_" if tile == 0 else str(tile)).rjust(width) for tile in row)
            for row in game_state["grid"]
        )

    @staticmethod
    def step(action: str, game_state: Mapping[str, Any]) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply ``action``; returns ``(what happened, reward, solved, new state)``. An illegal or unknown
        action leaves the board as it was (reward 0)."""
        size = int(game_state["size"])
        row, col = (int(x) for x in game_state["empty_pos"])
        command = " ".join(action.lower().split())
        if command in _BLANK_STEP:
            dr, dc = _BLANK_STEP[command]
            tile_row, tile_col = row + dr, col + dc
        elif match := _SLIDE.fullmatch(command):
            tile_row, tile_col = int(match.group(1)) - 1, int(match.group(2)) - 1
            if abs(tile_row - row) + abs(tile_col - col) != 1:
                return f"Tile at {command[6:]} is not next to the blank.", 0.0, False, dict(game_state)
        else:
            return f"Unknown action {action!r}.", 0.0, False, dict(game_state)
        if not (0 <= tile_row < size and 0 <= tile_col < size):
            return f"Cannot move {command}: no tile there.", 0.0, False, dict(game_state)
        grid = [list(r) for r in game_state["grid"]]
        tile = grid[tile_row][tile_col]
        grid[row][col], grid[tile_row][tile_col] = tile, 0
        new_state = {**game_state, "grid": grid, "empty_pos": [tile_row, tile_col]}
        if grid == game_state["solution"]:
            return f"Moved {tile}. Solved!", 1.0, True, new_state
        return f"Moved {tile}.", 0.0, False, new_state


def parse_action(text: str) -> str | None:
    """The content of the reply's last ``<action>...</action>``, stripped; ``None`` without one."""
    actions = _ACTION.findall(text)
    return actions[-1].strip() if actions else None


@dataclass(frozen=True)
class Turn:
    """The outcome of one reply."""

    observation: str
    reward: float
    terminated: bool
    metadata: SlidingPuzzleMetadata


def play_turn(reply: str, metadata: SlidingPuzzleMetadata) -> Turn:
    """Apply the assistant's ``reply`` to a game."""
    state = metadata["game_state"]
    action = parse_action(reply)
    if action is not None and action.lower() == "view":
        return Turn(SlidingPuzzleGameLogic.render(state), 0.0, False, metadata)
    if action is None:
        outcome, reward, solved, new_state = (
            "No move: answer with <action>your action</action>.",
            0.0,
            False,
            dict(state),
        )
    else:
        outcome, reward, solved, new_state = SlidingPuzzleGameLogic.step(action, state)
    num_moves = int(metadata["num_moves"]) + 1
    out_of_moves = not solved and num_moves >= int(metadata["max_moves"])
    if out_of_moves:
        outcome += f" Out of moves ({metadata['max_moves']})."
    new_metadata = SlidingPuzzleMetadata(
        game_state=new_state, num_moves=num_moves, max_moves=int(metadata["max_moves"])
    )
    observation = (
        outcome if solved or out_of_moves else f"{outcome}\n{SlidingPuzzleGameLogic.render(new_state)}"
    )
    return Turn(observation, reward, solved or out_of_moves, new_metadata)


def resolve_settings(
    cfg: SlidingPuzzleEnvConfig | SlidingPuzzleSettings | Mapping[str, Any] | None,
) -> SlidingPuzzleSettings:
    """The environment's settings from any form it is given: the ``env.sliding_puzzle_game`` section (the
    registry), its ``cfg`` (NeMo RL's script), either as a plain mapping, or nothing (the defaults)."""
    if cfg is None:
        return SlidingPuzzleSettings()
    if isinstance(cfg, SlidingPuzzleEnvConfig):
        return cfg.cfg
    if isinstance(cfg, SlidingPuzzleSettings):
        return cfg
    if "cfg" in cfg:
        return SlidingPuzzleEnvConfig.model_validate(dict(cfg)).cfg
    return SlidingPuzzleSettings.model_validate(dict(cfg))


@ray.remote
class SlidingPuzzleEnv(EnvironmentInterface[SlidingPuzzleMetadata]):
    """The sliding puzzle as an environment actor (``SlidingPuzzleEnv.remote(cfg=...)``, or
    ``create_env("sliding_puzzle_game", env_cfg)``).

    Args:
        cfg: ``env.sliding_puzzle_game.cfg`` (``game_config``, ``max_moves``), or the whole
            ``env.sliding_puzzle_game`` section; plain mappings are accepted. ``max_moves`` applies to games
            whose metadata does not set its own.
    """

    def __init__(self, cfg: SlidingPuzzleEnvConfig | SlidingPuzzleSettings | Mapping[str, Any] | None = None):
        self.cfg = resolve_settings(cfg)

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[SlidingPuzzleMetadata]
    ) -> EnvironmentReturn[SlidingPuzzleMetadata]:
        """Play each conversation's latest reply."""
        check_step_batch(message_log_batch, metadata)
        turns = [
            play_turn(
                last_assistant_text(log),
                SlidingPuzzleMetadata(
                    game_state=game["game_state"],
                    num_moves=int(game.get("num_moves", 0)),
                    max_moves=int(game.get("max_moves", self.cfg.max_moves)),
                ),
            )
            for log, game in zip(message_log_batch, metadata, strict=True)
        ]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": t.observation} for t in turns],
            metadata=[t.metadata for t in turns],
            next_stop_strings=[None if t.terminated else list(ACTION_STOP_STRINGS) for t in turns],
            rewards=torch.tensor([t.reward for t in turns], dtype=torch.float32),
            terminateds=torch.tensor([t.terminated for t in turns], dtype=torch.bool),
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """``sliding_puzzle_success_rate`` (games solved) and ``mean_moves``; reads ``total_reward`` and
        ``extra_env_info``."""
        rewards_B = batch_rewards(batch)
        metrics = {
            "sliding_puzzle_success_rate": (rewards_B >= 1.0).float().mean().item()
            if rewards_B.numel()
            else 0.0
        }
        moves = [int(m["num_moves"]) for m in batch.get("extra_env_info", []) if isinstance(m, Mapping)]
        if moves:
            metrics["mean_moves"] = sum(moves) / len(moves)
        return batch, metrics
