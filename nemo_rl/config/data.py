"""Schema of the ``data`` section: which dataset to load, how to split it and how to format its prompts."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from nemo_rl.config.base import ConfigModel

DatasetName = Literal[
    "tiny_math",
    "OpenMathInstruct-2",
    "squad",
    "openai_format",
    "response",
    "binary_preference",
    "HelpSteer3",
    "Tulu3Preference",
    "tiny_math_preference",
    "DAPOMath17K",
    "DAPOMathAIME2024",
    "DeepScaler",
    "AIME2024",
    "tiny_clevr",
    "clevr-cogent",
]
"""The dataset formats nemo_rl reads.

- ``tiny_math``: arithmetic problems generated on the fly (no files); OpenMathInstruct-2's schema.
- ``OpenMathInstruct-2``: ``problem``, ``generated_solution``, ``expected_answer`` (hub nvidia/OpenMathInstruct-2).
- ``squad``: ``context``, ``question``, ``answers`` (hub rajpurkar/squad).
- ``openai_format``: chat data, a list of ``{"role", "content"}`` messages under ``data.chat_key``.
- ``response``: one input column and one output column (``data.input_key``, ``data.output_key``).
- ``binary_preference``: a prompt with a chosen and a rejected response (``data.prompt_key``,
  ``data.chosen_key``, ``data.rejected_key``), for DPO and reward models.
- ``HelpSteer3``: ``context``, ``response1``, ``response2``, ``overall_preference`` (hub nvidia/HelpSteer3,
  subset ``preference``); a negative preference prefers ``response1``, a positive one ``response2``.
- ``Tulu3Preference``: ``chosen`` and ``rejected`` conversations that share all but their last (assistant)
  message (hub allenai/llama-3.1-tulu-3-8b-preference-mixture).
- ``tiny_math_preference``: the ``tiny_math`` problems as preference pairs (the correct boxed answer chosen,
  a plausible wrong one rejected), generated on the fly.
- ``DAPOMath17K``: DAPO's math problems in verl's layout: ``prompt`` (a message list; its first message holds
  the problem with DAPO's ``Answer:`` instruction) and ``reward_model.ground_truth`` (hub
  BytedTsinghua-SIA/DAPO-Math-17k).
- ``DAPOMathAIME2024``: AIME 2024 in the same layout (hub BytedTsinghua-SIA/AIME-2024), DAPO's validation set.
- ``DeepScaler``: ``problem`` and ``answer`` (hub agentica-org/DeepScaleR-Preview-Dataset).
- ``AIME2024``: ``problem`` and ``answer`` (hub HuggingFaceH4/aime_2024).
- ``tiny_clevr``: pictures of coloured shapes to count, drawn on the fly (``nemo_rl.data.tiny_clevr``), for
  vision-language models; its rows are multimodal chats (images in the user turn).
- ``clevr-cogent``: ``image``, ``problem`` and ``solution`` (its answer between ``<answer>`` tags) of CLEVR-CoGenT
  (hub MMInstruction/Clevr_CoGenT_TrainA_70K_Complex; validation MMInstruction/Clevr_CoGenT_ValA or _ValB,
  ``data.val_split``), read as multimodal chats.
"""

MULTIMODAL_DATASETS: tuple[str, ...] = ("tiny_clevr", "clevr-cogent")
"""The ``dataset_name`` values whose rows hold images (read by ``nemo_rl.data.vlm``)."""

CLEVR_COGENT_VAL_SPLITS: tuple[str, ...] = ("valA", "valB")
"""NeMo RL's validation split names of ``clevr-cogent`` (each a hub dataset of its own)."""

PREFERENCE_DATASETS: tuple[str, ...] = (
    "binary_preference",
    "HelpSteer3",
    "Tulu3Preference",
    "tiny_math_preference",
)
"""The ``dataset_name`` values holding preference pairs (DPO and reward-model training)."""

GENERATED_DATASETS: tuple[str, ...] = ("tiny_math", "tiny_math_preference", "tiny_clevr")
"""The ``dataset_name`` values generated on the fly (they read no files)."""

PATH_ONLY_DATASETS: tuple[str, ...] = ("openai_format", "response", "binary_preference")
"""The ``dataset_name`` values with no hub default: a file or hub name must be given."""


def record_kind(name: DatasetName) -> str:
    """What the rows of dataset ``name`` become, which decides the processors that can read them:
    ``"preference pairs"`` (a chosen and a rejected conversation) or ``"conversations"`` (a prompt with a
    response and/or an expected answer)."""
    return "preference pairs" if name in PREFERENCE_DATASETS else "conversations"


