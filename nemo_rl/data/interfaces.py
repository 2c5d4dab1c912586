"""Types shared by datasets, processors, collate functions and rollouts.

A *record* is one dataset row in the canonical form every source is converted to: a conversation in OpenAI
format plus, for verifiable tasks, the expected answer. A *message log* is that conversation tokenized turn
by turn: each message carries the token ids of its span of the chat-template rendering, so concatenating
them gives exactly the rendering's tokens. A *datum* is what a processor makes of a record: the message log
plus bookkeeping for training (length, loss multiplier, environment info).
"""

from __future__ import annotations

import dataclasses
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NotRequired, TypedDict

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.data import DataConfig
from nemo_rl.data.errors import DataError
from nemo_rl.utils.files import existing_file, read_utf8


class ChatMessage(TypedDict):
    """One turn of a conversation in OpenAI format."""

    role: str
    content: str


class Record(TypedDict):
    """A dataset row in canonical form."""

    messages: list[ChatMessage]
    """The conversation; for SFT it ends with the assistant reply to learn."""

    expected_answer: NotRequired[str]
    """Ground truth checked by a verifier (math answer); RL falls back to the last assistant message."""

    rejected_messages: NotRequired[list[ChatMessage]]
    """Preference data only: the same prompt followed by the dispreferred response (``messages`` holds the
    preferred one)."""

    tools: NotRequired[list[dict[str, Any]]]
    """JSON schemas of the tools the conversation declares (rendered with ``apply_chat_template(tools=...)``);
    they replace the task's own (:attr:`TaskDataSpec.tools`) for this record."""


class LLMMessage(TypedDict):
    """One tokenized turn of a message log.

    ``content`` is the text of the turn's span of the chat-template rendering (role headers included), so
    ``tokenizer.decode(token_ids)`` gives it back.
    """

    role: str
    content: str
    token_ids: torch.Tensor
    """1-D long tensor."""


MessageLog = list[LLMMessage]


class DatumSpec(TypedDict):
    """One processed sample, as produced by a processor and consumed by a collate function."""

    message_log: MessageLog
    length: int
    """Total number of tokens in ``message_log``."""

    extra_env_info: dict[str, Any] | None
    """What the environment needs to score a response (``{"ground_truth": ...}`` for math); ``None`` for SFT."""

    loss_multiplier: float
    """0 for samples that must not be trained on (e.g. prompts cut to fit ``max_input_seq_length``)."""

    idx: int
    """Index of the sample in its dataset."""

    task_name: str
    """Which environment / task the sample belongs to (``"math"`` for RL math problems)."""

    stop_strings: NotRequired[list[str] | None]
    """RL only: stop strings of the sample's first response, added to ``policy.generation.stop_strings``
    (environments set those of later turns)."""

    rejected_message_log: NotRequired[MessageLog]
    """Preference data only: the conversation with the dispreferred response (``message_log`` holds the
    preferred one)."""

    pixel_values: NotRequired[torch.Tensor]
    """Multimodal samples only: the processor's patches of the sample's images, [patches, values per patch]
    float32 (``nemo_rl.data.vlm``)."""

    image_grid_thw: NotRequired[torch.Tensor]
    """Multimodal samples only: each image's (temporal, height, width) patch grid, [images, 3] long."""


