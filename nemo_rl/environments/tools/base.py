"""Tools a policy can call: a Python function with a JSON schema, and a registry that runs calls to them.

A :class:`Tool`'s :meth:`~Tool.schema` is the OpenAI / Qwen function format that
``tokenizer.apply_chat_template(messages, tools=registry.schemas())`` renders into the prompt. A
:class:`ToolRegistry` runs the calls parsed from a generated turn (:mod:`nemo_rl.environments.tools.parsing`)
and never raises: an unknown tool, arguments that do not fit the schema or a tool that fails all become an
error message as the tool's result, which the model reads in its next turn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_rl.environments.tools.parsing import MalformedToolCall, ToolCall, parse_tool_calls

JsonSchema = dict[str, Any]
"""A JSON schema as plain data (``{"type": "object", "properties": {...}, "required": [...]}``)."""

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """A function the policy may call."""

    name: str
    """What the model calls it (``"calculator"``)."""

    description: str
    """What it does, shown to the model."""

    parameters: JsonSchema
    """JSON schema of its keyword arguments (an ``object`` schema)."""

    fn: Callable[..., str]
    """The function, called with the arguments as keywords; returns the text the model reads."""

    def schema(self) -> dict[str, Any]:
        """The entry of ``apply_chat_template(..., tools=[...])``: ``{"type": "function", "function": ...}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolResult:
    """What one call returned (or why it failed), ready to append as a ``tool`` message."""

    name: str | None
    """The tool called (``None`` for a call too malformed to name one)."""

    content: str
    """The tool's output, or ``"Error: ..."``."""

    is_error: bool
    """The call failed (malformed, unknown tool, bad arguments, the tool raised)."""

    def message(self) -> dict[str, str]:
        """The ``{"role": "tool", ...}`` message chat templates render as the tool's response."""
        message = {"role": "tool", "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


def argument_errors(arguments: Mapping[str, Any], schema: JsonSchema) -> list[str]:
    """What is wrong with ``arguments`` under an ``object`` schema: missing required keys, unknown keys,
    and top-level values of the wrong JSON type (nested values are the tool's to check)."""
    properties: Mapping[str, Any] = schema.get("properties", {})
    errors = [
        f"missing required argument {key!r}" for key in schema.get("required", []) if key not in arguments
    ]
    for key, value in arguments.items():
        if key not in properties:
            errors.append(f"unknown argument {key!r} (expected: {', '.join(properties) or 'none'})")
            continue
        expected = properties[key].get("type")
        names = [expected] if isinstance(expected, str) else list(expected or [])
        types = tuple(t for name in names for t in _JSON_TYPES.get(name, (object,)))
        # JSON has no bool/int distinction in Python's sense: true is not an integer argument.
        if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            errors.append(f"argument {key!r} must be {' or '.join(names)}, got {type(value).__name__}")
    return errors


class ToolRegistry:
    """The tools of one task, by name.

    Args:
        tools: The tools; names must be unique.
    """

    def __init__(self, tools: Sequence[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        """The tools by name."""
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}; tool names must be unique")
            self.tools[tool.name] = tool

    def schemas(self) -> list[dict[str, Any]]:
        """The ``tools=`` argument of ``apply_chat_template``."""
        return [tool.schema() for tool in self.tools.values()]

    def respond(self, turn: str) -> list[ToolResult]:
        """Run every tool call of a generated turn, in order (an empty list: the turn calls no tool)."""
        return [self.call(call) for call in parse_tool_calls(turn)]

    def call(self, call: ToolCall | MalformedToolCall) -> ToolResult:
        """Run one parsed call; every failure is an error result, never an exception."""
        if isinstance(call, MalformedToolCall):
            return ToolResult(name=None, content=f"Error: malformed tool call: {call.error}", is_error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return ToolResult(call.name, f"Error: unknown tool {call.name!r} (tools: {known})", is_error=True)
        errors = argument_errors(call.arguments, tool.parameters)
        if errors:
            return ToolResult(call.name, f"Error: {'; '.join(errors)}", is_error=True)
        try:
            return ToolResult(call.name, str(tool.fn(**call.arguments)), is_error=False)
        except Exception as err:  # a tool's failure is the model's feedback, not the rollout's crash
            return ToolResult(call.name, f"Error: {type(err).__name__}: {err}", is_error=True)
