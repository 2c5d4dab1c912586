"""Rollouts: generate, let the environments respond, append their observations, repeat.

A rollout works on a batch of message logs (one per sample; GRPO repeats each prompt
``num_generations_per_prompt`` times before calling it) and keeps every conversation as a row of token tensors
beside its log (:class:`~nemo_rl.experience.rollout_tokens.RolloutTokens`). Each turn:

1. the still-active rows are sampled by the generation backend, as right-padded prompts (with their images,
   ``pixel_values`` and ``image_grid_thw`` per row, for a vision-language model's prompts);
2. each response is cut to the sample's remaining token budget (``max_seq_len``) and copied from the engine's
   output into the rows with the sampler's log-probs (and routing), then decoded into an assistant message;
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

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.data.collate_fn import IMAGE_KEYS
from nemo_rl.data.interfaces import LLMMessage, MessageLog
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import EnvironmentReturn
from nemo_rl.environments.registry import as_env_handle
from nemo_rl.environments.tools import TaskTools
from nemo_rl.experience.rollout_tokens import RolloutTokens
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


@dataclasses.dataclass
class _Rollout:
    """A rollout in progress: each sample's state and message log, and the token tensors of all of them."""

    states: list[_SampleState]
    tokens: RolloutTokens
    task_names: list[str]
    env_info: list[Any]
    images: dict[str, list[Any]]
    """Each row's image tensors under :data:`~nemo_rl.data.collate_fn.IMAGE_KEYS` (multimodal prompts only):
    every generation call of the row reads them with its tokens."""
    env_actor_replacements: int = 0
    """Environment actors replaced during the rollout's steps (they died or hung)."""

    @classmethod
    def start(cls, input_batch: BatchedDataDict[Any], tokenizer: PreTrainedTokenizerBase) -> _Rollout:
        """The rollout of ``input_batch``'s prompts (their logs copied, not changed)."""
        pad_token_id = int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        logs: list[MessageLog] = input_batch["message_log"]
        first_stops = input_batch["stop_strings"] if "stop_strings" in input_batch else [None] * len(logs)
        return cls(
            states=[
                _SampleState(log=copy.copy(log), stop_strings=stops)
                for log, stops in zip(logs, first_stops, strict=True)
            ],
            tokens=RolloutTokens.from_prompts(logs, pad_token_id),
            task_names=list(input_batch["task_name"]),
            env_info=list(input_batch["extra_env_info"]),
            images={key: list(input_batch[key]) for key in IMAGE_KEYS if key in input_batch},
        )

    def active(self) -> list[int]:
        """The samples not finished yet."""
        return [i for i, s in enumerate(self.states) if not s.done]

    def generation_input(self, active: list[int]) -> BatchedDataDict[Any]:
        """The prompts of the next generation call: the active conversations so far, their images and their
        stop strings."""
        gen_input = self.tokens.generation_input(active)
        for key, values in self.images.items():
            gen_input[key] = [values[i] for i in active]
        if any(self.states[i].stop_strings for i in active):
            gen_input["stop_strings"] = [self.states[i].stop_strings for i in active]
        return gen_input

    def length(self, i: int) -> int:
        """Tokens of sample ``i``'s conversation so far."""
        return int(self.tokens.lengths_B[i])


_StepResult = tuple[float, bool, str | None, list[str] | None, Any, str | None]
"""An environment's answer for one sample: (reward, terminated, observation, next stop strings, info, answer)."""


def _timed(timer: Timer | None, name: str) -> contextlib.AbstractContextManager[object]:
    return timer.time(name) if timer else contextlib.nullcontext()


