"""The number-guessing game (pure turn logic and the actor) and the environment registry."""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from typing import Any

import pytest
import ray
import torch
from pydantic import ValidationError

from nemo_rl.config.env import EnvConfig, NumberGuessingEnvConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.single_process import resolve
from nemo_rl.environments import registry
from nemo_rl.environments.games.number_guessing import (
    game_prompt,
    game_records,
    new_game,
    parse_guess,
    play_turn,
)
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Message
from nemo_rl.environments.registry import (
    InDriverEnvironment,
    create_env,
    get_env_class,
    register_env,
    registered_envs,
    stop_envs,
    wait_envs_started,
)

RAY_TIMEOUT_S = 120


def get(ref: Any) -> Any:
    return resolve(ref, RAY_TIMEOUT_S)


CFG = NumberGuessingEnvConfig(low=1, high=10, max_guesses=3)


@pytest.mark.parametrize(
    ("text", "guess"),
    [
        ("7", 7),
        ("I think 3, no, 5", 5),
        ("<guess>4</guess> not 9", 4),
        ("<guess>2</guess><guess>8", 8),
        ("no idea", None),
    ],
)
def test_parse_guess(text: str, guess: int | None) -> None:
    assert parse_guess(text) == guess


def test_a_game_played_to_the_end() -> None:
    state = new_game(6)
    turn = play_turn("3", state, CFG)
    assert (turn.observation, turn.reward, turn.terminated) == ("higher", 0.0, False)
    turn = play_turn("9", turn.state, CFG)
    assert (turn.observation, turn.reward, turn.terminated) == ("lower", 0.0, False)
    turn = play_turn("6", turn.state, CFG)
    assert (turn.observation, turn.reward, turn.terminated) == ("correct", 1.0, True)
    assert turn.state == {"target": 6, "guesses": 3, "last_guess": 6, "solved": True}
    assert state == {"target": 6, "guesses": 0}  # the input state is not changed


def test_out_of_guesses_and_invalid_replies() -> None:
    turn = play_turn("banana", new_game(2), CFG)
    assert turn.observation.startswith("invalid guess") and not turn.terminated
    turn = play_turn("42", turn.state, CFG)  # outside [1, 10]
    assert turn.observation.startswith("invalid guess") and not turn.terminated
    turn = play_turn("5", turn.state, CFG)
    assert (turn.observation, turn.reward, turn.terminated) == ("lower", 0.0, True)


def test_games_from_the_generic_rl_data_path() -> None:
    records = game_records(20, CFG, seed=0)
    assert records == game_records(20, CFG, seed=0)  # reproducible
    targets = {int(r["expected_answer"]) for r in records}
    assert targets <= set(range(1, 11)) and len(targets) > 1
    assert records[0]["messages"] == [{"role": "user", "content": game_prompt(CFG)}]
    # The processor turns expected_answer into {"ground_truth": ...}: a game that has not started.
    turn = play_turn("4", {"ground_truth": "4"}, CFG)
    assert (turn.observation, turn.reward, turn.terminated) == ("correct", 1.0, True)
    assert turn.state["target"] == 4 and turn.state["guesses"] == 1


def test_targets_outside_the_range_are_rejected() -> None:
    with pytest.raises(ValueError, match="outside"):
        play_turn("5", new_game(11), CFG)
    with pytest.raises(ValidationError, match="must not exceed"):
        NumberGuessingEnvConfig(low=5, high=4)
    assert "between 1 and 10" in game_prompt(CFG) and "3 guesses" in game_prompt(CFG)


def chat(*replies: str) -> list[dict[str, str]]:
    log = [{"role": "user", "content": game_prompt(CFG)}]
    for reply in replies:
        log += [{"role": "assistant", "content": reply}, {"role": "user", "content": "..."}]
    return log[:-1]


def test_number_guessing_actor_multi_turn(ray_cluster: dict[str, float]) -> None:
    env = create_env("number_guessing", EnvConfig(number_guessing=CFG))
    try:
        states: list[dict[str, Any]] = [new_game(4), new_game(8)]
        ret: EnvironmentReturn[Any] = env.call("step", [chat("4"), chat("5")], states).result()
        assert [o["content"] for o in ret.observations] == ["correct", "higher"]
        assert ret.rewards.tolist() == [1.0, 0.0] and ret.terminateds.tolist() == [True, False]
        ret = env.call("step", [chat("5", "8")], [ret.metadata[1]]).result()
        assert ret.rewards.tolist() == [1.0] and ret.metadata[0]["guesses"] == 2

        batch = BatchedDataDict(
            {
                "total_reward": torch.tensor([1.0, 1.0, 0.0, 0.0]),
                "extra_env_info": [{"target": 1, "guesses": g} for g in (1, 2, 3, 3)],
            }
        )
        _, metrics = env.call("global_post_process_and_metrics", batch).result()
        assert metrics == {"success_rate": 0.5, "mean_guesses": 2.25}
    finally:
        stop_envs([env], timeout_s=RAY_TIMEOUT_S)


