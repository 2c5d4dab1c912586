"""The sliding-puzzle rules and turns (pure functions; the actor runs in the functional GRPO test)."""

from __future__ import annotations

import random

import pytest

from nemo_rl.config.env import EnvConfig, SlidingPuzzleEnvConfig
from nemo_rl.environments.games.sliding_puzzle import (
    SlidingPuzzleGameLogic,
    SlidingPuzzleMetadata,
    parse_action,
    play_turn,
    resolve_settings,
)
from nemo_rl.environments.registry import get_env_class

Logic = SlidingPuzzleGameLogic


def test_generate_scrambles_a_solved_board_reproducibly() -> None:
    solved = Logic.generate({"size": 3, "shuffle_moves": 0})
    assert solved["grid"] == solved["solution"] == [[1, 2, 3], [4, 5, 6], [7, 8, 0]]
    assert solved["empty_pos"] == [2, 2]
    a = Logic.generate({"size": 4, "shuffle_moves": 51}, random.Random(3))
    assert a == Logic.generate({"size": 4, "shuffle_moves": 51}, random.Random(3))
    # An odd number of blank moves never leaves the board solved, and keeps every tile.
    assert a["grid"] != a["solution"] and sorted(t for row in a["grid"] for t in row) == list(range(16))
    row, col = a["empty_pos"]
    assert a["grid"][row][col] == 0
    with pytest.raises(ValueError, match="size >= 2"):
        Logic.generate({"size": 1, "shuffle_moves": 1})


def test_moves_follow_the_tile_that_slides() -> None:
    state = {"size": 2, "grid": [[1, 0], [3, 2]], "solution": [[1, 2], [3, 0]], "empty_pos": [0, 1]}
    assert Logic.render(state) == "1 _\n3 2"
    # "up": the tile below the blank slides up, which solves this board.
    text, reward, solved, after = Logic.step("up", state)
    assert (reward, solved, after["grid"], after["empty_pos"]) == (1.0, True, [[1, 2], [3, 0]], [1, 1])
    assert "Solved" in text and state["grid"] == [[1, 0], [3, 2]]  # the input is not changed
    _, reward, solved, after = Logic.step("Right", state)  # the tile left of the blank slides right
    assert (reward, solved, after["grid"]) == (0.0, False, [[0, 1], [3, 2]])
    assert Logic.step("slide 2 2", state)[2]  # the tile at row 2, column 2 slides up: solved
    assert Logic.step("slide  1 1", state)[3]["grid"] == [[0, 1], [3, 2]]
    for illegal in ("left", "down", "slide 2 1", "slide 0 2", "jump"):
        text, reward, solved, after = Logic.step(illegal, state)
        assert (reward, solved, after) == (0.0, False, state), illegal


def test_turns_count_moves_and_end_games() -> None:
    state = {"size": 2, "grid": [[1, 0], [3, 2]], "solution": [[1, 2], [3, 0]], "empty_pos": [0, 1]}
    game = SlidingPuzzleMetadata(game_state=state, num_moves=0, max_moves=2)
    assert parse_action("think... <action>left</action> no, <ACTION> up </action>") == "up"
    assert parse_action("up") is None

    solved = play_turn("<action>up</action>", game)
    assert (solved.reward, solved.terminated, solved.metadata["num_moves"]) == (1.0, True, 1)
    viewed = play_turn("<action>view</action>", game)
    assert (viewed.terminated, viewed.metadata["num_moves"], viewed.observation) == (False, 0, "1 _\n3 2")
    wrong = play_turn("<action>right</action>", game)
    assert (wrong.reward, wrong.terminated) == (0.0, False) and wrong.observation.endswith("_ 1\n3 2")
    unreadable = play_turn("up", wrong.metadata)  # no action tag: counts as a move, the last one
    assert (unreadable.reward, unreadable.terminated, unreadable.metadata["num_moves"]) == (0.0, True, 2)
    assert "Out of moves (2)" in unreadable.observation


def test_config_section_and_registry() -> None:
    env = EnvConfig.model_validate(
        {"sliding_puzzle_game": {"cfg": {"game_config": {"size": 5, "shuffle_moves": 10}, "max_moves": 30}}}
    )
    section = env.section("sliding_puzzle_game")
    assert isinstance(section, SlidingPuzzleEnvConfig) and section["cfg"]["game_config"]["size"] == 5
    # The actor takes the whole section (registry) or NeMo RL's inner `cfg` mapping (its script).
    assert resolve_settings(section).max_moves == 30
    assert resolve_settings({"game_config": {"size": 3, "shuffle_moves": 1}, "max_moves": 4}).max_moves == 4
    assert get_env_class("sliding_puzzle_game") is not None