def _env_step(task_to_env: Mapping[str, Any], rollout: _Rollout, active: list[int]) -> dict[int, _StepResult]:
    """Step every environment on its active samples; returns per-sample (reward, terminated, obs, stops, info,
    answer). Environment actors replaced meanwhile (having died or hung) are counted in ``rollout``."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for i in active:
        by_task[rollout.task_names[i]].append(i)
    missing = sorted(set(by_task) - set(task_to_env))
    if missing:
        raise KeyError(f"no environment registered for task(s) {missing}; known tasks: {sorted(task_to_env)}")
    states, env_info = rollout.states, rollout.env_info
    calls = {
        task: as_env_handle(task_to_env[task], task).call(
            "step", [states[i].log for i in idx], [env_info[i] for i in idx]
        )
        for task, idx in by_task.items()
    }
    results: dict[int, _StepResult] = {}
    for task, call in calls.items():
        ret: EnvironmentReturn = call.result()
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
    rollout.env_actor_replacements += sum(call.replacements for call in calls.values())
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
    timer: Timer | None = None,
    task_to_tools: Mapping[str, TaskTools] | None = None,
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    """Roll out every sample of ``input_batch`` and return the finished batch and rollout metrics.

    Args:
        generation: The generation backend (its weights must be current).
        input_batch: ``message_log``, ``extra_env_info`` and ``task_name`` per sample (logs are copied, not
            changed); optionally ``stop_strings`` of each sample's first response.
        tokenizer: The policy's tokenizer (pad id, decoding, rendering observations).
        task_to_env: Environment per task name; one that dies or hangs during a step is replaced
            (:mod:`nemo_rl.environments.healing`).
        max_seq_len: Token budget of a whole conversation (prompt, responses and observations).
        max_rollout_turns: Most generate / environment turns per sample.
        greedy: Decode greedily (validation) instead of sampling.
        timer: Accumulates the time spent sampling (``generation``), running tools (``tool_calls``) and
            scoring (``reward``).
        task_to_tools: The tools of the tasks that have some (``build_task_tools``); only their responses
            are parsed for tool calls.

    Returns:
        The input batch plus ``message_log`` (with the new turns), the conversations' token tensors under
        :data:`~nemo_rl.experience.rollout_tokens.TOKEN_KEYS` (what the training batch is built from, see
        :mod:`nemo_rl.experience.train_batch`), ``total_reward`` [B], ``truncated`` [B] bool, ``num_turns``
        [B], ``generated_tokens`` [B] (summed over turns), ``num_tool_calls`` [B], ``extra_env_info`` (as
        updated by the environments), ``answers`` (the answer the environment extracted from each sample's
        last response, ``None`` where it gave none); and metrics (``env/replaced_actors``: environment actors
        replaced during the rollout, when any; with tools: ``mean_tool_calls_per_sample``,
        ``malformed_tool_call_rate`` and ``tool_error_rate``, the last two per call).
    """
    rollout = _Rollout.start(input_batch, tokenizer)
    turn_metrics: dict[str, float] = {}
    for turn in range(max_rollout_turns):
        active = rollout.active()
        if not active:
            break
        out_of_turns = turn == max_rollout_turns - 1
        with _timed(timer, "generation"):
            output = generation.generate(rollout.generation_input(active), greedy=greedy)
        turn_tokens = _append_responses(rollout, active, output, tokenizer, max_seq_len)
        calling_tools: set[int] = set()
        if task_to_tools and not out_of_turns:
            with _timed(timer, "tool_calls"):
                calling_tools = _tool_turns(rollout, active, task_to_tools, tokenizer, max_seq_len)
        scored = [i for i in active if i not in calling_tools]
        with _timed(timer, "reward"):
            results = _env_step(task_to_env, rollout, scored)
        _apply_env_results(rollout, scored, results, tokenizer, max_seq_len, out_of_turns)
        turn_metrics[f"turn_{turn + 1}/active_samples"] = float(len(active))
        turn_metrics[f"turn_{turn + 1}/mean_gen_tokens"] = turn_tokens / len(active)
    return _finished_batch(input_batch, rollout, turn_metrics, bool(task_to_tools))


def _tool_metrics(states: list[_SampleState]) -> dict[str, float]:
    """Tool calls per sample, and the shares of calls that were malformed or answered with an error."""
    num_calls = sum(s.tool_calls for s in states)
    return {
        "mean_tool_calls_per_sample": num_calls / len(states),
        "malformed_tool_call_rate": sum(s.malformed_tool_calls for s in states) / max(num_calls, 1),
        "tool_error_rate": sum(s.tool_errors for s in states) / max(num_calls, 1),
    }


def _append_responses(
    rollout: _Rollout,
    active: list[int],
    output: BatchedDataDict[Any],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
) -> int:
    """Append each active sample's response, cut to its remaining token budget, to its token tensors (with
    the sampler's log-probs) and, decoded, to its message log; returns the tokens kept."""
    gen_lengths_A = output["generation_lengths"]
    start_A = rollout.tokens.lengths_B[torch.tensor(active, dtype=torch.long)]
    keep_A = torch.minimum(gen_lengths_A, (max_seq_len - start_A).clamp(min=0))
    rollout.tokens.append_generated(active, output, keep_A)
    for j, i in enumerate(active):
        state = rollout.states[i]
        start, keep = int(start_A[j]), int(keep_A[j])
        ids = rollout.tokens.ids_BT[i, start : start + keep].clone()
        content = str(tokenizer.decode(ids, skip_special_tokens=False))
        state.log.append(LLMMessage(role="assistant", content=content, token_ids=ids))
        state.turns += 1
        state.generated_tokens += keep
        if keep < int(gen_lengths_A[j]) or bool(output["truncated"][j]):
            state.truncated = True
    return int(keep_A.sum())


