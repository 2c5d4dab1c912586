"""Vision-language data: conversations whose messages hold images, turned into samples by the model's own
Hugging Face processor (NeMo RL's ``data.processor: vlm_hf_data_processor``).

A multimodal message's ``content`` is a string or a list of parts, ``{"type": "text", "text": ...}`` and
``{"type": "image", "image": ...}`` (the image a path, bytes, a PIL image or a ``datasets`` Image; see
:mod:`nemo_rl.data.images`), the layout of OpenAI-style and Hugging Face multimodal chats.

:class:`VlmSftProcessor` makes a sample of the whole conversation: the chat template renders each image as
one placeholder (``<|image_pad|>`` for Qwen2.5-VL), the processor's image processor resizes the images and
cuts them into patches (``pixel_values`` [patches, channels x temporal x patch x patch] and
``image_grid_thw`` [images, 3]), and each placeholder is repeated once per merged patch, as the processor's
own ``__call__`` does, so the message log's tokens are exactly those the processor gives for the rendered
text. The sample carries its own ``pixel_values`` and ``image_grid_thw``; batches keep them per row (a list
entry per row, ``None`` for a row without images), so micro-batching, sharding and a later generation step
select a row's images with its tokens.

Every image of a dataset is read and checked when the dataset is set up (:func:`check_dataset_images`), so a
bad one ends the run with one line naming the row and the file before any worker starts.

Tensor legend: N = patches of a sample's images, D = values per patch, I = images of a sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NotRequired, TypedDict, cast

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.data import DataConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.datasets import ProcessedDataset, load_dataset_splits
from nemo_rl.data.errors import DataError
from nemo_rl.data.images import load_image
from nemo_rl.data.interfaces import (
    ChatMessage,
    DatumSpec,
    MessageLog,
    ProcessorInput,
    Record,
    RecordProcessor,
    TaskDataSpec,
)
from nemo_rl.data.llm_message_utils import format_message_log, message_log_length

VLM_PROCESSOR_NAME = "vlm_hf_data_processor"
"""NeMo RL's name of the multimodal processor (``data.processor``)."""


class VlmMessage(TypedDict):
    """One turn of a multimodal conversation: text, or a list of text and image parts."""

    role: str
    content: str | list[dict[str, Any]]


class VlmRecord(TypedDict):
    """A dataset row of a multimodal dataset in canonical form (as :class:`~nemo_rl.data.interfaces.Record`)."""

    messages: list[VlmMessage]
    expected_answer: NotRequired[str]


def message_images(messages: Sequence[VlmMessage]) -> list[Any]:
    """The image values of ``messages``' image parts, in order."""
    return [
        part["image"]
        for message in messages
        if not isinstance(message["content"], str)
        for part in message["content"]
        if part.get("type") == "image"
    ]


def load_hf_processor(policy: PolicyConfig) -> Any:
    """The model's own Hugging Face processor (``AutoProcessor`` of ``policy.tokenizer.name`` or
    ``policy.model_name``); a folder without one is a :class:`UserError`."""
    from transformers import AutoProcessor

    name = policy.tokenizer.name or policy.model_name
    try:
        processor = AutoProcessor.from_pretrained(name, trust_remote_code=policy.trust_remote_code)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"policy.model_name={name}: its processor cannot be loaded ({first})") from err
    if getattr(processor, "image_processor", None) is None:
        raise UserError(
            f"policy.model_name={name} has no image processor (processor_config.json / "
            "preprocessor_config.json): give a vision-language model"
        )
    return processor


def processor_max_pixels(hf_processor: Any) -> int:
    """The largest image area (pixels) the processor resizes to (Qwen2-VL's ``max_pixels``)."""
    image_processor = hf_processor.image_processor
    size = getattr(image_processor, "size", None) or {}
    limit = size.get("longest_edge") or getattr(image_processor, "max_pixels", None)
    if not limit:
        raise UserError(f"{type(image_processor).__name__} declares no max_pixels: set data.max_image_pixels")
    return int(limit)


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """A sample's images as the model reads them."""

    pixel_values_ND: torch.Tensor
    image_grid_thw_I3: torch.Tensor
    tokens_per_image: list[int]
    """Placeholder tokens each image takes in the text (its merged patches)."""


