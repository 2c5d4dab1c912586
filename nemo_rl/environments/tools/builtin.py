"""The built-in tools and :func:`build_tool_registry`, which builds a task's tools from ``env.<task>.tools``.

Built in: ``calculator`` (:mod:`~nemo_rl.environments.tools.calculator`) and ``python`` (runs a program in
the sandbox and returns what it printed). Any other entry is a ``module:function`` path: to a
:class:`~nemo_rl.environments.tools.base.Tool`, or to a plain function with
type hints and a Google-style docstring, whose schema is derived by transformers' ``get_json_schema`` (the
same derivation ``apply_chat_template(tools=[fn])`` makes).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from nemo_rl.config.env import SandboxConfig
from nemo_rl.config.errors import UserError
from nemo_rl.environments.sandbox import Sandbox, SandboxResult
from nemo_rl.environments.tools.base import Tool, ToolRegistry
from nemo_rl.environments.tools.calculator import calculator_tool


def format_run(result: SandboxResult) -> str:
    """What the model reads after a program ran: its output, and how it ended when that was not cleanly."""
    parts = [result.stdout]
    if result.stderr:
        parts.append(result.stderr)
    if result.timed_out:
        parts.append("[stopped: the time limit was reached]")
    elif result.output_truncated:
        parts.append("[stopped: the output limit was reached]")
    elif result.signal is not None:
        parts.append(f"[stopped by signal {result.signal}: a CPU or memory limit was reached]")
    elif result.exit_code:
        parts.append(f"[exit status {result.exit_code}]")
    return "\n".join(p.rstrip("\n") for p in parts if p) or "[no output]"


def python_tool(sandbox: Sandbox) -> Tool:
    """The ``python`` tool: runs a program in ``sandbox`` (a fresh directory per call, no network)."""

    def run_python(code: str) -> str:
        return format_run(sandbox.run_python(code))

    return Tool(
        name="python",
        description=(
            "Run a Python 3 program and return what it printed (stdout, then stderr). Each call starts "
            "fresh: no state, files or network carry over. Print the values you need."
        ),
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program's source."}},
            "required": ["code"],
        },
        fn=run_python,
    )


BUILTIN_TOOLS: dict[str, Callable[[SandboxConfig], Tool]] = {
    "calculator": lambda _: calculator_tool(),
    "python": lambda sandbox_cfg: python_tool(Sandbox(sandbox_cfg)),
}
"""Built-in tool names -> a factory taking the task's sandbox limits."""


def tool_from_function(fn: Callable[..., Any]) -> Tool:
    """A :class:`Tool` from a typed function with a Google-style docstring (``Args:`` describing each
    argument), its schema derived as ``apply_chat_template(tools=[fn])`` would derive it."""
    from transformers.utils import get_json_schema

    function = get_json_schema(fn)["function"]
    return Tool(
        name=function["name"],
        description=function.get("description", ""),
        parameters=function.get("parameters", {"type": "object", "properties": {}}),
        fn=lambda **kwargs: str(fn(**kwargs)),
    )


def _import_tool(path: str) -> Tool:
    module_name, _, attr = path.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise UserError(f"tool {path!r} does not import: {err}") from err
    if isinstance(target, Tool):
        return target
    if not callable(target):
        raise UserError(f"tool {path!r} is a {type(target).__name__}, not a Tool or a function")
    try:
        return tool_from_function(target)
    except Exception as err:  # transformers raises several types for an undocumented function
        raise UserError(
            f"tool {path!r}: no JSON schema can be derived ({err}); give it type hints and a Google-style "
            "docstring with an Args: section, or point to a nemo_rl.environments.tools.Tool"
        ) from err


def build_tool_registry(names: Sequence[str], sandbox_cfg: SandboxConfig) -> ToolRegistry:
    """The tools of ``env.<task>.tools``: built-in names or ``module:function`` paths.

    Raises:
        UserError: a name is neither built in nor an import path, or does not import as a tool.
    """
    tools = []
    for name in names:
        if name in BUILTIN_TOOLS:
            tools.append(BUILTIN_TOOLS[name](sandbox_cfg))
        elif ":" in name:
            tools.append(_import_tool(name))
        else:
            close = difflib.get_close_matches(name, BUILTIN_TOOLS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(
                f"unknown tool {name!r}: {hint}built-in tools are {', '.join(BUILTIN_TOOLS)}; name your own "
                "as 'module:function'"
            )
    try:
        return ToolRegistry(tools)
    except ValueError as err:
        raise UserError(str(err)) from err
