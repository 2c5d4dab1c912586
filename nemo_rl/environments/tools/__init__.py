"""Tools for agentic rollouts: the :class:`Tool` and :class:`ToolRegistry` types, parsing ``<tool_call>``
blocks from a generated turn, the built-in ``calculator`` and ``python`` tools, and
:func:`build_tool_registry` (``env.<task>.tools``); :class:`TaskTools`, a task's tools with the limits of a tool turn,
as rollouts use them (:func:`build_task_tools`), and :func:`wire_task_tools`, the one call of a run's
start-up that builds them and declares their schemas in the prompts."""

from nemo_rl.environments.tools.base import Tool, ToolRegistry, ToolResult
from nemo_rl.environments.tools.builtin import BUILTIN_TOOLS, build_tool_registry, tool_from_function
from nemo_rl.environments.tools.parsing import MalformedToolCall, ToolCall, parse_tool_calls
from nemo_rl.environments.tools.task import (
    TaskTools,
    build_task_tools,
    truncate_tool_response,
    wire_task_tools,
)

__all__ = [
    "BUILTIN_TOOLS",
    "MalformedToolCall",
    "TaskTools",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "build_task_tools",
    "build_tool_registry",
    "parse_tool_calls",
    "tool_from_function",
    "truncate_tool_response",
    "wire_task_tools",
]
