"""Rollouts by external agents (``grpo.agent``): one agent per sample drives its own multi-turn loop against
the :class:`~nemo_rl.experience.agent_endpoint.AgentEndpoint` and returns a reward; the rollout is what the
endpoint recorded for each agent's trajectory, in the layout of
:func:`nemo_rl.experience.rollouts.run_multi_turn_rollout`'s (so GRPO's advantages and loss take it as is).

An agent is a Python function (``grpo.agent.function``) or a program (``grpo.agent.command``), given an
:class:`AgentTask` (which names the ``model`` to request). A program reads the task as JSON on stdin, finds ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``
and ``NEMO_RL_TRAJECTORY_ID`` in its environment, and prints its reward as the last line of stdout (a number
or ``{"reward": x}``). An agent that fails (raises, exits non-zero, prints no reward, outlives
``grpo.agent.timeout_s``) gets reward 0 and its sample is not trained on (``agent/failed`` counts them);
when every agent of a step fails, :class:`AgentRolloutError` stops the run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.agent import AgentConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.interfaces import LLMMessage, MessageLog
from nemo_rl.data.llm_message_utils import message_log_length
from nemo_rl.data.prompt_messages import PROMPT_MESSAGES_KEY
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.agent_endpoint import AgentEndpoint
from nemo_rl.experience.agent_trajectories import Trajectory, trajectory_counts
from nemo_rl.experience.rollout_tokens import pack_message_logs
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.tokenizer import eos_token_ids
from nemo_rl.utils.timer import Timer


@dataclasses.dataclass(frozen=True)
class AgentTask:
    """What one agent is given: where to send its requests and the problem to solve."""

    trajectory_id: str
    """Names the trajectory; part of ``base_url``."""

    base_url: str
    """The OpenAI base URL of this trajectory (``OPENAI_BASE_URL``)."""

    api_key: str
    """The run's bearer token (``OPENAI_API_KEY``)."""

    messages: list[dict[str, Any]]
    """The prompt as OpenAI messages."""

    extra_env_info: dict[str, Any]
    """The sample's environment info (e.g. ``ground_truth``) without the messages."""

    task_name: str
    """The sample's task."""

    model: str
    """The model the endpoint serves: what requests send as ``model`` (the policy's ``model_name``)."""

    def to_json(self) -> str:
        """The task as a program reads it on stdin (the token stays out: it is in the environment)."""
        fields = dataclasses.asdict(self)
        fields.pop("api_key")
        return json.dumps(fields)


AgentFunction = Callable[[AgentTask], float]
"""An agent run in the driver: solves the task through ``task.base_url`` and returns its reward."""


@dataclasses.dataclass(frozen=True)
class AgentOutcome:
    """How one agent ended."""

    reward: float = 0.0
    """The reward it returned (0 when it failed)."""

    error: str | None = None
    """Why it failed (``None``: it returned a reward)."""


def start_agent_endpoint(
    cfg: AgentConfig,
    policy: PolicyConfig,
    generation: GenerationInterface,
    tokenizer: PreTrainedTokenizerBase,
) -> AgentEndpoint:
    """Start the endpoint serving ``generation`` with ``policy``'s sampling settings and length budget."""
    model_dir = Path(policy.model_name)
    stop_ids = [*eos_token_ids(tokenizer, model_dir if model_dir.is_dir() else None)]
    stop_ids += policy.generation.stop_token_ids or []
    endpoint = AgentEndpoint(
        generation,
        tokenizer,
        cfg,
        policy.generation,
        max_seq_len=policy.max_total_sequence_length,
        stop_token_ids=stop_ids,
        model_name=policy.model_name,
    )
    endpoint.start()
    return endpoint


