"""Processors: one canonical record -> one :class:`DatumSpec` (a message log plus training bookkeeping).

- :data:`sft_processor`: the whole conversation, for supervised fine-tuning (loss on assistant turns).
- :data:`math_processor`: the prompt only, ending with the generation prompt, plus the ground truth the math
  environment checks the response against.
- :data:`preference_processor`: the conversations with the chosen and the rejected response, for DPO and
  reward models.

Each is a :class:`~nemo_rl.data.interfaces.RecordProcessor`, so a dataset can use any of them, or a user's
own :data:`~nemo_rl.data.interfaces.Processor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl.data.errors import DataError
from nemo_rl.data.interfaces import (
    ChatMessage,
    DatumSpec,
    MessageLog,
    ProcessorInput,
    Record,
    RecordProcessor,
    TaskDataSpec,
)
from nemo_rl.data.llm_message_utils import format_message_log, message_log_length, truncate_message_log


def apply_task_spec(messages: list[ChatMessage], spec: TaskDataSpec) -> list[ChatMessage]:
    """The conversation with the spec's prompt template applied to every user turn and its system prompt
    put first when the conversation has no system message."""
    formatted = [
        ChatMessage(
            role=m["role"], content=spec.apply_prompt(m["content"]) if m["role"] == "user" else m["content"]
        )
        for m in messages
    ]
    if spec.system_prompt is not None and not any(m["role"] == "system" for m in formatted):
        formatted.insert(0, ChatMessage(role="system", content=spec.system_prompt))
    return formatted


def format_conversation(
    messages: list[ChatMessage],
    spec: TaskDataSpec,
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[dict[str, Any]] | None = None,
) -> MessageLog:
    """A whole training conversation as a message log, formatted as ``spec`` asks (prompt template, system
    prompt, BOS/EOS tokens, generation prompt, declared tools: ``tools`` when given, else the spec's)."""
    return format_message_log(
        apply_task_spec(messages, spec),
        tokenizer,
        add_bos=spec.add_bos,
        add_eos=spec.add_eos,
        add_generation_prompt=spec.add_generation_prompt,
        tools=spec.tools if tools is None else tools,
    )


class SftProcessor(RecordProcessor):
    """The full conversation as a message log, for SFT.

    Conversations longer than ``max_seq_length`` are kept whole here; the SFT collate function truncates
    them (see :func:`nemo_rl.data.collate_fn.sft_collate_fn`).
    """

    def process(self, record: Record, given: ProcessorInput) -> DatumSpec:
        """The sample of one conversation (see the class docstring)."""
        if not any(m["role"] == "assistant" for m in record["messages"]):
            raise DataError(
                f"sample {given.idx} has no assistant message, so SFT has nothing to learn from it"
            )
        message_log = format_conversation(
            record["messages"], given.spec, given.tokenizer, record.get("tools")
        )
        return given.datum(message_log, length=message_log_length(message_log))


sft_processor = SftProcessor()
"""The :class:`SftProcessor`."""


def last_user_turn(messages: Sequence[ChatMessage]) -> int | None:
    """Index of the last user message (where an RL prompt ends), None when there is none."""
    return max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)


class MathProcessor(RecordProcessor):
    """The prompt of a verifiable problem, for RL: every turn up to the last user turn, then the
    generation prompt; ``extra_env_info`` holds ``{"ground_truth": expected_answer}``.

    The ground truth is ``record["expected_answer"]``, or else the content of the assistant message that
    follows the last user turn. A prompt longer than ``max_seq_length`` is cut to half of it (so the response
    still has room) and gets ``loss_multiplier`` 0: it still flows through generation without crashing, but
    is never trained on.
    """

    def process(self, record: Record, given: ProcessorInput) -> DatumSpec:
        """The sample of one problem (see the class docstring)."""
        spec, idx, max_seq_length = given.spec, given.idx, given.max_seq_length
        messages = record["messages"]
        last_user = last_user_turn(messages)
        if last_user is None:
            raise DataError(f"sample {idx} has no user message to use as the prompt")
        if "expected_answer" in record:
            ground_truth = record["expected_answer"]
        elif last_user + 1 < len(messages) and messages[last_user + 1]["role"] == "assistant":
            ground_truth = messages[last_user + 1]["content"]
        else:
            raise DataError(
                f"sample {idx} has no ground truth: give it an 'expected_answer' or an assistant reply after "
                "the last user message"
            )
        if not ground_truth.strip():
            # An empty answer would match an empty \boxed{} and reward it.
            raise DataError(f"sample {idx} has an empty ground truth; give it a non-empty 'expected_answer'")
        message_log = format_message_log(
            apply_task_spec(list(messages[: last_user + 1]), spec),
            given.tokenizer,
            add_bos=spec.add_bos,
            add_eos=False,
            add_generation_prompt=True,
            tools=record.get("tools", spec.tools),
        )
        length = message_log_length(message_log)
        loss_multiplier = 1.0
        if length > max_seq_length:
            message_log = truncate_message_log(message_log, max(1, max_seq_length // 2))
            length = message_log_length(message_log)
            loss_multiplier = 0.0
        return given.datum(
            message_log,
            length=length,
            extra_env_info={"ground_truth": ground_truth},
            loss_multiplier=loss_multiplier,
        )


math_processor = MathProcessor()
"""The :class:`MathProcessor`."""


class PreferenceProcessor(RecordProcessor):
    """Both conversations of a preference pair: ``message_log`` with the chosen response and
    ``rejected_message_log`` with the rejected one; ``length`` is the longer of the two.

    Like SFT conversations, pairs longer than ``max_seq_length`` are truncated by the collate function
    (see :func:`nemo_rl.data.collate_fn.preference_collate_fn`).
    """

    def process(self, record: Record, given: ProcessorInput) -> DatumSpec:
        """The sample of one pair (see the class docstring)."""
        if "rejected_messages" not in record:
            raise DataError(
                f"sample {given.idx} has no rejected response: preference training needs "
                "data.dataset_name=binary_preference (prompt, chosen and rejected columns)"
            )

        def format_response(messages: list[ChatMessage]) -> MessageLog:
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError(f"sample {given.idx} has a response without an assistant message")
            return format_conversation(messages, given.spec, given.tokenizer)

        chosen = format_response(record["messages"])
        rejected = format_response(record["rejected_messages"])
        datum = given.datum(chosen, length=max(message_log_length(chosen), message_log_length(rejected)))
        datum["rejected_message_log"] = rejected
        return datum


preference_processor = PreferenceProcessor()
"""The :class:`PreferenceProcessor`."""
