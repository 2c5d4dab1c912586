"""A tiny external agent for ``examples/configs/grpo_agent_endpoint_tiny.yaml``: it asks the policy the
arithmetic problem through the OpenAI API, and when the answer is wrong tells it so and asks once more.
Reward: 1 for a right first answer, 0.5 for a right second one, 0 otherwise.

As a program (``grpo.agent.command``) it reads the task as JSON on stdin, takes ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` from its environment, and prints ``{"reward": x}``::

    echo '{"messages": [{"role": "user", "content": "What is 2+3?"}], "extra_env_info": {"ground_truth": "5"}}' \\
        | OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/agents/tiny_math_agent.py

As a function (``grpo.agent.function: examples/agents/tiny_math_agent.py:agent``) it runs in the driver.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from openai import OpenAI

ATTEMPTS = 2
"""Answers the agent asks for before giving up."""

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_answer(text: str | None) -> str | None:
    """The last ``\\boxed{...}`` answer of a reply (``None`` without one)."""
    found = _BOXED.findall(text or "")
    return found[-1].strip() if found else None


def solve(client: OpenAI, messages: list[dict[str, Any]], ground_truth: str) -> float:
    """Ask, check, and ask again after a wrong answer; returns the reward."""
    conversation = list(messages)
    question = conversation[-1]["content"]
    for attempt in range(ATTEMPTS):
        reply = client.chat.completions.create(model="policy", messages=conversation, max_tokens=32)
        content = reply.choices[0].message.content or ""
        if boxed_answer(content) == ground_truth:
            return 1.0 / (attempt + 1)
        # The tiny model only knows "What is a+b?" questions, so the retry repeats the question.
        conversation += [{"role": "assistant", "content": content}, {"role": "user", "content": question}]
    return 0.0


def agent(task: Any) -> float:
    """The function form: ``task`` is a :class:`nemo_rl.experience.agent_rollouts.AgentTask`."""
    client = OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    return solve(client, task.messages, str(task.extra_env_info["ground_truth"]))


def main() -> None:
    """The program form: the task on stdin, the reward on stdout."""
    task = json.load(sys.stdin)
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    print(
        json.dumps({"reward": solve(client, task["messages"], str(task["extra_env_info"]["ground_truth"]))})
    )


if __name__ == "__main__":
    main()
