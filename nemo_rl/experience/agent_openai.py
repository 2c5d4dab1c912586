"""The OpenAI wire format of the agent endpoint: request bodies, the checks that keep sampling on-policy, and
the response bodies of ``/v1/chat/completions`` and ``/v1/completions``.

Sampling settings are the policy's (``policy.generation``): a request may omit ``temperature``, ``top_p`` and
``top_k`` or repeat the configured values, and is refused otherwise (NeMo RL's HTTP server asserts the same),
since tokens drawn from another distribution would not carry the log-probs the loss assumes. ``max_tokens``
cuts the response after sampling (the tokens kept are a prefix of what was sampled, with their log-probs).
Besides OpenAI's fields, every response carries the ids the endpoint recorded, under NeMo Gym's names
(``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``). A refused request is answered
in OpenAI's error format, ``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field
at fault (:class:`EndpointError`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.generation import GenerationConfig
from nemo_rl.environments.tools.parsing import TOOL_CALL_OPEN, ToolCall, parse_tool_calls
from nemo_rl.experience.agent_trajectories import SampledTurn

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The message roles of OpenAI's chat API."""


class EndpointError(Exception):
    """A request the endpoint refuses, answered with ``status`` and an OpenAI error body.

    Args:
        status: The HTTP status (the ``openai`` client raises the matching exception).
        message: What is wrong and what to send instead.
        param: The request field at fault (``messages[2].content``), ``None`` when none is.
        code: OpenAI's machine-readable code (``model_not_found``, ``missing_required_parameter``...).
    """

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The error body, as OpenAI's API writes it."""
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


class _SamplingRequest(BaseModel):
    """Fields every completion request shares; OpenAI fields not listed here are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stream: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None

    def stop_strings(self) -> list[str] | None:
        """The request's stop strings as a list (``None`` without any)."""
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s] or None


class ChatCompletionRequest(_SamplingRequest):
    """A ``/v1/chat/completions`` body."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    def token_budget(self) -> int | None:
        """The most tokens the response may keep (``max_completion_tokens``, else ``max_tokens``)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingRequest):
    """A ``/v1/completions`` body: ``prompt`` as text, or as token ids (no tokenisation at all)."""

    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool | None = None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (a list of several texts is refused by :func:`request_problem`)."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return self.prompt  # type: ignore[return-value]


def check_request(
    request: ChatCompletionRequest | CompletionRequest, sampling: GenerationConfig, model_name: str
) -> None:
    """Refuse (:class:`EndpointError`) a request for another model, or one unservable on-policy."""
    if request.model != model_name:
        raise EndpointError(
            404,
            f"The model {request.model!r} does not exist: this endpoint serves {model_name!r} (GET /models)",
            param="model",
            code="model_not_found",
        )
    problem = _sampling_problem(request, sampling) or _body_problem(request)
    if problem is not None:
        param, message = problem
        raise EndpointError(400, message, param=param, code="invalid_value")


def _sampling_problem(
    request: ChatCompletionRequest | CompletionRequest, sampling: GenerationConfig
) -> tuple[str, str] | None:
    if request.stream:
        return "stream", "stream=true is not supported by this endpoint: send stream=false"
    if request.n not in (None, 1):
        return "n", f"n={request.n}: this endpoint samples one choice per request (send n=1)"
    for key in ("temperature", "top_p"):
        sent, configured = getattr(request, key), getattr(sampling, key)
        if sent is not None and sent != configured:
            return key, (
                f"{key}={sent} differs from the policy's sampling {key}={configured} (policy.generation.{key}): "
                f"omit it or send {configured}, so the trained tokens keep the log-probs they were sampled with"
            )
    if (
        request.top_k is not None
        and request.top_k != sampling.top_k
        and not (sampling.top_k is None and request.top_k in (-1, 0))
    ):
        return (
            "top_k",
            f"top_k={request.top_k} differs from the policy's (policy.generation.top_k={sampling.top_k}): omit it",
        )
    return None


