"""A tiny external agent with a tool, for ``examples/configs/grpo_agent_endpoint_tiny.yaml``: it asks the
policy a multiplication through the OpenAI API, offering the ``calculator`` tool; each call the model makes
comes back as OpenAI ``tool_calls``, which the agent runs (nemo_rl's calculator: arithmetic only, no
``eval``) and answers with ``tool`` messages, until the model answers in text. Reward: 1 for the right
``\\boxed{}`` answer, 0 otherwise (or after ``MAX_TURNS`` requests).

As a program (``grpo.agent.command``) it reads the task as JSON on stdin, takes ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` from its environment, and prints ``{"reward": x}``::

    echo '{"model": "examples/assets/tiny_tools_sft", "messages": [{"role": "user", "content": "What is 12*34?"}],
           "extra_env_info": {"ground_truth": "408"}}' \\
        | OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/agents/tiny_calculator_agent.py

As a function (``grpo.agent.function: examples/agents/tiny_calculator_agent.py:agent``) it runs in the driver.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from openai import OpenAI

from nemo_rl.environments.tools.calculator import CalculatorError, calculate, calculator_tool

MAX_TURNS = 3
"""Requests per problem: one for the call, one for the answer, one to spare."""

TOOLS: list[Any] = [calculator_tool().schema()]
"""The tools offered to the model (OpenAI's ``tools`` field)."""

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_answer(text: str | None) -> str | None:
    """The last ``\\boxed{...}`` answer of a reply (``None`` without one)."""
    found = _BOXED.findall(text or "")
    return found[-1].strip() if found else None


def run_call(name: str, arguments: str) -> str:
    """What a tool call returns to the model: the calculator's value, or what is wrong with the call."""
    try:
        expression = json.loads(arguments).get("expression") if name == "calculator" else None
    except (json.JSONDecodeError, AttributeError):
        expression = None
    if not isinstance(expression, str):
        return 'error: call calculator with {"expression": "<arithmetic>"}'
    try:
        return calculate(expression)
    except CalculatorError as err:
        return f"error: {err}"


def solve(client: OpenAI, model: str, messages: list[dict[str, Any]], ground_truth: str) -> float:
    """Ask with the calculator offered, run the calls the model makes, and score its final answer."""
    conversation: list[Any] = list(messages)
    for _ in range(MAX_TURNS):
        message = (
            client.chat.completions.create(model=model, messages=conversation, tools=TOOLS).choices[0].message
        )
        if not message.tool_calls:
            return float(boxed_answer(message.content) == ground_truth)
        # The response goes back as it came (content and tool calls), then one tool message per call.
        conversation.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [call.model_dump() for call in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            result = run_call(call.function.name, call.function.arguments)  # type: ignore[union-attr]
            conversation.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


def agent(task: Any) -> float:
    """The function form: ``task`` is a :class:`nemo_rl.experience.agent_rollouts.AgentTask`."""
    client = OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    return solve(client, task.model, task.messages, str(task.extra_env_info["ground_truth"]))


def main() -> None:
    """The program form: the task on stdin, the reward on stdout."""
    task = json.load(sys.stdin)
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    reward = solve(client, task["model"], task["messages"], str(task["extra_env_info"]["ground_truth"]))
    print(json.dumps({"reward": reward}))


if __name__ == "__main__":
    main()
