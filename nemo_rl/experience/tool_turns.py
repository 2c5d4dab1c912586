"""Tool turns of a rollout: run the ``<tool_call>`` blocks of a generated turn and append their results.

A sample of a task with tools (``env.<task>.tools``) whose generated turn holds tool calls is not scored
this turn: its calls run (:class:`~nemo_rl.environments.tools.TaskTools`, every failure an error result),
and the results are appended as one ``tool`` message whose token ids are the chat template's rendering of
the tool messages plus the next generation prompt, tokenized on their own and concatenated after the
sampled ids. Nothing generated earlier is ever re-tokenized, so the ids the trainer sees are the sampled
ones; ``tool`` messages are not trained (GRPO trains the ``assistant`` role only).

The rendering is taken from the template itself: the text a dummy user turn gains when the tool messages are
appended to it. A template that closes an assistant turn with more than the EOS token
(ChatML's ``<|im_end|>`` then ``\\n``) gets that closing text put first in the tool turn, since the sampler
stops at EOS: the sequence is then token for token what the template renders for the whole conversation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.data.interfaces import LLMMessage, MessageLog
from nemo_rl.data.llm_message_utils import message_log_length
from nemo_rl.environments.tools import MalformedToolCall, TaskTools, ToolResult, parse_tool_calls

_ASSISTANT_MARK = "<<assistant turn>>"
# Tool messages are rendered after a user turn, not an assistant one: templates such as Qwen3's render the last
# assistant turn differently (an empty think block) from one that tool messages follow.
_USER_TURN = [{"role": "user", "content": "x"}]


class ToolTurnSample(Protocol):
    """The part of a rollout's per-sample state a tool turn reads and updates."""

    log: MessageLog
    truncated: bool
    tool_calls: int
    malformed_tool_calls: int
    tool_errors: int


def render_tool_turn(
    tokenizer: PreTrainedTokenizerBase,
    results: Sequence[ToolResult],
    response_text: str,
    tools: Sequence[dict[str, Any]],
) -> str:
    """Text of the tool messages of ``results`` and the next generation prompt, as the chat template renders
    them after an assistant turn whose generated text is ``response_text`` (which decides how much of the
    template's turn closing is still missing).

    Raises:
        ValueError: the template renders a conversation differently once tool messages follow it.
    """
    turn = rendered_continuation(
        tokenizer, _USER_TURN, [r.message() for r in results], tools, what="tool messages"
    )
    return _missing_turn_closing(tokenizer, response_text, tools) + turn


def rendered_continuation(
    tokenizer: PreTrainedTokenizerBase,
    context: Sequence[dict[str, str]],
    messages: Sequence[dict[str, str]],
    tools: Sequence[dict[str, Any]],
    *,
    what: str,
) -> str:
    """The text the chat template adds to its rendering of ``context`` for ``messages`` and the next
    generation prompt, both rendered with ``tools=`` (none when empty); ``what`` names the messages in the error.

    Raises:
        ValueError: the template renders ``context`` differently once ``messages`` follow it.
    """
    prefix = tokenizer.apply_chat_template(list(context), tools=list(tools) or None, tokenize=False)
    full = tokenizer.apply_chat_template(
        [*context, *messages], tools=list(tools) or None, tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prefix, str) and isinstance(full, str)
    if not full.startswith(prefix):
        raise ValueError(
            f"the tokenizer's chat template renders a conversation differently once {what} follow it, so they "
            "cannot be appended to the sampled tokens; use a template whose renderings of a conversation and of "
            "its continuation share a prefix"
        )
    return full[len(prefix) :]


def _missing_turn_closing(
    tokenizer: PreTrainedTokenizerBase, response_text: str, tools: Sequence[dict[str, Any]]
) -> str:
    """What the template puts after an assistant turn's content that ``response_text`` does not end with:
    nothing when it ends with the whole closing, ChatML's newline after its EOS, or the whole closing when
    the turn stopped before EOS (a stop string)."""
    rendered = tokenizer.apply_chat_template(
        [*_USER_TURN, {"role": "assistant", "content": _ASSISTANT_MARK}],
        tools=list(tools) or None,
        tokenize=False,
    )
    assert isinstance(rendered, str)
    closing = rendered[rendered.rindex(_ASSISTANT_MARK) + len(_ASSISTANT_MARK) :]
    eos = str(tokenizer.eos_token or "")
    if response_text.endswith(closing):
        return ""
    if eos and closing.startswith(eos) and response_text.endswith(eos):
        return closing[len(eos) :]
    return closing


def _run_calls(tools: TaskTools, response_text: str) -> tuple[list[ToolResult], int]:
    """The results of the calls of ``response_text`` (none: it calls no tool) and how many were malformed."""
    calls = parse_tool_calls(response_text)
    return tools.run(calls), sum(isinstance(call, MalformedToolCall) for call in calls)


def _tool_message(
    tools: TaskTools, tokenizer: PreTrainedTokenizerBase, results: list[ToolResult], response_text: str
) -> LLMMessage:
    """The ``tool`` message carrying ``results``: the template's rendering, tokenized on its own."""
    text = render_tool_turn(tokenizer, results, response_text, tools.schemas())
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
    return LLMMessage(role="tool", content=text, token_ids=ids)


def run_tool_turns(
    states: Sequence[ToolTurnSample],
    active: Sequence[int],
    task_names: Sequence[str],
    task_to_tools: Mapping[str, TaskTools],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
) -> set[int]:
    """Answer the tool calls of the active samples' last turns (their calls run on a thread pool: the
    ``python`` tool waits on a sandboxed process); returns the samples that continue with a tool turn.

    A sample whose tool turn does not fit ``max_seq_len`` is marked truncated instead (the environment then
    scores it and it ends); samples truncated already, whose task has no tools or that call none are left to
    the environment.
    """
    jobs = [i for i in active if task_names[i] in task_to_tools and not states[i].truncated]
    if not jobs:
        return set()
    # Only the calls run on the pool: the tokenizer is not safe to share between threads.
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        outcomes = list(
            pool.map(lambda i: _run_calls(task_to_tools[task_names[i]], states[i].log[-1]["content"]), jobs)
        )
    continuing: set[int] = set()
    for i, (results, num_malformed) in zip(jobs, outcomes, strict=True):
        if not results:
            continue
        state = states[i]
        state.tool_calls += len(results)
        state.malformed_tool_calls += num_malformed
        state.tool_errors += sum(r.is_error for r in results)
        message = _tool_message(task_to_tools[task_names[i]], tokenizer, results, state.log[-1]["content"])
        if message_log_length(state.log) + message["token_ids"].numel() >= max_seq_len:
            state.truncated = True
            continue
        state.log.append(message)
        continuing.add(i)
    return continuing
