"""Tools for agentic rollouts: the :class:`Tool` and :class:`ToolRegistry` types, parsing ``<tool_call>``
blocks from a generated turn, the built-in ``calculator`` and ``python`` tools, and
:func:`build_tool_registry` (``env.<task>.tools``)."""

from nemo_rl.environments.tools.base import Tool, ToolRegistry, ToolResult
from nemo_rl.environments.tools.builtin import BUILTIN_TOOLS, build_tool_registry, tool_from_function
from nemo_rl.environments.tools.parsing import MalformedToolCall, ToolCall, parse_tool_calls

__all__ = [
    "BUILTIN_TOOLS",
    "MalformedToolCall",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "build_tool_registry",
    "parse_tool_calls",
    "tool_from_function",
]
