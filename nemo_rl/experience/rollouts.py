"""Rollouts: generate, let the environments respond, append their observations, repeat.

A rollout works on a batch of message logs (one per sample; GRPO repeats each prompt
``num_generations_per_prompt`` times before calling it). Each turn:

1. the still-active logs are flattened into right-padded prompts and sampled by the generation backend;
2. each response is cut to the sample's remaining token budget (``max_seq_len``) and appended to its log as an
   assistant message that also carries the sampler's log-probs;
3. responses of a task with tools (``task_to_tools``) that call tools get the results appended as a tool
   turn and skip the environment this turn (:mod:`nemo_rl.experience.tool_turns`);
4. the environments (grouped by ``task_name``) score the other responses and say which samples are finished;
5. unfinished samples get the environment's observation appended as the next user turn.

The loop ends when every sample is terminated, out of budget, or ``max_rollout_turns`` is reached (tool turns
count against it: a sample still calling tools in the last turn is scored as it stands). Rewards of all turns
are summed per sample.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import ray
import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.data.interfaces import LLMMessage, MessageLog
from nemo_rl.data.llm_message_utils import message_log_length, message_logs_to_batch
from nemo_rl.data.routed_experts import ROUTED_EXPERTS_KEY, attach_routed_experts
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import EnvironmentReturn
from nemo_rl.environments.tools import TaskTools
from nemo_rl.experience.tool_turns import rendered_continuation, run_tool_turns
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.utils.timer import Timer

# A dummy exchange to render a new turn after: its rendering is a prefix of the rendering with the new turn,
# so the difference is exactly the new turn's span (role header, content, and the next generation prompt).
_CONTEXT_FOR_RENDERING = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def render_observation_turn(tokenizer: PreTrainedTokenizerBase, content: str) -> str:
    """Text of a user turn carrying ``content`` followed by the assistant's generation prompt."""
    return rendered_continuation(
        tokenizer,
        _CONTEXT_FOR_RENDERING,
        [{"role": "user", "content": content}],
        (),
        what="multi-turn observations",
    )


@dataclasses.dataclass
class _SampleState:
    log: MessageLog
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    turns: int = 0
    generated_tokens: int = 0
    stop_strings: list[str] | None = None
    answer: str | None = None
    tool_calls: int = 0
    malformed_tool_calls: int = 0
    tool_errors: int = 0


_StepResult = tuple[float, bool, str | None, list[str] | None, Any, str | None]
"""An environment's answer for one sample: (reward, terminated, observation, next stop strings, info, answer)."""


