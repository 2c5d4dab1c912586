"""Keeping each RL prompt as OpenAI messages next to its sample, for external agents (``grpo.agent``): an
agent is given the conversation to continue, not the tokens the chat template made of it."""

from __future__ import annotations

import dataclasses

from nemo_rl.data.interfaces import DatumSpec, Processor, ProcessorInput, Record, RecordProcessor
from nemo_rl.data.processors import apply_task_spec, last_user_turn

PROMPT_MESSAGES_KEY = "prompt_messages"
"""The ``extra_env_info`` key under which :class:`KeepPromptMessages` keeps the prompt as OpenAI messages."""


@dataclasses.dataclass(frozen=True)
class KeepPromptMessages(RecordProcessor):
    """A processor that runs ``processor`` and also keeps the sample's prompt (every turn up to the last user
    turn, the task's prompt template and system prompt applied) as OpenAI messages in its
    ``extra_env_info[PROMPT_MESSAGES_KEY]``."""

    processor: Processor
    """Makes the sample itself (e.g. :data:`nemo_rl.data.processors.math_processor`)."""

    def process(self, record: Record, given: ProcessorInput) -> DatumSpec:
        """``processor``'s sample for ``record``, its prompt messages added."""
        datum = self.processor(record, given.spec, given.tokenizer, given.max_seq_length, given.idx)
        messages = record["messages"]
        last_user = last_user_turn(messages)
        prompt_end = len(messages) if last_user is None else last_user + 1
        prompt = [dict(m) for m in apply_task_spec(list(messages[:prompt_end]), given.spec)]
        datum["extra_env_info"] = {**(datum["extra_env_info"] or {}), PROMPT_MESSAGES_KEY: prompt}
        return datum
