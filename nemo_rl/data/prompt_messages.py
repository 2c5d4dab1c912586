"""Keeping each RL prompt as OpenAI messages next to its sample, for external agents (``grpo.agent``): an
agent is given the conversation to continue, not the tokens the chat template made of it."""

from __future__ import annotations

import dataclasses

from transformers import PreTrainedTokenizerBase

from nemo_rl.data.interfaces import DatumSpec, Processor, Record, TaskDataSpec
from nemo_rl.data.processors import apply_task_spec

PROMPT_MESSAGES_KEY = "prompt_messages"
"""The ``extra_env_info`` key under which :class:`KeepPromptMessages` keeps the prompt as OpenAI messages."""


@dataclasses.dataclass(frozen=True)
class KeepPromptMessages:
    """A processor that runs ``processor`` and also keeps the sample's prompt (every turn up to the last user
    turn, the task's prompt template and system prompt applied) as OpenAI messages in its
    ``extra_env_info[PROMPT_MESSAGES_KEY]``."""

    processor: Processor
    """Makes the sample itself (e.g. :func:`nemo_rl.data.processors.math_processor`)."""

    def __call__(
        self,
        record: Record,
        spec: TaskDataSpec,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_length: int,
        idx: int,
    ) -> DatumSpec:
        """``processor``'s sample for ``record``, its prompt messages added."""
        datum = self.processor(record, spec, tokenizer, max_seq_length, idx)
        messages = record["messages"]
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
        prompt = [dict(m) for m in apply_task_spec(list(messages[: last_user + 1]), spec)]
        datum["extra_env_info"] = {**(datum["extra_env_info"] or {}), PROMPT_MESSAGES_KEY: prompt}
        return datum