def _env_step(
    task_to_env: Mapping[str, Any],
    states: list[_SampleState],
    active: list[int],
    task_names: list[str],
    env_info: list[Any],
    timeout_s: float,
) -> dict[int, _StepResult]:
    """Step every environment on its active samples; returns per-sample (reward, terminated, obs, stops, info,
    answer)."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for i in active:
        by_task[task_names[i]].append(i)
    missing = sorted(set(by_task) - set(task_to_env))
    if missing:
        raise KeyError(f"no environment registered for task(s) {missing}; known tasks: {sorted(task_to_env)}")
    futures = {
        task: task_to_env[task].step.remote([states[i].log for i in idx], [env_info[i] for i in idx])
        for task, idx in by_task.items()
    }
    results: dict[int, _StepResult] = {}
    for task, ref in futures.items():
        ret: EnvironmentReturn = ray.get(ref, timeout=timeout_s)
        for j, i in enumerate(by_task[task]):
            observation = ret.observations[j]
            results[i] = (
                float(ret.rewards[j]),
                bool(ret.terminateds[j]),
                observation["content"] if observation else None,
                ret.next_stop_strings[j],
                ret.metadata[j],
                ret.answers[j] if ret.answers is not None else None,
            )
    return results


def run_multi_turn_rollout(
    generation: GenerationInterface,
    input_batch: BatchedDataDict[Any],
    tokenizer: PreTrainedTokenizerBase,
    task_to_env: Mapping[str, Any],
    *,
    max_seq_len: int,
    max_rollout_turns: int,
    greedy: bool = False,
    env_timeout_s: float = 600.0,
    timer: Timer | None = None,
    task_to_tools: Mapping[str, TaskTools] | None = None,
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    """Roll out every sample of ``input_batch`` and return the finished batch and rollout metrics.

    Args:
        generation: The generation backend (its weights must be current).
        input_batch: ``message_log``, ``extra_env_info`` and ``task_name`` per sample (logs are copied, not
            changed); optionally ``stop_strings`` of each sample's first response.
        tokenizer: The policy's tokenizer (pad id, decoding, rendering observations).
        task_to_env: Environment actor per task name.
        max_seq_len: Token budget of a whole conversation (prompt, responses and observations).
        max_rollout_turns: Most generate / environment turns per sample.
        greedy: Decode greedily (validation) instead of sampling.
        env_timeout_s: Longest wait for one environment step.
        timer: Accumulates the time spent sampling (``generation``), running tools (``tool_calls``) and
            scoring (``reward``).
        task_to_tools: The tools of the tasks that have some (``build_task_tools``); only their responses
            are parsed for tool calls.

    Returns:
        The input batch plus ``message_log`` (with the new turns), ``total_reward`` [B], ``truncated`` [B]
        bool, ``num_turns`` [B], ``generated_tokens`` [B] (summed over turns), ``num_tool_calls`` [B],
        ``extra_env_info`` (as updated by the environments), ``answers`` (the answer the environment
        extracted from each sample's last response, ``None`` where it gave none); and metrics (with tools:
        ``mean_tool_calls_per_sample``, ``malformed_tool_call_rate`` and ``tool_error_rate``, the last two
        per call).
    """
    pad_token_id = int(
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    logs: list[MessageLog] = input_batch["message_log"]
    first_stops = input_batch["stop_strings"] if "stop_strings" in input_batch else [None] * len(logs)
    states = [
        _SampleState(log=copy.copy(log), stop_strings=stops)
        for log, stops in zip(logs, first_stops, strict=True)
    ]
    task_names: list[str] = list(input_batch["task_name"])
    env_info: list[Any] = list(input_batch["extra_env_info"])
    turn_metrics: dict[str, float] = {}

    for turn in range(max_rollout_turns):
        active = [i for i, s in enumerate(states) if not s.done]
        if not active:
            break
        gen_input = message_logs_to_batch(
            [states[i].log for i in active], pad_token_id=pad_token_id, train_roles=()
        )
        if any(states[i].stop_strings for i in active):
            gen_input["stop_strings"] = [states[i].stop_strings for i in active]
        with timer.time("generation") if timer else contextlib.nullcontext():
            output = generation.generate(gen_input, greedy=greedy)

        turn_tokens = _append_responses(states, active, gen_input, output, tokenizer, max_seq_len)
        out_of_turns = turn == max_rollout_turns - 1
        calling_tools: set[int] = set()
        if task_to_tools and not out_of_turns:
            with timer.time("tool_calls") if timer else contextlib.nullcontext():
                calling_tools = run_tool_turns(
                    states, active, task_names, task_to_tools, tokenizer, max_seq_len
                )
        scored = [i for i in active if i not in calling_tools]
        with timer.time("reward") if timer else contextlib.nullcontext():
            results = _env_step(task_to_env, states, scored, task_names, env_info, env_timeout_s)
        _apply_env_results(states, scored, results, env_info, tokenizer, max_seq_len, out_of_turns)

        turn_metrics[f"turn_{turn + 1}/active_samples"] = float(len(active))
        turn_metrics[f"turn_{turn + 1}/mean_gen_tokens"] = turn_tokens / len(active)

    return _finished_batch(input_batch, states, env_info, turn_metrics, bool(task_to_tools))


def _tool_metrics(states: list[_SampleState]) -> dict[str, float]:
    """Tool calls per sample, and the shares of calls that were malformed or answered with an error."""
    num_calls = sum(s.tool_calls for s in states)
    return {
        "mean_tool_calls_per_sample": num_calls / len(states),
        "malformed_tool_call_rate": sum(s.malformed_tool_calls for s in states) / max(num_calls, 1),
        "tool_error_rate": sum(s.tool_errors for s in states) / max(num_calls, 1),
    }


def _append_responses(
    states: list[_SampleState],
    active: list[int],
    gen_input: BatchedDataDict[Any],
    output: BatchedDataDict[Any],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
) -> int:
    """Append each active sample's response (cut to its remaining token budget) with its sampling log-probs;
    returns the tokens kept."""
    turn_tokens = 0
    for j, i in enumerate(active):
        state = states[i]
        prompt_len = int(gen_input["input_lengths"][j])
        gen_len = int(output["generation_lengths"][j])
        budget = max_seq_len - message_log_length(state.log)
        keep = min(gen_len, max(budget, 0))
        ids = output["output_ids"][j, prompt_len : prompt_len + keep].clone()
        logprobs = output["logprobs"][j, prompt_len : prompt_len + keep].clone().float()
        message = LLMMessage(
            role="assistant", content=str(tokenizer.decode(ids, skip_special_tokens=False)), token_ids=ids
        )
        message["generation_logprobs"] = logprobs  # type: ignore[typeddict-unknown-key]
        state.log.append(message)
        if ROUTED_EXPERTS_KEY in output:
            attach_routed_experts(state.log, output[ROUTED_EXPERTS_KEY][j])
        state.turns += 1
        state.generated_tokens += keep
        turn_tokens += keep
        if keep < gen_len or bool(output["truncated"][j]):
            state.truncated = True
    return turn_tokens


def _apply_env_results(
    states: list[_SampleState],
    active: list[int],
    results: dict[int, _StepResult],
    env_info: list[Any],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    out_of_turns: bool,
) -> None:
    """Add each active sample's reward and end it, or append the environment's observation as the next user
    turn when it fits the budget."""
    for i in active:
        state = states[i]
        reward, terminated, observation, stop_strings, info, answer = results[i]
        state.reward += reward
        state.answer = answer
        env_info[i] = info
        state.stop_strings = stop_strings
        if terminated or state.truncated or out_of_turns or observation is None:
            state.done = True
            continue
        text = render_observation_turn(tokenizer, observation)
        obs_ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
        if message_log_length(state.log) + obs_ids.numel() >= max_seq_len:
            state.truncated = True
            state.done = True
            continue
        state.log.append(LLMMessage(role="user", content=text, token_ids=obs_ids))


def _finished_batch(
    input_batch: BatchedDataDict[Any],
    states: list[_SampleState],
    env_info: list[Any],
    turn_metrics: dict[str, float],
    with_tools: bool,
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    """The rolled-out batch (see :func:`run_multi_turn_rollout`) and its metrics (``with_tools``: the tool
    metrics too)."""
    batch_size = len(states)
    result = BatchedDataDict(input_batch.copy())
    # An input of the first turn only; dropping it keeps rollouts of batches with and without it joinable.
    result.pop("stop_strings", None)
    result["message_log"] = [s.log for s in states]
    result["extra_env_info"] = env_info
    result["total_reward"] = torch.tensor([s.reward for s in states], dtype=torch.float32)
    result["truncated"] = torch.tensor([s.truncated for s in states], dtype=torch.bool)
    result["num_turns"] = torch.tensor([s.turns for s in states], dtype=torch.long)
    result["generated_tokens"] = torch.tensor([s.generated_tokens for s in states], dtype=torch.long)
    result["num_tool_calls"] = torch.tensor([s.tool_calls for s in states], dtype=torch.long)
    result["answers"] = [s.answer for s in states]
    metrics = {
        "mean_gen_tokens_per_sample": sum(s.generated_tokens for s in states) / batch_size,
        "truncation_rate": sum(s.truncated for s in states) / batch_size,
        "mean_turns_per_sample": sum(s.turns for s in states) / batch_size,
        "mean_total_reward": float(result["total_reward"].mean()),
        "mean_conversation_tokens": sum(message_log_length(s.log) for s in states) / batch_size,
        **turn_metrics,
        **(_tool_metrics(states) if with_tools else {}),
    }
    return result, metrics
