"""Environment actors that heal: killed or frozen during a call, an actor is replaced and the call answered by
the replacement, within ``env.max_actor_replacements``; past it, one line ends the run."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from pydantic import ValidationError

from nemo_rl.config.env import EnvConfig
from nemo_rl.config.errors import UserError
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.healing import EnvironmentActorError, HealingEnvironment, ReplacementBudget
from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Message
from nemo_rl.environments.registry import (
    as_env_handle,
    check_env_sections,
    create_env,
    register_env,
    stop_envs,
)
from nemo_rl.experience.validation import environment_metrics

RAY_TIMEOUT_S = 120
NAME = "fragile_test"


class FragileEnv(EnvironmentInterface[dict[str, Any]]):
    """Answers with its process id as the reward. ``die``: ``"never"``; ``"once"``: the first call of any
    actor of this config kills its process (a marker file tells the replacement not to); ``"always"``."""

    def __init__(self, cfg: dict[str, str]) -> None:
        self.die = cfg["die"]
        self.marker = Path(cfg["marker"])

    def pid(self) -> int:
        return os.getpid()

    def _maybe_die(self) -> None:
        if self.die == "always" or (self.die == "once" and not self.marker.exists()):
            self.marker.touch()
            os._exit(1)

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[dict[str, Any]]
    ) -> EnvironmentReturn[dict[str, Any]]:
        self._maybe_die()
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "ok"} for _ in metadata],
            metadata=list(metadata),
            next_stop_strings=[None] * len(metadata),
            rewards=torch.full((len(metadata),), float(os.getpid())),
            terminateds=torch.ones(len(metadata), dtype=torch.bool),
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        self._maybe_die()
        return batch, {"pid": float(os.getpid())}


def fragile_env(tmp_path: Path, die: str, **healing: float) -> HealingEnvironment:
    register_env(NAME, FragileEnv, overwrite=True)
    cfg = EnvConfig.model_validate({NAME: {"die": die, "marker": str(tmp_path / "died")}, **healing})
    env = create_env(NAME, cfg)
    assert isinstance(env, HealingEnvironment)
    return env


def step(env: Any) -> EnvironmentReturn[Any]:
    return env.call("step", [[{"role": "assistant", "content": "x"}]], [{}]).result()


def pid_of(actor: Any) -> int:
    return int(ray.get(actor.pid.remote(), timeout=RAY_TIMEOUT_S))


@pytest.fixture
def envs() -> Iterator[list[HealingEnvironment]]:
    started: list[HealingEnvironment] = []
    yield started
    stop_envs(started, timeout_s=RAY_TIMEOUT_S)


def test_healing_keys_and_the_budget() -> None:
    cfg = EnvConfig.model_validate({"max_actor_replacements": 0, "actor_call_timeout_s": 5, "my_env": {}})
    assert cfg.user_sections() == ["my_env"] and cfg.max_actor_replacements == 0
    assert "max_actor_replacements" not in EnvConfig.schema_sections()
    with pytest.raises(UserError, match=r"env\.my_env"):  # the user section is checked, the keys are not
        check_env_sections(cfg)
    with pytest.raises(ValidationError):
        EnvConfig.model_validate({"max_actor_replacements": -1})
    budget = ReplacementBudget(2)
    assert [budget.take() for _ in range(3)] == [True, True, False] and budget.used == 2


def test_actor_killed_during_a_call_is_replaced_and_the_call_answered(
    ray_cluster: dict[str, float], tmp_path: Path, envs: list[HealingEnvironment], capsys: Any
) -> None:
    env = fragile_env(tmp_path, "once", max_actor_replacements=2)
    envs.append(env)
    first = env.actor
    call = env.call("step", [[{"role": "assistant", "content": "x"}]], [{}])
    reward = int(call.result().rewards[0])
    assert call.replacements == 1 and env.budget.used == 1 and env.actor is not first
    assert reward == pid_of(env.actor)  # answered by the replacement
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"WARNING: environment '{NAME}' actor died during step (ActorDiedError")
    assert line.endswith("; replaced (1 of 2 replacements)")
    # The replacement serves later calls (the metrics of a batch included) without another replacement.
    assert environment_metrics({NAME: env}, BatchedDataDict({"task_name": [NAME]})) == {
        f"{NAME}/pid": float(reward)
    }
    assert env.budget.used == 1
    with pytest.raises(TypeError, match=r"pass env\.actor"):  # its replacements happen in the driver
        pickle.dumps(env)


def test_frozen_actor_is_detected_within_the_timeout_and_replaced(
    ray_cluster: dict[str, float], tmp_path: Path, envs: list[HealingEnvironment], capsys: Any
) -> None:
    env = fragile_env(tmp_path, "never", actor_call_timeout_s=3.0)
    envs.append(env)
    frozen = pid_of(env.actor)
    os.kill(frozen, signal.SIGSTOP)
    try:
        start = time.monotonic()
        call = env.call("step", [[{"role": "assistant", "content": "x"}]], [{}])
        reward = int(call.result().rewards[0])
        elapsed_s = time.monotonic() - start
    finally:
        with contextlib.suppress(ProcessLookupError):  # never leave a stopped process behind
            os.kill(frozen, signal.SIGKILL)
    assert call.replacements == 1 and reward == pid_of(env.actor) != frozen
    assert 3.0 <= elapsed_s < 3.0 + 60.0  # the timeout, then a replacement's start
    assert (
        "actor did not answer step within 3 s (hung); replaced (1 of 3 replacements)"
        in capsys.readouterr().out
    )


def test_past_the_limit_the_call_ends_with_one_line(
    ray_cluster: dict[str, float], tmp_path: Path, envs: list[HealingEnvironment]
) -> None:
    env = fragile_env(tmp_path, "always", max_actor_replacements=0)
    envs.append(env)
    with pytest.raises(EnvironmentActorError) as raised:
        step(env)
    message = str(raised.value)
    assert isinstance(raised.value, UserError) and "\n" not in message  # one line, exit 2 under run_cli
    assert message.startswith(f"environment '{NAME}' actor died during step (ActorDiedError")
    assert "no environment actor replacement left (env.max_actor_replacements=0, all used)" in message
    assert env.budget.used == 0
    # Once stopped (the run ending), a call that finds its actor dead does not start another.
    stop_envs([env], timeout_s=RAY_TIMEOUT_S)
    with pytest.raises(EnvironmentActorError, match="it was stopped"):
        step(env)


def test_an_actor_the_caller_started_is_not_replaced(ray_cluster: dict[str, float], tmp_path: Path) -> None:
    actor = ray.remote(FragileEnv).remote({"die": "always", "marker": str(tmp_path / "died")})
    try:
        with pytest.raises(EnvironmentActorError, match="the caller started it"):
            step(as_env_handle(actor, NAME))
    finally:
        ray.kill(actor)
