"""Reading tool calls out of a generated turn, in the Qwen2.5 / Qwen3 (Hermes) format::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

A turn may hold several blocks. A block that is not closed (the generation stopped inside it), not JSON,
not an object, without a string ``name`` or with ``arguments`` that are not an object becomes a
:class:`MalformedToolCall`: the rollout answers it with an error message, it
never raises. ``arguments`` given as a JSON string holding an object (some models write that) is accepted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
"""Opens a call in the Qwen chat templates."""

TOOL_CALL_CLOSE = "</tool_call>"
"""Closes it."""

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call parsed from a generated turn."""

    name: str
    """The tool called."""

    arguments: dict[str, Any]
    """Its arguments."""


@dataclass(frozen=True)
class MalformedToolCall:
    """A ``<tool_call>`` block that could not be read as a call."""

    text: str
    """The block's content as generated."""

    error: str
    """What is wrong with it (shown to the model as the call's result)."""


def _read_call(block: str) -> ToolCall | MalformedToolCall:
    try:
        payload: Any = json.loads(block)
    except json.JSONDecodeError as err:
        return MalformedToolCall(block, f"not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(payload, dict):
        return MalformedToolCall(block, f"expected a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return MalformedToolCall(block, 'expected a "name" string')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return MalformedToolCall(block, '"arguments" is a string that is not a JSON object')
    if not isinstance(arguments, dict):
        return MalformedToolCall(block, f'"arguments" must be an object, got {type(arguments).__name__}')
    return ToolCall(name=name, arguments=arguments)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedToolCall]:
    """Every ``<tool_call>`` block of ``text``, in order (an empty list: the turn calls no tool)."""
    calls: list[ToolCall | MalformedToolCall] = []
    for match in _BLOCK.finditer(text):
        block = match.group(1).strip()
        if not match.group(0).endswith(TOOL_CALL_CLOSE):
            calls.append(MalformedToolCall(block, f"{TOOL_CALL_OPEN} is not closed by {TOOL_CALL_CLOSE}"))
        else:
            calls.append(_read_call(block))
    return calls
