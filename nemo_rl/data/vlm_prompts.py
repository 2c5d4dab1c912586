"""Vision-language prompts for RL and evaluation: the conversation up to its last user turn (images included),
ending with the generation prompt, through the model's own Hugging Face processor as SFT reads it
(:mod:`nemo_rl.data.vlm`).

A sample carries its own ``pixel_values`` and ``image_grid_thw``; batches keep them per row
(:func:`nemo_rl.data.collate_fn.rl_collate_fn`), so the rollout hands each row's images to generation with its
prompt and the training batch hands them to the policy with the prompt and the response, whose tokens follow
the prompt's image placeholders. ``extra_env_info`` holds the ``ground_truth`` the environment checks.

A prompt cannot be cut to fit (that could cut an image's placeholders): a prompt longer than the limit is
refused. ``blank_images`` replaces every image by a blank one of the same size (the same placeholders), which
measures how much a model's answers depend on the pictures.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from PIL import Image
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.data import DataConfig
from nemo_rl.config.eval import EvalDataConfig
from nemo_rl.data.datasets import ProcessedDataset, check_prompt_lengths
from nemo_rl.data.datasets.formats import vlm_converter
from nemo_rl.data.datasets.loading import RecordDataset
from nemo_rl.data.errors import DataError
from nemo_rl.data.images import load_image
from nemo_rl.data.interfaces import (
    ChatMessage,
    DatumSpec,
    ProcessorInput,
    Record,
    RecordProcessor,
    TaskDataSpec,
)
from nemo_rl.data.llm_message_utils import format_message_log, message_log_length
from nemo_rl.data.processors import last_user_turn
from nemo_rl.data.tiny_clevr import BACKGROUND, tiny_clevr_splits
from nemo_rl.data.vlm import (
    SAMPLES_CHECKED_AT_SETUP,
    VlmMessage,
    VlmRecord,
    add_image_tensors,
    apply_spec,
    attach_images,
    check_dataset_images,
    checked_vlm_splits,
    message_images,
    processor_max_pixels,
)

BLANK_COLOUR = BACKGROUND
"""The colour of a blanked image: the grey of an empty ``tiny_clevr`` scene."""


def blank_like(image: Image.Image) -> Image.Image:
    """A blank RGB image of ``image``'s size (so the processor gives it the same placeholders)."""
    return Image.new("RGB", image.size, BLANK_COLOUR)


def _ground_truth(record: VlmRecord, last_user: int, where: str) -> str:
    """``expected_answer``, else the text of the assistant reply after the last user turn."""
    messages = record["messages"]
    answer: Any = record.get("expected_answer")
    if answer is None and last_user + 1 < len(messages) and messages[last_user + 1]["role"] == "assistant":
        answer = messages[last_user + 1]["content"]
    if not isinstance(answer, str) or not answer.strip():
        raise DataError(
            f"{where} has no ground truth: give it a non-empty 'expected_answer' or a text assistant reply after "
            "the last user message"
        )
    return answer


@dataclasses.dataclass(frozen=True)
class VlmPromptProcessor(RecordProcessor):
    """The prompt of a multimodal problem for RL and evaluation (see the module docstring)."""

    hf_processor: Any
    """The model's processor (its image processor and image token)."""
    max_image_pixels: int
    """The largest image accepted, in pixels."""
    source: str
    """The data's name in messages."""
    blank_images: bool = False
    """Replace every image by a blank one of the same size."""

    def process(self, record: Record, given: ProcessorInput) -> DatumSpec:
        """The sample of one problem (see the module docstring)."""
        where = f"{self.source}: row {given.idx}"
        vlm_record = cast(VlmRecord, record)
        last_user = last_user_turn(cast(list[ChatMessage], vlm_record["messages"]))
        if last_user is None:
            raise DataError(f"{where} has no user message to use as the prompt")
        ground_truth = _ground_truth(vlm_record, last_user, where)
        prompt: list[VlmMessage] = vlm_record["messages"][: last_user + 1]
        images = [
            load_image(v, where=where, max_pixels=self.max_image_pixels) for v in message_images(prompt)
        ]
        if self.blank_images:
            images = [blank_like(image) for image in images]
        spec = given.spec
        message_log = format_message_log(
            cast(list[ChatMessage], apply_spec(prompt, spec)),
            given.tokenizer,
            add_bos=spec.add_bos,
            add_eos=False,
            add_generation_prompt=True,
        )
        inputs = attach_images(message_log, images, self.hf_processor, given.tokenizer, where)
        length = message_log_length(message_log)
        if length >= given.max_seq_length:
            raise DataError(
                f"{where} has a prompt of {length} tokens (its images included), leaving no room for a response "
                f"within {given.max_seq_length}: raise policy.max_total_sequence_length (or "
                "data.max_input_seq_length) or give smaller images"
            )
        datum = given.datum(message_log, length=length, extra_env_info={"ground_truth": ground_truth})
        add_image_tensors(datum, inputs)
        return datum


