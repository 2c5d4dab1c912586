"""The tools of one task as its rollouts use them: the registry of ``env.<task>.tools`` with the limits of a
tool turn (``max_parallel_calls``, ``max_tool_response_length``, ``tool_response_truncate_side``);
:func:`build_task_tools`, which builds them for every environment section that declares tools, and
:func:`wire_task_tools`, which a run's start-up calls once to build them and declare their schemas in the
prompts."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nemo_rl.config.env import EnvConfig, RuleBasedEnvConfig
from nemo_rl.config.errors import UserError
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.data.interfaces import DatumSpec
from nemo_rl.environments.tools.base import ToolRegistry, ToolResult
from nemo_rl.environments.tools.builtin import build_tool_registry
from nemo_rl.environments.tools.parsing import MalformedToolCall, ToolCall

TRUNCATION_MARK = "...(truncated)..."
"""Put where a long tool result was cut."""


def truncate_tool_response(text: str, max_chars: int, side: Literal["left", "right", "middle"]) -> str:
    """``text`` cut to ``max_chars`` characters plus :data:`TRUNCATION_MARK`: ``left`` keeps its start,
    ``right`` its end, ``middle`` both ends (``text`` unchanged when it fits)."""
    if len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + TRUNCATION_MARK
    if side == "right":
        return TRUNCATION_MARK + text[-max_chars:]
    head = (max_chars + 1) // 2
    tail = max_chars - head
    return text[:head] + TRUNCATION_MARK + (text[-tail:] if tail else "")


@dataclass(frozen=True)
class TaskTools:
    """What a rollout needs to answer the tool calls of one task's turns."""

    registry: ToolRegistry
    """The task's tools."""

    max_tool_response_length: int
    """Characters of one result the model reads."""

    tool_response_truncate_side: Literal["left", "right", "middle"]
    """Which part of a long result is kept."""

    max_parallel_calls: int
    """Calls of one turn that run; the rest are answered with an error."""

    @classmethod
    def from_config(cls, cfg: RuleBasedEnvConfig) -> TaskTools:
        """The tools of an ``env.<task>`` section (built-in names or ``module:function`` paths)."""
        return cls(
            registry=build_tool_registry(cfg.tools, cfg.sandbox),
            max_tool_response_length=cfg.max_tool_response_length,
            tool_response_truncate_side=cfg.tool_response_truncate_side,
            max_parallel_calls=cfg.max_parallel_calls,
        )

    def schemas(self) -> list[dict[str, Any]]:
        """The ``tools=`` argument of ``apply_chat_template`` for this task's prompts."""
        return self.registry.schemas()

    def run(self, calls: Sequence[ToolCall | MalformedToolCall]) -> list[ToolResult]:
        """The results of one turn's calls, in order, each cut to the response length; never raises."""
        results = [
            ToolResult(
                name=r.name,
                content=truncate_tool_response(
                    r.content, self.max_tool_response_length, self.tool_response_truncate_side
                ),
                is_error=r.is_error,
            )
            for r in (self.registry.call(call) for call in calls[: self.max_parallel_calls])
        ]
        return results + [
            ToolResult(
                name=call.name if isinstance(call, ToolCall) else None,
                content=f"Error: at most {self.max_parallel_calls} tool call(s) per turn run; this one did not",
                is_error=True,
            )
            for call in calls[self.max_parallel_calls :]
        ]


def wire_task_tools(
    env_cfg: EnvConfig, datasets: Iterable[Sequence[DatumSpec] | None]
) -> dict[str, TaskTools]:
    """Build the tools of every ``env.<task>`` section that declares some (:func:`build_task_tools`) and
    declare their schemas in the prompts of ``datasets`` of those tasks: the one place a run wires its tools,
    so that the tools the chat template shows the model are the ones its rollouts run. Called once at
    start-up, before any prompt is read for training.

    Only a :class:`~nemo_rl.data.datasets.ProcessedDataset` (prompts tokenized when read) can be given the
    schemas; samples tokenized already (a list of :class:`DatumSpec`) must have been formatted with them.

    Raises:
        UserError: a tool name is neither built in nor an importable ``module:function``, or a dataset's
            prompts declare other tools than its task's ``env.<task>.tools``.
    """
    task_to_tools = build_task_tools(env_cfg)
    for dataset in datasets:
        if not isinstance(dataset, ProcessedDataset) or dataset.spec.task_name not in task_to_tools:
            continue
        task = dataset.spec.task_name
        schemas = tuple(task_to_tools[task].schemas())
        if dataset.spec.tools and dataset.spec.tools != schemas:
            raise UserError(
                f"the prompts of task {task!r} ({dataset.source}) already declare other tools than "
                f"env.{task}.tools; leave the dataset's tools empty: the run declares env.{task}.tools"
            )
        dataset.spec = dataclasses.replace(dataset.spec, tools=schemas)
    return task_to_tools


def build_task_tools(env_cfg: EnvConfig) -> dict[str, TaskTools]:
    """The tools of every ``env.<task>`` section whose ``tools`` list is not empty, by task.

    Raises:
        UserError: a tool name is neither built in nor an importable ``module:function``.
    """
    return {name: TaskTools.from_config(section) for name, section in env_cfg.tool_sections().items()}