def load_agent_function(path: str) -> AgentFunction:
    """The function ``module:function`` or ``path/to/file.py:function`` (``grpo.agent.function``)."""
    module_name, _, attr = path.rpartition(":")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or spec.loader is None or not Path(module_name).is_file():
                raise ImportError(f"no Python file {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError) as err:
        raise UserError(
            f"grpo.agent.function={path!r} cannot be loaded ({err}); give module:function or file.py:function"
        ) from err
    if not callable(fn):
        raise UserError(f"grpo.agent.function={path!r} is not callable")
    return fn


def call_with_timeout(fn: AgentFunction, task: AgentTask, timeout_s: float) -> AgentOutcome:
    """Run a function agent in a thread of its own; one still running after ``timeout_s`` is abandoned (its
    trajectory is closed, so its further requests are refused)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["reward"] = float(fn(task))
        except BaseException as err:
            box["error"] = f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=target, name=f"agent-{task.trajectory_id[:8]}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return AgentOutcome(error=f"timed out after {timeout_s:g} s (grpo.agent.timeout_s)")
    if "error" in box:
        return AgentOutcome(error=box["error"])
    return AgentOutcome(reward=box["reward"])


def run_program(command: Sequence[str], task: AgentTask, timeout_s: float) -> AgentOutcome:
    """Run a program agent; it and every process it started are killed after ``timeout_s``."""
    env = {
        **os.environ,
        "OPENAI_BASE_URL": task.base_url,
        "OPENAI_API_KEY": task.api_key,
        "NEMO_RL_TRAJECTORY_ID": task.trajectory_id,
    }
    try:
        process = subprocess.Popen(
            list(command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            start_new_session=True,
        )
    except OSError as err:
        return AgentOutcome(error=f"cannot start {command[0]!r}: {err}")
    try:
        stdout, stderr = process.communicate(task.to_json(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        return AgentOutcome(error=f"timed out after {timeout_s:g} s (grpo.agent.timeout_s)")
    if process.returncode != 0:
        tail = stderr.strip().splitlines()[-1:] or ["no stderr"]
        return AgentOutcome(error=f"exited with status {process.returncode}: {tail[0]}")
    return parse_reward(stdout)


def parse_reward(stdout: str) -> AgentOutcome:
    """The reward a program printed last: a number, or a JSON object with a numeric ``reward``."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return AgentOutcome(error="printed no reward")
    try:
        value = json.loads(lines[-1])
    except json.JSONDecodeError:
        return AgentOutcome(error=f"last line is not a reward: {lines[-1][:80]!r}")
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return AgentOutcome(error=f"last line is not a reward: {lines[-1][:80]!r}")
    return AgentOutcome(reward=float(value))


def agent_runner(cfg: AgentConfig) -> Callable[[AgentTask], AgentOutcome]:
    """How ``grpo.agent`` runs one agent."""
    if cfg.function is not None:
        fn = load_agent_function(cfg.function)
        return lambda task: call_with_timeout(fn, task, cfg.timeout_s)
    assert cfg.command is not None  # the config requires one of them
    command = list(cfg.command)
    return lambda task: run_program(command, task, cfg.timeout_s)


def agent_tasks(endpoint: AgentEndpoint, batch: BatchedDataDict[Any]) -> list[AgentTask]:
    """One task per sample of ``batch``, each with a new trajectory id."""
    tasks = []
    for info, task_name in zip(batch["extra_env_info"], batch["task_name"], strict=True):
        info = dict(info or {})
        messages = info.pop(PROMPT_MESSAGES_KEY, None)
        if messages is None:
            raise UserError(
                "grpo.agent gives agents the prompt as messages, which these samples lack (extra_env_info has no "
                f"{PROMPT_MESSAGES_KEY!r}): pass grpo.setup a ProcessedDataset (it keeps them), or process the "
                "data with nemo_rl.data.prompt_messages.KeepPromptMessages"
            )
        trajectory_id = uuid.uuid4().hex
        tasks.append(
            AgentTask(
                trajectory_id=trajectory_id,
                base_url=endpoint.base_url(trajectory_id),
                api_key=endpoint.token,
                messages=list(messages),
                extra_env_info=info,
                task_name=str(task_name),
                model=endpoint.model_name,
            )
        )
    return tasks


class AgentRolloutError(UserError):
    """Too many agents of a step failed (every one, or more than ``grpo.agent.max_failed_fraction``): one line
    quoting the first failure, exit status 2 (the agent or its settings need fixing, not the run)."""


def one_line(text: str) -> str:
    """``text`` on one line: a traceback's or stderr's lines joined with `` | ``."""
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def run_agent_rollout(
    endpoint: AgentEndpoint,
    input_batch: BatchedDataDict[Any],
    tokenizer: PreTrainedTokenizerBase,
    cfg: AgentConfig,
    *,
    timer: Timer | None = None,
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    """Run one agent per sample of ``input_batch`` against ``endpoint`` (its generation weights must be
    current) and return the rolled-out batch and its metrics, as
    :func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` does: ``message_log`` is each trajectory's
    recorded tokens (sampled tokens as ``assistant`` messages with their log-probs, the rest as ``user``),
    ``total_reward`` the agents' rewards, ``loss_multiplier`` 0 for failed agents."""
    tasks = agent_tasks(endpoint, input_batch)
    ids = [task.trajectory_id for task in tasks]
    runner = agent_runner(cfg)

    def run_one(task: AgentTask) -> AgentOutcome:
        with endpoint.agent_running():
            return runner(task)

    calls_before, rows_before = endpoint.generation_calls
    refused_before = endpoint.num_refused
    endpoint.open(ids)
    try:
        with timer.time("generation") if timer else contextlib.nullcontext():
            workers = min(cfg.max_concurrent_agents, len(tasks))
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="agent-runner") as pool:
                outcomes = list(pool.map(run_one, tasks))
    finally:
        trajectories = endpoint.close(ids)
    calls, rows = endpoint.generation_calls
    metrics = {f"agent/{name}": value for name, value in trajectory_counts(trajectories).items()} | {
        "agent/failed": float(sum(o.error is not None for o in outcomes)),
        "agent/refused_requests": float(endpoint.num_refused - refused_before),
        "agent/generation_calls": float(calls - calls_before),
        "agent/mean_requests_per_call": (rows - rows_before) / max(calls - calls_before, 1),
    }
    failures = [one_line(o.error) for o in outcomes if o.error is not None]
    if failures and cfg.too_many_failed(len(failures), len(outcomes)):
        # With every row failed the step would train on nothing (loss multipliers of 0), and every later one too.
        share = "all" if len(failures) == len(outcomes) else f"{len(failures)} of"
        raise AgentRolloutError(
            f"{share} {len(outcomes)} agents of this step failed (first: {failures[0]}); check grpo.agent "
            "(its command or function, timeout_s) and run one agent by hand against the endpoint "
            f"(grpo.agent.max_failed_fraction={cfg.max_failed_fraction:g} bounds the failures a step tolerates)"
        )
    if failures:
        print(f"[agent] {len(failures)} of {len(outcomes)} agents failed; first: {failures[0]}", flush=True)
    batch = rollout_batch(
        input_batch, ids, [trajectories.get(i, Trajectory()) for i in ids], outcomes, tokenizer
    )
    return batch, metrics | rollout_metrics(batch)


def rollout_batch(
    input_batch: BatchedDataDict[Any],
    trajectory_ids: Sequence[str],
    trajectories: Sequence[Trajectory],
    outcomes: Sequence[AgentOutcome],
    tokenizer: PreTrainedTokenizerBase,
) -> BatchedDataDict[Any]:
    """The rolled-out batch: ``input_batch`` plus each trajectory's ``trajectory_id``, ``message_log``, its
    token tensors (:func:`~nemo_rl.experience.rollout_tokens.pack_message_logs`), ``total_reward``,
    ``truncated``, ``num_turns``, ``generated_tokens``, ``answers`` (``None``), and ``loss_multiplier`` zeroed for failed agents and
    trajectories that sampled nothing."""
    logs: list[MessageLog] = []
    trained: list[bool] = []
    for trajectory, outcome, prompt_log in zip(
        trajectories, outcomes, input_batch["message_log"], strict=True
    ):
        if trajectory.turns:
            logs.append(trajectory.message_log(tokenizer))
        else:  # the agent sampled nothing: its prompt and an empty response, not trained on
            empty = LLMMessage(role="assistant", content="", token_ids=torch.zeros(0, dtype=torch.long))
            empty["generation_logprobs"] = torch.zeros(0)  # type: ignore[typeddict-unknown-key]
            logs.append([*prompt_log, empty])
        trained.append(outcome.error is None and bool(trajectory.turns))
    result = BatchedDataDict[Any](input_batch.copy())
    result.pop("stop_strings", None)
    result["trajectory_id"] = list(trajectory_ids)
    result["message_log"] = logs
    result.update(pack_message_logs(logs, int(tokenizer.pad_token_id)))
    result["total_reward"] = torch.tensor([o.reward for o in outcomes], dtype=torch.float32)
    result["truncated"] = torch.tensor([bool(t.turns) and t.turns[-1].truncated for t in trajectories])
    result["num_turns"] = torch.tensor([len(t.turns) for t in trajectories], dtype=torch.long)
    result["generated_tokens"] = torch.tensor(
        [sum(len(turn.sampled_ids) for turn in t.turns) for t in trajectories], dtype=torch.long
    )
    result["loss_multiplier"] = input_batch["loss_multiplier"].float() * torch.tensor(
        trained, dtype=torch.float32
    )
    result["answers"] = [None] * len(logs)
    return result


def rollout_metrics(batch: BatchedDataDict[Any]) -> dict[str, float]:
    """The rollout metrics every GRPO rollout reports (see ``run_multi_turn_rollout``)."""
    size = len(batch["message_log"])
    return {
        "mean_gen_tokens_per_sample": float(batch["generated_tokens"].float().mean()),
        "truncation_rate": float(batch["truncated"].float().mean()),
        "mean_turns_per_sample": float(batch["num_turns"].float().mean()),
        "mean_total_reward": float(batch["total_reward"].mean()),
        "mean_conversation_tokens": sum(message_log_length(log) for log in batch["message_log"]) / size,
    }
