"""Schema of the ``data`` section: which dataset to load, how to split it and how to format its prompts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

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
"""

PREFERENCE_DATASETS: tuple[str, ...] = (
    "binary_preference",
    "HelpSteer3",
    "Tulu3Preference",
    "tiny_math_preference",
)
"""The ``dataset_name`` values holding preference pairs (DPO and reward-model training)."""

GENERATED_DATASETS: tuple[str, ...] = ("tiny_math", "tiny_math_preference")
"""The ``dataset_name`` values generated on the fly (they read no files)."""


class DataConfig(ConfigModel):
    """Where the training and validation data come from and how each row becomes a prompt."""

    dataset_name: DatasetName = "tiny_math"
    """Schema of the data: ``tiny_math``, ``OpenMathInstruct-2``, ``squad``, ``openai_format``, ``response``,
    or the preference sets ``binary_preference``, ``HelpSteer3``, ``Tulu3Preference`` and
    ``tiny_math_preference``. With no ``train_data_path``, ``OpenMathInstruct-2``, ``squad``, ``HelpSteer3`` and
    ``Tulu3Preference`` load from the hub; ``tiny_math`` and ``tiny_math_preference`` are generated."""

    train_data_path: str | None = None
    """Local training file (``.jsonl``, ``.json`` with one object per line, or ``.parquet``) in the schema of
    ``dataset_name``, or a hub dataset name. ``None`` loads the dataset's hub default (not for
    ``openai_format`` / ``response`` / ``binary_preference``, which need a path)."""

    val_data_path: str | None = None
    """Local validation file or hub dataset name in the same schema; ``None`` uses the dataset's validation
    split, or else carves one out of the training data with ``val_fraction``."""

    split: str | None = None
    """Hub split used as training data; ``None`` uses the dataset's usual one (``train_1M`` for
    OpenMathInstruct-2, ``train`` otherwise). Ignored for local files."""

    subset: str | None = None
    """Hub subset (configuration) of ``train_data_path`` / ``val_data_path``; ``None`` uses the dataset's usual
    one (``preference`` for HelpSteer3, none otherwise). Ignored for local files."""

    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Share of the training rows held out (seeded) for validation when the source has no validation split;
    0 means no validation set."""

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
    """Training problems generated for ``dataset_name: tiny_math`` / ``tiny_math_preference``."""

    num_val_samples: int = Field(default=64, ge=0)
    """Validation problems generated for ``dataset_name: tiny_math`` / ``tiny_math_preference`` (disjoint from
    the training problems; the same problems for a given ``seed`` whatever ``num_train_samples`` is)."""

    tiny_math_max_operand: int = Field(default=50, ge=1)
    """Largest operand of a ``tiny_math`` problem (operands are drawn from 0 to this value)."""

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if (
            self.dataset_name in ("openai_format", "response", "binary_preference")
            and self.train_data_path is None
        ):
            raise ValueError(
                f"data.dataset_name={self.dataset_name} has no default source: set data.train_data_path to a "
                "local .jsonl/.parquet file or a hub dataset name"
            )
        if self.dataset_name in GENERATED_DATASETS and (self.train_data_path or self.val_data_path):
            other = "OpenMathInstruct-2" if self.dataset_name == "tiny_math" else "binary_preference"
            raise ValueError(
                f"data.dataset_name={self.dataset_name} is generated on the fly and reads no files: unset "
                f"data.train_data_path/data.val_data_path, or set data.dataset_name={other} to read files in "
                "the same schema"
            )
        if self.dataset_name in GENERATED_DATASETS:
            num_problems = 2 * (self.tiny_math_max_operand + 1) ** 2
            if self.num_train_samples + self.num_val_samples > num_problems:
                raise ValueError(
                    f"data.num_train_samples + data.num_val_samples = "
                    f"{self.num_train_samples + self.num_val_samples} exceeds the {num_problems} distinct "
                    f"tiny_math problems with data.tiny_math_max_operand={self.tiny_math_max_operand}: "
                    "ask for fewer samples or raise the operand range"
                )
        return self