@dataclasses.dataclass(frozen=True)
class TaskDataSpec:
    """How the records of one task are turned into prompts.

    Build it from the ``data`` section with :meth:`from_config`, which reads the prompt files.
    """

    task_name: str
    """Task of the samples (the environment that scores them in RL)."""

    prompt: str | None
    """Template for user turns with one ``{}`` for the original content; ``None`` keeps the content."""

    system_prompt: str | None
    """System message put first in every conversation that has none; ``None`` adds nothing."""

    add_bos: bool
    """Start each conversation with BOS when the chat template does not."""

    add_eos: bool
    """End each training conversation with EOS when the chat template does not."""

    add_generation_prompt: bool
    """In training conversations, count the assistant header after a user turn as part of that turn."""

    tools: tuple[dict[str, Any], ...] = ()
    """JSON schemas of the tools the task's conversations may call (``apply_chat_template(tools=...)``), as
    ``env.<task>.tools`` builds them; empty: the template renders no tools."""

    def __post_init__(self) -> None:
        if self.prompt is not None:
            check_prompt_template(self.prompt, source="the prompt template")

    @classmethod
    def from_config(
        cls, cfg: DataConfig, *, task_name: str, tools: Sequence[dict[str, Any]] = ()
    ) -> TaskDataSpec:
        """The spec described by the ``data`` section, with ``prompt_file`` and ``system_prompt_file`` read,
        declaring ``tools`` (their JSON schemas)."""
        spec = cls.from_prompt_files(
            task_name=task_name,
            prompt_file=cfg.prompt_file,
            system_prompt_file=cfg.system_prompt_file,
            add_bos=cfg.add_bos,
            add_eos=cfg.add_eos,
            add_generation_prompt=cfg.add_generation_prompt,
        )
        return dataclasses.replace(spec, tools=tuple(tools))

    @classmethod
    def from_prompt_files(
        cls,
        *,
        task_name: str,
        prompt_file: str | None,
        system_prompt_file: str | None,
        add_bos: bool,
        add_eos: bool = False,
        add_generation_prompt: bool = True,
    ) -> TaskDataSpec:
        """A spec whose prompt template and system prompt are read from ``data.prompt_file`` and
        ``data.system_prompt_file`` (``None``: none); ``add_eos`` and ``add_generation_prompt`` only matter
        for training conversations."""
        prompt = None
        if prompt_file is not None:
            prompt = _read_text_file(prompt_file, key="data.prompt_file")
            check_prompt_template(prompt, source=f"data.prompt_file={prompt_file}")
        system_prompt = None
        if system_prompt_file is not None:
            system_prompt = _read_text_file(system_prompt_file, key="data.system_prompt_file")
        return cls(
            task_name=task_name,
            prompt=prompt,
            system_prompt=system_prompt,
            add_bos=add_bos,
            add_eos=add_eos,
            add_generation_prompt=add_generation_prompt,
        )

    def apply_prompt(self, content: str) -> str:
        """``content`` placed in the prompt template (unchanged when there is none)."""
        return content if self.prompt is None else self.prompt.format(content)


def check_prompt_template(template: str, *, source: str) -> None:
    """Raise a :class:`DataError` (a ``ValueError``) naming ``source`` unless ``template`` has exactly one ``{}``
    field and no other fields."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise DataError(
            f"{source} is not a valid template ({err}): write literal braces as '{{{{' and '}}}}'"
        ) from err
    if fields != [""]:
        raise DataError(
            f"{source} must contain exactly one '{{}}' where the problem goes and no other fields, found "
            f"{[('{' + f + '}') for f in fields]}; write literal braces as '{{{{' and '}}}}' (e.g. \\boxed{{{{}}}})"
        )


def _read_text_file(path: str, *, key: str) -> str:
    file = existing_file(path, key=key, kind="text file")
    # A trailing newline is an artefact of the editor, not part of the prompt.
    return read_utf8(file).removesuffix("\n")


Processor = Callable[[Record, TaskDataSpec, PreTrainedTokenizerBase, int, int], DatumSpec]
"""Turns a record into a datum: ``processor(record, spec, tokenizer, max_seq_length, idx)`` returns the
sample for ``record``, the ``idx``-th row of its dataset. Any such callable is one; nemo_rl's own derive from
:class:`RecordProcessor`."""


@dataclasses.dataclass(frozen=True)
class ProcessorInput:
    """What a :class:`RecordProcessor` is given besides the record."""

    spec: TaskDataSpec
    """How the task formats its conversations."""
    tokenizer: PreTrainedTokenizerBase
    """Applies the chat template and tokenizes."""
    max_seq_length: int
    """Longest sample the policy takes."""
    idx: int
    """The record's row in its dataset."""

    def datum(
        self,
        message_log: MessageLog,
        *,
        length: int,
        extra_env_info: dict[str, Any] | None = None,
        loss_multiplier: float = 1.0,
    ) -> DatumSpec:
        """The record's sample: ``message_log`` of ``length`` tokens, tagged with this row and task."""
        return DatumSpec(
            message_log=message_log,
            length=length,
            extra_env_info=extra_env_info,
            loss_multiplier=loss_multiplier,
            idx=self.idx,
            task_name=self.spec.task_name,
        )


class RecordProcessor(ABC):
    """A :data:`Processor` written as :meth:`process`, which takes the record and one :class:`ProcessorInput`."""

    def __call__(
        self,
        record: Record,
        spec: TaskDataSpec,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_length: int,
        idx: int,
    ) -> DatumSpec:
        """The :data:`Processor` call: :meth:`process` of ``record``."""
        return self.process(record, ProcessorInput(spec, tokenizer, max_seq_length, idx))

    @abstractmethod
    def process(self, record: Record, given: ProcessorInput) -> DatumSpec:
        """The sample for ``record``."""