def _tool_turns(
    rollout: _Rollout,
    active: list[int],
    task_to_tools: Mapping[str, TaskTools],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
) -> set[int]:
    """Run the tool calls of the active samples' responses and append the tool turns to their token tensors
    (see :func:`run_tool_turns`); returns the samples that continue with a tool turn."""
    continuing = run_tool_turns(
        rollout.states, active, rollout.task_names, task_to_tools, tokenizer, max_seq_len
    )
    for i in sorted(continuing):
        rollout.tokens.append(i, rollout.states[i].log[-1]["token_ids"])
    return continuing


def _apply_env_results(
    rollout: _Rollout,
    active: list[int],
    results: dict[int, _StepResult],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    out_of_turns: bool,
) -> None:
    """Add each active sample's reward and end it, or append the environment's observation as the next user
    turn when it fits the budget."""
    for i in active:
        state = rollout.states[i]
        reward, terminated, observation, stop_strings, info, answer = results[i]
        state.reward += reward
        state.answer = answer
        rollout.env_info[i] = info
        state.stop_strings = stop_strings
        if terminated or state.truncated or out_of_turns or observation is None:
            state.done = True
            continue
        text = render_observation_turn(tokenizer, observation)
        obs_ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
        if rollout.length(i) + obs_ids.numel() >= max_seq_len:
            state.truncated = True
            state.done = True
            continue
        state.log.append(LLMMessage(role="user", content=text, token_ids=obs_ids))
        rollout.tokens.append(i, obs_ids)


def _finished_batch(
    input_batch: BatchedDataDict[Any], rollout: _Rollout, turn_metrics: dict[str, float], with_tools: bool
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    """The rolled-out batch (see :func:`run_multi_turn_rollout`) and its metrics (``with_tools``: the tool
    metrics too)."""
    states = rollout.states
    batch_size = len(states)
    result = BatchedDataDict(input_batch.copy())
    # An input of the first turn only; dropping it keeps rollouts of batches with and without it joinable.
    result.pop("stop_strings", None)
    result["message_log"] = [s.log for s in states]
    result.update(rollout.tokens.batch_fields())
    result["extra_env_info"] = rollout.env_info
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
        "mean_conversation_tokens": int(rollout.tokens.lengths_B.sum()) / batch_size,
        **turn_metrics,
        **(
            {"env/replaced_actors": float(rollout.env_actor_replacements)}
            if rollout.env_actor_replacements
            else {}
        ),
        **(_tool_metrics(states) if with_tools else {}),
    }
    return result, metrics