def vlm_task_name(cfg: DataConfig) -> str:
    """The environment scoring the prompts: ``data.env_name``, else the dataset's own (``tiny_clevr``,
    ``clevr-cogent``; ``vlm`` for other multimodal chats), as NeMo RL names them."""
    if cfg.env_name is not None:
        return cfg.env_name
    return cfg.dataset_name if cfg.dataset_name in ("tiny_clevr", "clevr-cogent") else "vlm"


def _checked(dataset: ProcessedDataset) -> ProcessedDataset:
    """``dataset`` after processing its first samples, so a template or length problem fails at setup."""
    for i in range(min(len(dataset), SAMPLES_CHECKED_AT_SETUP)):
        dataset[i]
    return dataset


def setup_vlm_rl_data(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, hf_processor: Any, *, max_total_sequence_length: int
) -> tuple[ProcessedDataset, ProcessedDataset | None]:
    """Multimodal prompts for RL (:class:`VlmPromptProcessor`; task :func:`vlm_task_name`).

    Before any worker starts, every image of both splits is read and checked (the first bad one raises its
    one-line :class:`~nemo_rl.data.images.BadImageError`) and the first samples of each split are processed.
    """
    train, validation = checked_vlm_splits(
        cfg,
        tokenizer,
        hf_processor,
        VlmPromptProcessor,
        task_name=vlm_task_name(cfg),
        max_total_sequence_length=max_total_sequence_length,
    )
    limit_key = (
        f"data.max_input_seq_length={cfg.max_input_seq_length}"
        if cfg.max_input_seq_length
        else f"policy.max_total_sequence_length={max_total_sequence_length}"
    )
    check_prompt_lengths(train, max_total_sequence_length, limit_key)
    return train, validation


def setup_vlm_eval_data(
    cfg: EvalDataConfig,
    tokenizer: PreTrainedTokenizerBase,
    hf_processor: Any,
    *,
    max_total_sequence_length: int,
) -> ProcessedDataset:
    """The held-out ``tiny_clevr`` scenes as prompts for ``data.env_name`` (the first ``data.num_val_samples``
    of ``data.seed``, never trained on by a recipe with the same seed), their images blanked with
    ``data.blank_images``."""
    _, rows = tiny_clevr_splits(
        0,
        cfg.num_val_samples,
        seed=cfg.seed,
        image_size=cfg.tiny_clevr_image_size,
        max_objects=cfg.tiny_clevr_max_objects,
    )
    source = "tiny_clevr (held-out)"
    records = RecordDataset(rows, vlm_converter(source, "messages"), source)
    if cfg.max_num_problems is not None:
        records = RecordDataset(rows, records.converter, source, records.indices[: cfg.max_num_problems])
    limit = processor_max_pixels(hf_processor)
    check_dataset_images(records, source=source, max_pixels=limit)
    spec = TaskDataSpec.from_prompt_files(
        task_name=cfg.env_name,
        prompt_file=cfg.prompt_file,
        system_prompt_file=cfg.system_prompt_file,
        add_bos=cfg.add_bos,
    )
    processor = VlmPromptProcessor(hf_processor, limit, source, blank_images=cfg.blank_images)
    max_seq_length = cfg.max_input_seq_length or max_total_sequence_length
    return _checked(ProcessedDataset(records, processor, spec, tokenizer, max_seq_length))