class EchoEnv(EnvironmentInterface[dict[str, Any]]):
    """Rewards a response by its length; used to check user registration."""

    def __init__(self, cfg: float | dict[str, float]) -> None:
        self.scale = cfg["scale"] if isinstance(cfg, dict) else cfg

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        lengths = [len(str(log[-1]["content"])) * self.scale for log in message_log_batch]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "ok"} for _ in lengths],
            metadata=list(metadata),
            next_stop_strings=[None] * len(lengths),
            rewards=torch.tensor(lengths),
            terminateds=torch.ones(len(lengths), dtype=torch.bool),
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        return batch, {}


def test_registry(ray_cluster: dict[str, float]) -> None:
    assert {"math", "number_guessing"} <= set(registered_envs())
    register_env("echo_test", EchoEnv, overwrite=True)
    with pytest.raises(ValueError, match="already registered"):
        register_env("echo_test", EchoEnv)
    with pytest.raises(TypeError, match="EnvironmentInterface"):
        register_env("not_an_env", dict)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="register_env"):
        get_env_class("no_such_env")
    # Given the whole env section, a user environment gets its env.<name> mapping ({} without one); any other
    # config object is passed as is.
    assert registry._section("echo_test", EnvConfig()) == {}
    assert registry._section("echo_test", 0.5) == 0.5
    env = create_env("echo_test", EnvConfig.model_validate({"echo_test": {"scale": 0.5}}))
    try:
        ret = env.call("step", [[{"role": "assistant", "content": "abcd"}]], [{}]).result()
        assert ret.rewards.tolist() == [2.0]
    finally:
        stop_envs([env], timeout_s=RAY_TIMEOUT_S)

    register_env("guessing_by_path", "nemo_rl.environments.games.number_guessing:NumberGuessingEnvironment")
    assert get_env_class("guessing_by_path") is get_env_class("number_guessing")
    register_env("broken_path", "nemo_rl.environments.no_such_module:Env")
    with pytest.raises(ImportError, match="broken_path"):
        get_env_class("broken_path")


class ShutdownProbe(EchoEnv):
    """EchoEnv that records where it was built and whether it was shut down."""

    def __init__(self, cfg: float | dict[str, float]) -> None:
        super().__init__(cfg)
        self.pid = os.getpid()
        self.closed = False

    def shutdown(self) -> None:
        self.closed = True


def test_in_driver_environments(ray_cluster: dict[str, float]) -> None:
    # A rule-based built-in (wrapped with ray.remote) runs in this process when its section says so, behind the
    # actor-handle surface the algorithms use.
    env = create_env("number_guessing", EnvConfig(number_guessing=CFG.model_copy(update={"in_driver": True})))
    assert isinstance(env, InDriverEnvironment)
    assert type(env.env).__name__ == "NumberGuessingEnvironment" and not isinstance(
        env.env, ray.actor.ActorHandle
    )
    wait_envs_started([env], timeout_s=RAY_TIMEOUT_S)
    ret: EnvironmentReturn[Any] = get(env.step.remote([chat("4"), chat("5")], [new_game(4), new_game(8)]))
    assert [o["content"] for o in ret.observations] == ["correct", "higher"]
    assert ret.rewards.tolist() == [1.0, 0.0] and ret.terminateds.tolist() == [True, False]
    # The call surface of an actor's handle answers the same (one call path for both).
    assert env.call("step", [chat("4")], [new_game(4)]).result().rewards.tolist() == [1.0]
    # An error is raised by the call itself (there is no actor to hold it until it is read).
    with pytest.raises(ValueError):
        env.step.remote([chat("4")], [new_game(4), new_game(8)])
    with pytest.raises(TypeError, match="cannot leave the driver process"):
        pickle.dumps(env)
    stop_envs([env], timeout_s=RAY_TIMEOUT_S)

    # Any registered environment can be asked for in the driver; the default stays an actor.
    register_env("probe_test", ShutdownProbe, overwrite=True)
    probe = create_env("probe_test", 0.5, in_driver=True)
    assert isinstance(probe, InDriverEnvironment) and probe.env.pid == os.getpid()
    assert get(probe.step.remote([[{"role": "assistant", "content": "abcd"}]], [{}])).rewards.tolist() == [
        2.0
    ]
    stop_envs([probe], timeout_s=RAY_TIMEOUT_S)
    assert probe.env.closed
    with pytest.raises(ValueError, match="actor_options"):
        create_env("probe_test", 0.5, in_driver=True, actor_options={"num_cpus": 1})
