"""Number guessing: a small multi-turn environment.

The assistant guesses a hidden whole number in ``[low, high]``; after each guess the environment answers
``higher``, ``lower`` or ``correct``. A correct guess ends the game with reward 1; after ``max_guesses``
guesses (unparsable replies count) the game ends with reward 0.

A game's state is its metadata: ``{"target": 7, "guesses": 0}`` (make it with :func:`new_game`, put it in a
sample's ``extra_env_info``, and use :func:`game_prompt` as the user's first message). The generic RL data
path works too: :func:`game_records` makes dataset rows whose ``expected_answer`` is the hidden number, and
the processor's ``{"ground_truth": "7"}`` is read as a game that has not started.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from nemo_rl.config.env import NumberGuessingEnvConfig
from nemo_rl.data.interfaces import ChatMessage, Record
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    check_step_batch,
)
from nemo_rl.environments.metrics import batch_rewards, last_assistant_text

GameState = dict[str, Any]
"""``target`` (the hidden number), ``guesses`` (made so far), and after a step ``last_guess`` and ``solved``."""

_GUESS_TAG = re.compile(r"<guess>\s*(-?\d+)", re.IGNORECASE)
_INTEGER = re.compile(r"-?\d+")


def new_game(target: int) -> GameState:
    """The state of a game that has not started, hiding ``target``."""
    return {"target": int(target), "guesses": 0}


def game_records(num_games: int, cfg: NumberGuessingEnvConfig, *, seed: int) -> list[Record]:
    """Dataset rows for ``num_games`` games with targets drawn uniformly from ``[cfg.low, cfg.high]``."""
    rng = random.Random(seed)
    return [
        Record(
            messages=[ChatMessage(role="user", content=game_prompt(cfg))],
            expected_answer=str(rng.randint(cfg.low, cfg.high)),
        )
        for _ in range(num_games)
    ]


def game_prompt(cfg: NumberGuessingEnvConfig) -> str:
    """The first user message of a game."""
    return (
        f"I am thinking of a whole number between {cfg.low} and {cfg.high}. Guess it: reply with the number "
        f"only. After each guess I say higher, lower or correct. You have {cfg.max_guesses} guesses."
    )


def parse_guess(text: str) -> int | None:
    """The guess in a reply: the last ``<guess>N`` if the reply uses tags, else the last integer in it."""
    tagged = _GUESS_TAG.findall(text)
    if tagged:
        return int(tagged[-1])
    numbers = _INTEGER.findall(text)
    return int(numbers[-1]) if numbers else None


@dataclass(frozen=True)
class Turn:
    """The outcome of one guess."""

    observation: str
    reward: float
    terminated: bool
    state: GameState


def play_turn(reply: str, state: Mapping[str, Any], cfg: NumberGuessingEnvConfig) -> Turn:
    """Apply the assistant's ``reply`` to a game ``state``."""
    # Games made by the generic RL processor carry only {"ground_truth": "<target>"}.
    target = int(state["target"]) if "target" in state else int(state["ground_truth"])
    if not cfg.low <= target <= cfg.high:
        raise ValueError(
            f"game target {target} is outside env.number_guessing's range [{cfg.low}, {cfg.high}]: make the "
            "games with targets in that range or widen it"
        )
    if state.get("solved"):
        return Turn("correct", 0.0, True, dict(state))
    guesses = int(state.get("guesses", 0)) + 1
    guess = parse_guess(reply)
    if guess is None or not cfg.low <= guess <= cfg.high:
        observation, reward = (
            f"invalid guess: reply with a whole number between {cfg.low} and {cfg.high}",
            0.0,
        )
    elif guess == target:
        observation, reward = "correct", 1.0
    elif guess < target:
        observation, reward = "higher", 0.0
    else:
        observation, reward = "lower", 0.0
    solved = reward > 0
    new_state = {**state, "target": target, "guesses": guesses, "last_guess": guess, "solved": solved}
    return Turn(observation, reward, solved or guesses >= cfg.max_guesses, new_state)


@ray.remote
class NumberGuessingEnvironment(EnvironmentInterface[GameState]):
    """The number-guessing game as an environment actor (``create_env("number_guessing", cfg)``).

    Args:
        cfg: The ``env.number_guessing`` section (a plain dict is accepted too).
    """

    def __init__(self, cfg: NumberGuessingEnvConfig | Mapping[str, Any]) -> None:
        self.cfg = (
            cfg
            if isinstance(cfg, NumberGuessingEnvConfig)
            else NumberGuessingEnvConfig.model_validate(dict(cfg))
        )

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[GameState]
    ) -> EnvironmentReturn[GameState]:
        """Answer each conversation's latest guess."""
        check_step_batch(message_log_batch, metadata)
        turns = [
            play_turn(last_assistant_text(log), state, self.cfg)
            for log, state in zip(message_log_batch, metadata, strict=True)
        ]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": t.observation} for t in turns],
            metadata=[t.state for t in turns],
            next_stop_strings=[None if t.terminated else self.cfg.stop_strings for t in turns],
            rewards=torch.tensor([t.reward for t in turns], dtype=torch.float32),
            terminateds=torch.tensor([t.terminated for t in turns], dtype=torch.bool),
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """Success rate and guesses per game; reads ``total_reward`` (or ``rewards``) and ``extra_env_info``."""
        rewards_B = batch_rewards(batch)
        metrics = {"success_rate": (rewards_B >= 1.0).float().mean().item() if rewards_B.numel() else 0.0}
        if "extra_env_info" in batch:
            guesses = [int(s.get("guesses", 0)) for s in batch["extra_env_info"] if isinstance(s, Mapping)]
            if guesses:
                metrics["mean_guesses"] = sum(guesses) / len(guesses)
        return batch, metrics
