"""What the agent endpoint records per trajectory, and how each request's prompt continues the trajectory's
tokens (see docs/algorithms/agent_endpoint.md).

An external agent sends text (OpenAI messages or a completion prompt), never token ids; training needs the
exact ids that were sampled. So every request's prompt is built to *extend* the trajectory's previous prompt
plus sampled ids, token for token, and the trajectory becomes one training row: prompt, response, the tokens
the agent added (tool results, user turns), the next response... Each request's prompt is one of:

- ``first``: the trajectory's first request, rendered by the chat template (or tokenized);
- ``exact``: the rendering starts with the previous prompt + sampled ids: used as is;
- ``spliced``: every response was sent back as the endpoint returned it (same content, same tool calls),
  but the template renders the last one to other tokens (tool calls re-serialised or not rendered, a
  different tokenisation of the same text): the previous ids are kept and the template's tokens after the
  response's end-of-turn token are appended (NeMo RL's ``_replace_prefix_tokens`` does the same in its vLLM
  HTTP server). Drift is counted, never trained on;
- ``restarted``: the agent rewrote the history: an earlier message edited or dropped, or a response sent
  back with other content or other tool calls than the endpoint returned. No continuation exists, so the
  trajectory restarts from this request and its earlier turns are dropped from training (counted): the
  model never trains on, nor is shown, its own tokens in place of what the agent sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.data.interfaces import LLMMessage, MessageLog

Continuation = Literal["first", "exact", "spliced", "restarted"]
"""How a request's prompt relates to its trajectory's previous turn (see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class AssistantReply:
    """A chat response in the form it is compared in when an agent sends it back: its content and its tool
    calls. The calls' ids are the endpoint's, not sampled tokens, so they are not compared; arguments are
    compared as JSON values (key order and spacing aside)."""

    content: str
    """The message's text (``""`` for none)."""

    tool_calls: tuple[tuple[str, str], ...] = ()
    """Each call's function name and its arguments as canonical JSON."""

    @classmethod
    def of(cls, message: Mapping[str, Any]) -> AssistantReply:
        """The reply an assistant message holds (OpenAI's form, or as :func:`normalise_chat_messages` made it)."""
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
        calls = []
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            function = function if isinstance(function, Mapping) else {}
            calls.append((str(function.get("name")), _canonical_json(function.get("arguments"))))
        return cls(content=str(content or ""), tool_calls=tuple(calls))


def _canonical_json(value: Any) -> str:
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):
            value = json.loads(value)
    return json.dumps(value, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class SampledTurn:
    """One request of a trajectory: the ids generation continued and what it sampled."""

    prompt_ids: list[int]
    """The ids sampled from (for turns after the first: the previous turn's :attr:`ids` and then more)."""

    sampled_ids: list[int]
    """The tokens sampled, the stop token included (cut to the request's ``max_tokens``)."""

    logprobs: list[float]
    """Each sampled token's log-prob under the distribution it was drawn from."""

    rendered_ids: list[int]
    """The request as the template rendered (or the tokenizer encoded) it, for the next turn's check."""

    num_messages: int = 0
    """Messages of a chat request (0 for a completion)."""

    reply: AssistantReply | None = None
    """The chat response as returned to the agent, which a later request must send back unchanged (``None``
    for completions)."""

    text: str | None = None
    """A text completion's prompt followed by the completion's text as returned, without its stop token
    (``None`` for chat and token-id prompts)."""

    truncated: bool = False
    """The response ended without a stop token or stop string (a length budget ended it)."""

    @property
    def ids(self) -> list[int]:
        """The prompt followed by the sampled tokens."""
        return self.prompt_ids + self.sampled_ids


def _starts_with(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(ids) >= len(prefix) and list(ids[: len(prefix)]) == list(prefix)


def replies_sent_back(turns: Sequence[SampledTurn], messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether ``messages`` hold every chat response of ``turns`` as the endpoint returned it, each right after
    the messages of the request that sampled it. One edited, substituted or missing is rewritten history."""
    for turn in turns:
        if turn.reply is None:
            continue
        if turn.num_messages >= len(messages):
            return False
        sent = messages[turn.num_messages]
        if sent.get("role") != "assistant" or AssistantReply.of(sent) != turn.reply:
            return False
    return True


def chat_prompt(
    turns: Sequence[SampledTurn],
    messages: Sequence[Mapping[str, Any]],
    rendered: list[int],
    history_rendered: list[int] | None,
    stop_token_ids: Collection[int],
) -> tuple[list[int], Continuation]:
    """The prompt of a chat request and how it continues the trajectory's last turn.

    Args:
        turns: The trajectory's turns (none for its first request).
        messages: The request's messages (normalised).
        rendered: The request's messages rendered with the generation prompt.
        history_rendered: The request's messages up to and including the one after the last turn's own
            messages, rendered without a generation prompt, when that message is the assistant's (the
            previous response as the agent sent it back); ``None`` otherwise.
        stop_token_ids: Tokens that end an assistant turn.
    """
    if not turns:
        return rendered, "first"
    if not replies_sent_back(turns, messages):
        return rendered, "restarted"
    previous = turns[-1]
    if _starts_with(rendered, previous.ids):
        return rendered, "exact"
    spliceable = (
        history_rendered is not None
        and len(history_rendered) > len(previous.rendered_ids)
        and _starts_with(history_rendered, previous.rendered_ids)
        and _starts_with(rendered, history_rendered)
    )
    if not spliceable:
        return rendered, "restarted"
    assert history_rendered is not None
    # The template's end-of-turn token closing the previous response; what follows it is new context.
    ends = [
        i
        for i in range(len(previous.rendered_ids), len(history_rendered))
        if history_rendered[i] in stop_token_ids
    ]
    if not ends:
        cut = len(history_rendered)
    elif previous.sampled_ids and previous.sampled_ids[-1] in stop_token_ids:
        cut = ends[-1] + 1  # the sampled stop token stands for the template's
    else:
        cut = ends[-1]  # a response cut by its budget: the template's end-of-turn token closes it
    return previous.ids + rendered[cut:], "spliced"


def completion_prompt(
    previous: SampledTurn | None,
    prompt: str | list[int],
    encode: Callable[[str], list[int]],
) -> tuple[list[int], Continuation]:
    """The prompt ids of a text completion request (``prompt`` as text or token ids) and how they continue
    ``previous``. Text that extends the previous prompt and completion keeps their ids and encodes only the
    new text."""
    ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
    if previous is None:
        return ids, "first"
    if _starts_with(ids, previous.ids):
        return ids, "exact"
    if isinstance(prompt, str) and previous.text is not None and prompt.startswith(previous.text):
        return previous.ids + encode(prompt[len(previous.text) :]), "spliced"
    return ids, "restarted"


@dataclasses.dataclass
class Trajectory:
    """The turns one agent's requests sampled, in order, plus counts of how they continued each other."""

    turns: list[SampledTurn] = dataclasses.field(default_factory=list)
    """The turns trained on: each one's prompt extends the previous one's ids."""

    num_requests: int = 0
    """Requests sampled (turns dropped by a restart included)."""

    num_spliced: int = 0
    """Requests whose rendering drifted from the sampled ids and were spliced onto them."""

    num_restarts: int = 0
    """Requests that rewrote the trajectory's history (its earlier turns are dropped)."""

    num_dropped_turns: int = 0
    """Turns dropped by restarts."""

    @property
    def last(self) -> SampledTurn | None:
        """The latest turn, which the next request must extend."""
        return self.turns[-1] if self.turns else None

    def add(self, turn: SampledTurn, continuation: Continuation) -> None:
        """Record ``turn``, built as ``continuation`` says."""
        self.num_requests += 1
        if continuation == "restarted":
            self.num_restarts += 1
            self.num_dropped_turns += len(self.turns)
            self.turns = []
        elif continuation == "spliced":
            self.num_spliced += 1
        if self.turns:
            assert _starts_with(turn.prompt_ids, self.turns[-1].ids), "a turn must extend its trajectory"
        self.turns.append(turn)

    def message_log(self, tokenizer: PreTrainedTokenizerBase) -> MessageLog:
        """The trajectory as one message log: ``user`` messages hold what the model did not sample (the first
        prompt, then what the agent added between responses; not trained on), ``assistant`` messages the
        sampled tokens with their ``generation_logprobs``. Its token ids concatenate to the last turn's."""
        log: MessageLog = []
        covered = 0
        for turn in self.turns:
            context = turn.prompt_ids[covered:]
            if context:
                log.append(_message("user", context, tokenizer))
            response = _message("assistant", turn.sampled_ids, tokenizer)
            response["generation_logprobs"] = torch.tensor(turn.logprobs, dtype=torch.float32)  # type: ignore[typeddict-unknown-key]
            log.append(response)
            covered = len(turn.ids)
        return log


def _message(role: str, ids: list[int], tokenizer: PreTrainedTokenizerBase) -> LLMMessage:
    content = tokenizer.decode(ids, skip_special_tokens=False)
    assert isinstance(content, str)
    return LLMMessage(role=role, content=content, token_ids=torch.tensor(ids, dtype=torch.long))


class TrajectoryStore:
    """The trajectories of the rollout in progress, by id. Requests for an id not opened (or already
    closed) find nothing: the endpoint serves only the agents of the current rollout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, Trajectory] = {}

    def open(self, trajectory_ids: Iterable[str]) -> None:
        """Accept requests for these trajectories."""
        with self._lock:
            for trajectory_id in trajectory_ids:
                if trajectory_id in self._open:
                    raise ValueError(f"trajectory {trajectory_id!r} is already open")
                self._open[trajectory_id] = Trajectory()

    def get(self, trajectory_id: str) -> Trajectory | None:
        """The open trajectory of that id, or ``None``."""
        with self._lock:
            return self._open.get(trajectory_id)

    @property
    def empty(self) -> bool:
        """Whether no trajectory is open."""
        with self._lock:
            return not self._open

    def close(self, trajectory_ids: Iterable[str]) -> dict[str, Trajectory]:
        """Stop accepting requests for these trajectories; returns what they recorded."""
        with self._lock:
            return {tid: self._open.pop(tid) for tid in list(trajectory_ids) if tid in self._open}


def trajectory_counts(trajectories: Mapping[str, Trajectory]) -> dict[str, float]:
    """Totals over ``trajectories``: ``requests``, ``spliced_requests``, ``restarts``, ``dropped_turns``."""
    values = list(trajectories.values())
    return {
        "requests": float(sum(t.num_requests for t in values)),
        "spliced_requests": float(sum(t.num_spliced for t in values)),
        "restarts": float(sum(t.num_restarts for t in values)),
        "dropped_turns": float(sum(t.num_dropped_turns for t in values)),
    }


def normalise_chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them: ``None`` content as ``""``, content given as a list of
    text parts as their text, and tool-call arguments sent as JSON strings (the OpenAI wire format) as the
    objects templates serialise themselves."""
    normalised: list[dict[str, Any]] = []
    for message in messages:
        out = dict(message)
        content = out.get("content")
        if content is None:
            out["content"] = ""
        elif isinstance(content, list):
            out["content"] = "".join(
                str(part.get("text", "")) for part in content if isinstance(part, Mapping)
            )
        calls = out.get("tool_calls")
        if calls:
            out["tool_calls"] = [_normalise_tool_call(call) for call in calls]
        normalised.append(out)
    return normalised


def _normalise_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(call)
    function = dict(out.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # Arguments that are not JSON are rendered as sent: the template shows what the agent wrote.
        with contextlib.suppress(json.JSONDecodeError):
            function["arguments"] = json.loads(arguments)
    out["function"] = function
    return out