class DatasetEntryConfig(ConfigModel):
    """One dataset of NeMo RL's ``data.train`` / ``data.validation`` / ``data.default`` layout.

    The entries are read into the flat keys of ``data`` when the config is validated (``data_path`` into
    ``train_data_path`` / ``val_data_path``, ``split_validation_size`` into ``val_fraction``, the other keys by
    name; a key the training entry leaves null is taken from ``data.default``), so the resolved config shows
    the flat keys."""

    dataset_name: DatasetName | None = None
    """Schema of the data (``data.dataset_name``)."""

    data_path: str | None = None
    """Local file or hub dataset name (``data.train_data_path`` / ``data.val_data_path``)."""

    split: str | None = None
    """Hub split; for the validation entry only the dataset's validation split (``validation`` or null)."""

    subset: str | None = None
    """Hub subset (``data.subset``)."""

    split_validation_size: float | None = None
    """Share of the training rows held out for validation (``data.val_fraction``)."""

    seed: int | None = None
    """Seed of the split and shuffling (``data.seed``)."""

    input_key: str | None = None
    """``data.input_key``."""

    output_key: str | None = None
    """``data.output_key``."""

    prompt_file: str | None = None
    """``data.prompt_file``."""

    system_prompt_file: str | None = None
    """``data.system_prompt_file``."""

    processor: str | None = None
    """``data.processor``."""

    max_image_pixels: int | None = None
    """``data.max_image_pixels``."""

    env_name: str | None = None
    """``data.env_name``."""

    repeat: int | None = Field(default=None, ge=1)
    """Validation entry only: times its rows are repeated (``data.val_repeat``)."""


_ENTRY_TO_FLAT = {"data_path": "train_data_path", "split_validation_size": "val_fraction"}
_NULL_MEANS_DEFAULT = ("output_key", "seed", "input_key")
"""Flat keys NeMo RL's v0.4 / v0.5 recipes write as null to mean "the default"."""


def _entry(value: Any, key: str) -> dict[str, Any]:
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(
                f"data.{key} lists {len(value)} datasets: training on several datasets at once is not built "
                f"here; give data.{key} one dataset"
            )
        value = value[0]
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_none=True)
    return {k: v for k, v in dict(value).items() if v is not None}


_VALIDATION_ENTRY_KEYS = ("dataset_name", "data_path", "split", "repeat")
"""Keys of NeMo RL's ``data.validation`` entry read for the validation data; its other keys must agree
with the training entry's (one processor, prompt and environment serve both)."""