def _body_problem(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs:
            return (
                "top_logprobs",
                "top_logprobs is not supported: the endpoint returns the sampled tokens' log-probs only",
            )
        if not request.messages:
            return "messages", "messages is empty: send at least one message"
        for i, message in enumerate(request.messages):
            if message.get("role") not in CHAT_ROLES:
                return f"messages[{i}].role", (
                    f"messages[{i}].role is {message.get('role')!r}: give one of {', '.join(CHAT_ROLES)}"
                )
        return None
    if request.echo:
        return "echo", "echo=true is not supported: send echo=false"
    if request.logprobs:
        return (
            "logprobs",
            "logprobs=<k> is not supported for completions: omit it (the sampled tokens' log-probs are in generation_log_probs)",
        )
    if isinstance(request.prompt, list) and len(request.prompt) > 1 and isinstance(request.prompt[0], str):
        return "prompt", "prompt holds several texts: send one prompt per request"
    if not request.prompt:
        return "prompt", "prompt is empty"
    return None


def validation_error(errors: Sequence[Mapping[str, Any]]) -> EndpointError:
    """The OpenAI error for a body that does not parse or match the request schema (FastAPI's validation
    errors, of which the first is reported), naming the field at fault."""
    first = errors[0] if errors else {}
    kind, detail = str(first.get("type", "")), str(first.get("msg", "invalid"))
    param = _param(first.get("loc", ()))
    if kind == "json_invalid":
        return EndpointError(400, f"the body is not valid JSON ({detail}): send a JSON object")
    if param is None:
        return EndpointError(400, f"the body must be a JSON object with the request's fields ({detail})")
    if kind == "missing":
        return EndpointError(
            400, f"Missing required parameter: {param!r}", param=param, code="missing_required_parameter"
        )
    code = "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value"
    return EndpointError(400, f"Invalid {param!r}: {detail}", param=param, code=code)


def _param(loc: Sequence[Any]) -> str | None:
    """``messages[0].role`` for the location ``("body", "messages", 0, "role")``. A name that follows a name
    is pydantic's tag of a union member (``("body", "stop", "list[str]")``), not a field: the path ends there."""
    if len(loc) < 2 or loc[0] != "body" or not isinstance(loc[1], str):
        return None
    param, after_index = loc[1], False
    for part in loc[2:]:
        if isinstance(part, int):
            param += f"[{part}]"
            after_index = True
        elif after_index:
            param += f".{part}"
            after_index = False
        else:
            break
    return param


def response_text(
    sampled_ids: list[int], stop_token_ids: Collection[int], tokenizer: PreTrainedTokenizerBase
) -> str:
    """A response's text: its tokens without the stop token that ended it (stop strings stay)."""
    ids = sampled_ids[:-1] if sampled_ids and sampled_ids[-1] in stop_token_ids else sampled_ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert isinstance(text, str)
    return text


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and the OpenAI ``tool_calls`` of a response written in the Qwen ``<tool_call>`` format.

    The content is the text before the first call (``None`` when empty). A response with a malformed call is
    returned whole as content with no calls, so the agent sees what the model wrote."""
    calls = parse_tool_calls(text)
    if not calls or not all(isinstance(call, ToolCall) for call in calls):
        return text, []
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in calls
        if isinstance(call, ToolCall)
    ]
    content = text.split(TOOL_CALL_OPEN, 1)[0].strip()
    return content or None, tool_calls


def finish_reason(turn: SampledTurn, tool_calls: list[dict[str, Any]]) -> str:
    """OpenAI's finish reason of a recorded turn."""
    if tool_calls:
        return "tool_calls"
    return "length" if turn.truncated else "stop"


def _usage(turn: SampledTurn) -> dict[str, int]:
    prompt, completion = len(turn.prompt_ids), len(turn.sampled_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _recorded_ids(turn: SampledTurn) -> dict[str, Any]:
    return {
        "prompt_token_ids": turn.prompt_ids,
        "generation_token_ids": turn.sampled_ids,
        "generation_log_probs": turn.logprobs,
    }


def reply_parts(
    turn: SampledTurn,
    *,
    with_tools: bool,
    stop_token_ids: Collection[int],
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and ``tool_calls`` of the chat message answering a request that sampled ``turn``."""
    text = response_text(turn.sampled_ids, stop_token_ids, tokenizer)
    return split_tool_calls(text) if with_tools else (text, [])


def chat_response(
    turn: SampledTurn,
    content: str | None,
    tool_calls: list[dict[str, Any]],
    *,
    model: str,
    with_logprobs: bool,
    tokenizer: PreTrainedTokenizerBase,
) -> dict[str, Any]:
    """The ``chat.completion`` body answering a request that sampled ``turn`` (its message's parts from
    :func:`reply_parts`)."""
    message: dict[str, Any] = {"role": "assistant", "content": content, **_recorded_ids(turn)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    logprobs = None
    if with_logprobs:
        logprobs = {
            "content": [
                _token_logprob(t, lp, tokenizer)
                for t, lp in zip(turn.sampled_ids, turn.logprobs, strict=True)
            ]
        }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason(turn, tool_calls),
            }
        ],
        "usage": _usage(turn),
    }


def _token_logprob(token_id: int, logprob: float, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    token = tokenizer.decode([token_id], skip_special_tokens=False)
    assert isinstance(token, str)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []}


def completion_response(turn: SampledTurn, text: str, *, model: str) -> dict[str, Any]:
    """The ``text_completion`` body answering a request that sampled ``turn`` (``text``: its completion)."""
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason(turn, []),
        **_recorded_ids(turn),
    }
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(turn),
    }