def image_inputs(hf_processor: Any, images: list[Any]) -> ImageInputs:
    """The processor's patches of ``images`` (decoded RGB PIL images)."""
    out = hf_processor.image_processor(images=images, return_tensors="pt")
    grid_I3 = out["image_grid_thw"].long()
    merge = int(hf_processor.image_processor.merge_size)
    tokens = [int(n) for n in (grid_I3.prod(dim=-1) // merge**2).tolist()]
    return ImageInputs(out["pixel_values"].float(), grid_I3, tokens)


def expand_placeholders(message_log: MessageLog, token_id: int, tokens: list[int], where: str) -> None:
    """Repeat the ``k``-th placeholder of the log ``tokens[k]`` times (in place), as the processor does."""
    found = sum(int((m["token_ids"] == token_id).sum()) for m in message_log)
    if found != len(tokens):
        raise DataError(
            f"{where}: the chat template renders {found} image placeholders for {len(tokens)} images: give the "
            "model's own chat template (policy.tokenizer.chat_template)"
        )
    counts = iter(tokens)
    for message in message_log:
        ids = message["token_ids"]
        if not bool((ids == token_id).any()):
            continue
        repeats = torch.tensor([next(counts) if int(t) == token_id else 1 for t in ids.tolist()])
        message["token_ids"] = ids.repeat_interleave(repeats)


def apply_spec(messages: list[VlmMessage], spec: TaskDataSpec) -> list[VlmMessage]:
    """The spec's prompt template applied to the text of user turns, and its system prompt put first."""

    def user_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(content, str):
            return spec.apply_prompt(content)
        return [{**p, "text": spec.apply_prompt(p["text"])} if p["type"] == "text" else p for p in content]

    out = [
        VlmMessage(
            role=m["role"], content=user_content(m["content"]) if m["role"] == "user" else m["content"]
        )
        for m in messages
    ]
    if spec.system_prompt is not None and not any(m["role"] == "system" for m in out):
        out.insert(0, VlmMessage(role="system", content=spec.system_prompt))
    return out


@dataclasses.dataclass(frozen=True)
class VlmSftProcessor(RecordProcessor):
    """The whole multimodal conversation as a sample for SFT, with its ``pixel_values`` and
    ``image_grid_thw`` (see the module docstring). A conversation longer than ``max_seq_length`` is refused:
    cutting it could cut an image's placeholders, which the model cannot read."""

    hf_processor: Any
    """The model's processor (its image processor and image token)."""
    max_image_pixels: int
    """The largest image accepted, in pixels."""
    source: str
    """The data's name in messages."""

    def process(self, record: Record, given: ProcessorInput) -> DatumSpec:
        """The sample of one conversation (see the class docstring)."""
        where = f"{self.source}: row {given.idx}"
        messages = cast(VlmRecord, record)["messages"]
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where} has no assistant message, so SFT has nothing to learn from it")
        images = [
            load_image(v, where=where, max_pixels=self.max_image_pixels) for v in message_images(messages)
        ]
        spec = given.spec
        message_log = format_message_log(
            cast(list[ChatMessage], apply_spec(messages, spec)),
            given.tokenizer,
            add_bos=spec.add_bos,
            add_eos=spec.add_eos,
            add_generation_prompt=spec.add_generation_prompt,
        )
        datum = self._with_images(message_log, images, given, where)
        if datum["length"] > given.max_seq_length:
            raise DataError(
                f"{where} has {datum['length']} tokens (its images included), more than the {given.max_seq_length} "
                "allowed: raise policy.max_total_sequence_length (or data.max_input_seq_length) or give smaller "
                "images"
            )
        return datum

    def _with_images(
        self, message_log: MessageLog, images: list[Any], given: ProcessorInput, where: str
    ) -> DatumSpec:
        inputs = attach_images(message_log, images, self.hf_processor, given.tokenizer, where)
        datum = given.datum(message_log, length=message_log_length(message_log))
        add_image_tensors(datum, inputs)
        return datum


def attach_images(
    message_log: MessageLog,
    images: list[Any],
    hf_processor: Any,
    tokenizer: PreTrainedTokenizerBase,
    where: str,
) -> ImageInputs | None:
    """The processor's patches of ``images``, with the log's placeholders repeated to match (in place, each
    message's text rewritten as the model reads it); ``None`` for a log without images."""
    if not images:
        return None
    inputs = image_inputs(hf_processor, images)
    expand_placeholders(message_log, int(hf_processor.image_token_id), inputs.tokens_per_image, where)
    for message in message_log:
        # The log's text is what the model reads, placeholders repeated (decode gives one string here).
        message["content"] = str(tokenizer.decode(message["token_ids"], skip_special_tokens=False))
    return inputs


def add_image_tensors(datum: DatumSpec, inputs: ImageInputs | None) -> None:
    """Put a sample's ``pixel_values`` and ``image_grid_thw`` on it (nothing for a sample without images)."""
    if inputs is not None:
        datum["pixel_values"] = inputs.pixel_values_ND
        datum["image_grid_thw"] = inputs.image_grid_thw_I3


def check_dataset_images(records: Sequence[Record], *, source: str, max_pixels: int) -> int:
    """Read and check every image of ``records`` (see :func:`nemo_rl.data.images.load_image`); returns how
    many there are. The first bad one raises its one-line :class:`~nemo_rl.data.images.BadImageError`."""
    count = 0
    for index, record in enumerate(records):
        for value in message_images(cast(VlmRecord, record)["messages"]):
            load_image(value, where=f"{source}: row {index}", max_pixels=max_pixels)
            count += 1
    return count


def image_pixel_limit(cfg: DataConfig, hf_processor: Any) -> int:
    """The largest image accepted: ``data.max_image_pixels``, else the processor's own ``max_pixels``."""
    return cfg.max_image_pixels or processor_max_pixels(hf_processor)


def vlm_sft_processor(cfg: DataConfig, hf_processor: Any, source: str) -> VlmSftProcessor:
    """The SFT processor of the ``data`` section for ``hf_processor``."""
    return VlmSftProcessor(hf_processor, image_pixel_limit(cfg, hf_processor), source)


SAMPLES_CHECKED_AT_SETUP = 256
"""How many samples of each split :func:`setup_vlm_sft_data` processes at setup (length and template checks)."""


def setup_vlm_sft_data(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, hf_processor: Any, *, max_total_sequence_length: int
) -> tuple[ProcessedDataset, ProcessedDataset | None]:
    """Multimodal conversations for SFT (task ``"sft"``), each processed by :class:`VlmSftProcessor` when read.

    Before any worker starts, every image of both splits is read and checked (the first bad one raises its
    one-line :class:`~nemo_rl.data.images.BadImageError`), and the first :data:`SAMPLES_CHECKED_AT_SETUP`
    samples of each split are processed, so an image the chat template does not render or a conversation
    longer than the limit fails now rather than mid-run.
    """
    return checked_vlm_splits(
        cfg,
        tokenizer,
        hf_processor,
        VlmSftProcessor,
        task_name="sft",
        max_total_sequence_length=max_total_sequence_length,
    )


def checked_vlm_splits(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    hf_processor: Any,
    processor_cls: Callable[[Any, int, str], RecordProcessor],
    *,
    task_name: str,
    max_total_sequence_length: int,
) -> tuple[ProcessedDataset, ProcessedDataset | None]:
    """Both splits of ``cfg``'s data read through ``processor_cls(hf_processor, pixel limit, source)``: every image
    checked and the first :data:`SAMPLES_CHECKED_AT_SETUP` samples processed before any worker starts."""
    splits = load_dataset_splits(cfg)
    spec = TaskDataSpec.from_config(cfg, task_name=task_name)
    limit = image_pixel_limit(cfg, hf_processor)
    max_seq_length = cfg.max_input_seq_length or max_total_sequence_length
    datasets: list[ProcessedDataset | None] = []
    for records in (splits.train, splits.validation):
        if records is None:
            datasets.append(None)
            continue
        check_dataset_images(records, source=records.source, max_pixels=limit)
        dataset = ProcessedDataset(
            records, processor_cls(hf_processor, limit, records.source), spec, tokenizer, max_seq_length
        )
        for i in range(min(len(dataset), SAMPLES_CHECKED_AT_SETUP)):
            dataset[i]
        datasets.append(dataset)
    return cast(ProcessedDataset, datasets[0]), datasets[1]