def _validation_entry(val: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """The flat keys of NeMo RL's ``data.validation`` entry ``val``, given the merged training entry."""
    if val.get("split") not in (None, "validation"):
        raise ValueError(
            f"data.validation.split={val['split']!r}: only the dataset's usual validation split is read; "
            "give a file as data.validation.data_path instead"
        )
    for key, value in val.items():
        if key not in _VALIDATION_ENTRY_KEYS and train.get(key) != value:
            raise ValueError(
                f"data.validation.{key}={value!r} differs from data.train's {train.get(key)!r}: validation "
                f"prompts are built like the training ones; set {key} once, in data.default"
            )
    flat: dict[str, Any] = {}
    if val.get("dataset_name", train.get("dataset_name")) != train.get("dataset_name"):
        flat["val_dataset_name"] = val["dataset_name"]
    if "data_path" in val:
        flat["val_data_path"] = val["data_path"]
    if "repeat" in val:
        flat["val_repeat"] = val["repeat"]
    return flat


def _flatten_dataset_layout(data: dict[str, Any]) -> dict[str, Any]:
    """NeMo RL's ``train`` / ``validation`` / ``default`` entries read into the flat keys (see
    :class:`DatasetEntryConfig`); a flat key set to a different value than its entry is an error."""
    data = {k: v for k, v in data.items() if not (k in _NULL_MEANS_DEFAULT and v is None)}
    train, validation, default = data.get("train"), data.get("validation"), data.get("default")
    if train is None:
        if validation is not None or default is not None:
            raise ValueError("data.validation / data.default need data.train (NeMo RL's dataset layout)")
        return data
    merged = {**_entry(default, "default"), **_entry(train, "train")} if default else _entry(train, "train")
    if "repeat" in merged:
        raise ValueError(
            "data.train.repeat: repeating the training rows is not built here (only data.validation.repeat "
            "is); remove it"
        )
    flat: dict[str, Any] = {}
    for key, value in merged.items():
        if key == "split" and value == "train":
            continue  # the dataset's usual training split
        flat[_ENTRY_TO_FLAT.get(key, key)] = value
    if validation is not None:
        val = _entry(validation, "validation")
        # CLEVR-CoGenT's validation sets are splits of their own (NeMo RL's split names).
        if merged.get("dataset_name") == "clevr-cogent" and val.get("split") in CLEVR_COGENT_VAL_SPLITS:
            flat["val_split"] = val.pop("split")
        flat.update(_validation_entry(val, merged))
    for key, value in flat.items():
        if key in data and data[key] != value:
            raise ValueError(
                f"data.{key}={data[key]!r} and the data.train / data.default entry ({value!r}) disagree: "
                "set the key in one place"
            )
    # The entries are consumed: the validated config holds the flat keys only, so it saves, reloads and
    # accepts assignments like any other.
    rest = {k: v for k, v in data.items() if k not in ("train", "validation", "default")}
    return {**rest, **flat}


class DataConfig(ConfigModel):
    """Where the training and validation data come from and how each row becomes a prompt."""

    dataset_name: DatasetName = "tiny_math"
    """Schema of the data: ``tiny_math``, ``OpenMathInstruct-2``, ``squad``, ``openai_format``, ``response``,
    the math sets ``DAPOMath17K``, ``DAPOMathAIME2024``, ``DeepScaler``, ``AIME2024``, or the preference sets
    ``binary_preference``, ``HelpSteer3``, ``Tulu3Preference`` and ``tiny_math_preference``. With no
    ``train_data_path``, all but ``openai_format``, ``response`` and ``binary_preference`` load from the hub
    (``tiny_math`` and ``tiny_math_preference`` are generated)."""

    train_data_path: str | None = None
    """Local training file (``.jsonl``, ``.json`` with one object per line or one array, ``.parquet``, or ``.csv``
    with a header row) in the schema of ``dataset_name``, or a hub dataset name (``org/name``). ``None`` loads the dataset's hub default (not for
    ``openai_format`` / ``response`` / ``binary_preference``, which need a path)."""

    val_data_path: str | None = None
    """Local validation file or hub dataset name in the schema of ``val_dataset_name`` (by default the
    training data's); ``None`` uses the validation dataset's hub default, else the dataset's validation split,
    else carves one out of the training data with ``val_fraction``."""

    val_dataset_name: DatasetName | None = None
    """Schema of the validation data when it is another dataset than the training data (NeMo RL's
    ``data.validation.dataset_name``), e.g. ``DAPOMathAIME2024`` to validate a ``DAPOMath17K`` run; ``None``:
    the training data's. Both must hold the same kind of rows (preference pairs, or conversations), so one
    processor and one task serve both. It replaces the training data's own validation (no hold-out is made),
    and without ``val_data_path`` its hub default is read whole (its usual split)."""

    val_repeat: int = Field(default=1, ge=1)
    """Times the validation rows are repeated (NeMo RL's ``data.validation.repeat``), so a small set such as
    AIME is answered several times per validation."""

    split: str | None = None
    """Hub split used as training data; ``None`` uses the dataset's usual one (``train_1M`` for
    OpenMathInstruct-2, ``train`` otherwise). Ignored for local files."""

    subset: str | None = None
    """Hub subset (configuration) of ``train_data_path`` / ``val_data_path``; ``None`` uses the dataset's usual
    one (``preference`` for HelpSteer3, none otherwise). Ignored for local files, and for the validation data of
    a ``val_dataset_name`` of its own (which reads its usual subset)."""

    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Share of the training rows held out (seeded) for validation when the source has no validation split
    and no ``val_data_path`` or ``val_dataset_name`` of its own is given; 0 means no validation set."""

    input_key: str = "input"
    """Column holding the prompt for ``dataset_name: response``."""

    output_key: str = "output"
    """Column holding the target response (and the RL ground truth) for ``dataset_name: response``."""

    chat_key: str = "messages"
    """Column holding the OpenAI-format message list for ``dataset_name: openai_format``."""

    prompt_key: str = "prompt"
    """Column holding the prompt (a string for one user turn, or a message list) for
    ``dataset_name: binary_preference``."""

    chosen_key: str = "chosen"
    """Column holding the preferred response (a string for one assistant turn, or a message list) for
    ``dataset_name: binary_preference``."""

    rejected_key: str = "rejected"
    """Column holding the dispreferred response (a string or a message list) for
    ``dataset_name: binary_preference``."""

    prompt_file: str | None = None
    """Text file with a prompt template for user turns: ``{}`` marks where the problem goes (write literal
    braces as ``{{`` and ``}}``, e.g. ``\\boxed{{}}``); ``None`` uses the problem as is."""

    system_prompt_file: str | None = None
    """Text file whose content becomes a system message at the start of each conversation that has none."""

    add_system_prompt: bool = False
    """Pass ``add_system_prompt=true`` to every chat-template call (it is added to
    ``policy.tokenizer.chat_template_kwargs`` at load); a template that reads it adds its default system
    prompt (NeMo RL's sliding-puzzle recipe)."""

    env_name: str | None = None
    """Environment that scores RL prompts (their ``task_name``), e.g. ``reward_model`` to reward responses with
    the model of ``env.reward_model`` (NeMo RL's ``data.default.env_name``); ``None`` uses the dataset's own
    (``math`` for the math datasets). SFT and preference training ignore it."""

    max_input_seq_length: int | None = Field(default=None, ge=1)
    """Longest prompt (RL) or conversation (SFT) in tokens; ``None`` uses ``policy.max_total_sequence_length``.
    Longer RL prompts are cut and given ``loss_multiplier`` 0; longer SFT conversations are truncated."""

    shuffle: bool = True
    """Shuffle the training data, with a new seeded order every epoch."""

    seed: int = 42
    """Seed of the shuffling, the train/validation split and the ``tiny_math`` generator."""

    add_bos: bool = True
    """Start every conversation with the tokenizer's BOS token when its chat template does not."""

    add_eos: bool = True
    """End every training conversation (SFT) with the tokenizer's EOS token when the template does not."""

    add_generation_prompt: bool = True
    """In training conversations (SFT), count the assistant header that follows a user turn as part of that
    user turn, so no loss is put on it. RL prompts always end with the generation prompt."""

    num_train_samples: int = Field(default=1024, ge=1)
    """Training problems generated for ``dataset_name: tiny_math`` / ``tiny_math_preference`` (scenes for
    ``tiny_clevr``)."""

    num_val_samples: int = Field(default=64, ge=0)
    """Validation problems generated for ``dataset_name: tiny_math`` / ``tiny_math_preference`` / ``tiny_clevr`` (disjoint from
    the training problems; the same problems for a given ``seed`` whatever ``num_train_samples`` is)."""

    tiny_math_max_operand: int = Field(default=50, ge=1)
    """Largest operand of a ``tiny_math`` problem (operands are drawn from 0 to this value)."""

    tiny_math_rejected_per_problem: int = Field(default=1, ge=1)
    """Preference pairs per training problem of ``tiny_math_preference``: the correct answer against this many
    different plausible wrong answers (off by one or ten, the other operation, swapped operands, a slipped
    digit; a problem has 5 to 7, a larger value gives them all). Validation keeps one pair per problem."""

    num_workers: int = Field(default=1, ge=0)
    """Accepted, no effect here: rows are turned into batches in the driver process (a speed knob)."""

    processor: str | None = None
    """NeMo RL's processor name. ``vlm_hf_data_processor`` reads ``openai_format`` rows whose messages hold
    images (``{"type": "image", "image": ...}`` parts) through the model's own Hugging Face processor
    (``nemo_rl.data.vlm``; ``tiny_clevr`` always does). Any other name has no effect: each ``dataset_name`` has
    its processor here (the algorithm picks it)."""

    max_image_pixels: int | None = Field(default=None, ge=1)
    """Largest image (width x height) a multimodal row may hold; a larger one stops the run at setup with the
    row and file named. ``None``: the model processor's own ``max_pixels`` (beyond it the processor would
    shrink the image)."""

    val_split: Literal["valA", "valB"] | None = None
    """``clevr-cogent``'s validation set (NeMo RL's ``data.validation.split``): ``valA`` (the training scenes'
    colour and shape combinations) or ``valB`` (the held-out combinations); ``None``: ``valA``."""

    tiny_clevr_image_size: int = Field(default=84, ge=28)
    """Side in pixels of the square ``tiny_clevr`` pictures."""

    tiny_clevr_max_objects: int = Field(default=5, ge=1, le=9)
    """Most shapes in a ``tiny_clevr`` picture (each has 1 to this many)."""

    use_multiple_dataloader: Literal[False] = False
    """One dataloader per training dataset; not built here: must be false."""

    train: DatasetEntryConfig | list[DatasetEntryConfig] | None = None
    """NeMo RL's layout: the training dataset (one), read into the flat keys above at validation; the
    validated config holds ``None`` here."""

    validation: DatasetEntryConfig | None = None
    """NeMo RL's layout: the validation dataset (``data_path`` into ``val_data_path``)."""

    default: DatasetEntryConfig | None = None
    """NeMo RL's layout: values for keys the ``train`` entry leaves null."""

    CONDITIONAL_NO_EFFECT: ClassVar[dict[str, str]] = {"processor": "processor=vlm_hf_data_processor"}

    @property
    def multimodal(self) -> bool:
        """Whether the rows are multimodal chats (:data:`MULTIMODAL_DATASETS`, or ``processor:
        vlm_hf_data_processor``)."""
        return self.dataset_name in MULTIMODAL_DATASETS or self.processor == "vlm_hf_data_processor"

    def settings_without_effect(self) -> dict[str, str]:
        """``processor`` when it names anything but the multimodal processor (see the field)."""
        if self.processor not in (None, "vlm_hf_data_processor"):
            return {
                "processor": "each dataset_name has its processor here; only vlm_hf_data_processor is read"
            }
        return {}

    @model_validator(mode="before")
    @classmethod
    def _nemo_rl_layout(cls, data: Any) -> Any:
        return _flatten_dataset_layout(data) if isinstance(data, dict) else data

    @property
    def separate_val_dataset(self) -> DatasetName | None:
        """``val_dataset_name`` when it names another dataset than the training data's, else ``None``."""
        return self.val_dataset_name if self.val_dataset_name not in (None, self.dataset_name) else None

    @model_validator(mode="after")
    def _check_validation_dataset(self) -> DataConfig:
        val = self.separate_val_dataset
        if val is None:
            return self
        if record_kind(val) != record_kind(self.dataset_name):
            raise ValueError(
                f"data.val_dataset_name={val} holds {record_kind(val)} but data.dataset_name={self.dataset_name} "
                f"holds {record_kind(self.dataset_name)}: validate on data of the same kind"
            )
        if val in GENERATED_DATASETS:
            raise ValueError(
                f"data.val_dataset_name={val} is generated together with its training problems: set "
                f"data.dataset_name={val} to validate on its held-out problems"
            )
        if val in PATH_ONLY_DATASETS and self.val_data_path is None:
            raise ValueError(
                f"data.val_dataset_name={val} has no default source: set data.val_data_path to a local file or "
                "a hub dataset name"
            )
        return self

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.dataset_name in PATH_ONLY_DATASETS and self.train_data_path is None:
            raise ValueError(
                f"data.dataset_name={self.dataset_name} has no default source: set data.train_data_path to a "
                "local .jsonl/.parquet file or a hub dataset name"
            )
        reads_val_file = self.val_data_path is not None and self.separate_val_dataset is None
        if self.dataset_name in GENERATED_DATASETS and (self.train_data_path or reads_val_file):
            other = "OpenMathInstruct-2" if self.dataset_name == "tiny_math" else "binary_preference"
            raise ValueError(
                f"data.dataset_name={self.dataset_name} is generated on the fly and reads no files: unset "
                f"data.train_data_path/data.val_data_path, or set data.dataset_name={other} to read files in "
                "the same schema"
            )
        if self.dataset_name in ("tiny_math", "tiny_math_preference"):
            num_problems = 2 * (self.tiny_math_max_operand + 1) ** 2
            if self.num_train_samples + self.num_val_samples > num_problems:
                raise ValueError(
                    f"data.num_train_samples + data.num_val_samples = "
                    f"{self.num_train_samples + self.num_val_samples} exceeds the {num_problems} distinct "
                    f"tiny_math problems with data.tiny_math_max_operand={self.tiny_math_max_operand}: "
                    "ask for fewer samples or raise the operand range"
                )
        if self.processor == "vlm_hf_data_processor" and self.dataset_name not in (
            "openai_format",
            *MULTIMODAL_DATASETS,
        ):
            raise ValueError(
                f"data.processor=vlm_hf_data_processor reads multimodal chats: set data.dataset_name=openai_format "
                f"(or one of {', '.join(MULTIMODAL_DATASETS)}), not {self.dataset_name}"
            )
        if self.val_split is not None and self.dataset_name != "clevr-cogent":
            raise ValueError(
                f"data.val_split={self.val_split} names a clevr-cogent validation set, and this is "
                f"{self.dataset_name}: remove it"
            )
        if self.tiny_math_rejected_per_problem > 1 and self.dataset_name != "tiny_math_preference":
            raise ValueError(
                f"data.tiny_math_rejected_per_problem={self.tiny_math_rejected_per_problem} applies to "
                f"data.dataset_name=tiny_math_preference only (this is {self.dataset_name}): remove it"
            )
        return self
