"""Schemas of the evaluation sections: ``eval``, ``generation`` (with the model) and ``data`` (the benchmark).

Key names follow NeMo RL's ``examples/configs/evals/eval.yaml`` (``eval.metric``, ``eval.num_tests_per_prompt``,
``eval.k_value``, ``eval.save_path``, ``generation.model_name``, ``generation.num_prompts_per_step``,
``data.dataset_name``, ``data.problem_key`` / ``data.solution_key``...), so its eval recipes port with few edits.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.policy import VLLM_TEMPERATURE_RANGE, GenerationConfig

EvalMetric = Literal["pass@k", "cons@k"]
"""The headline metric: ``pass@k`` (some of k samples is correct, unbiased estimator) or ``cons@k`` (the
majority answer of k samples is correct)."""

KNOWN_EVAL_DATASETS = ("tiny_math", "tiny_clevr", "aime2024", "aime2025", "math500", "gsm8k")
"""Benchmarks with a built-in schema (matched case-insensitively, so NeMo RL's ``AIME2024`` works too)."""


class EvalConfig(ConfigModel):
    """What is measured: how many samples per problem, which k, where the results go."""

    metric: EvalMetric = "pass@k"
    """Headline metric printed as ``score``: ``pass@k`` or ``cons@k`` at ``k = k_value``. Every run also
    reports pass@1, pass@k and cons@k for k in {1, ``k_value``, ``num_tests_per_prompt``}."""

    num_tests_per_prompt: int = Field(default=1, ge=1)
    """Responses sampled per problem (n of the unbiased pass@k estimator)."""

    k_value: int = Field(default=1, ge=1)
    """k of pass@k and cons@k; at most ``num_tests_per_prompt``."""

    seed: int = 42
    """Seed of the sampling: the same seed, model and data give the same responses."""

    save_path: str | None = None
    """Folder for the results: ``responses.jsonl`` (one line per problem with its responses, extracted
    answers, rewards and per-problem metrics), ``metrics.json`` and the resolved ``config.yaml``. ``None``
    writes nothing."""

    greedy_accuracy: bool = False
    """Also decode every problem once greedily and report ``greedy_accuracy`` (one more generation pass;
    implied when ``generation.temperature`` is 0)."""

    max_rollout_turns: int = Field(default=1, ge=1)
    """Generate / environment-step turns per response (1 for single-turn tasks such as math)."""

    @model_validator(mode="after")
    def _check_k(self) -> Self:
        if self.k_value > self.num_tests_per_prompt:
            raise ValueError(
                f"eval.k_value={self.k_value} exceeds eval.num_tests_per_prompt={self.num_tests_per_prompt}: "
                f"pass@k and cons@k need at least k samples per problem; raise num_tests_per_prompt or lower k_value"
            )
        return self


class EvalGenerationConfig(GenerationConfig):
    """The evaluated model and how it samples: the ``policy.generation`` keys plus the model itself."""

    model_name: str = "Qwen/Qwen2.5-Math-1.5B-Instruct"
    """The evaluated model: a Hugging Face folder or hub name, or a training checkpoint written by
    nemo_rl (``<checkpoint_dir>/step_<N>`` or its ``policy/weights`` folder), read directly."""

    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 decodes greedily (then ``eval.num_tests_per_prompt`` must be 1)."""

    num_prompts_per_step: int = Field(default=-1, ge=-1)
    """Problems per generation call (each repeated ``eval.num_tests_per_prompt`` times); -1 sends them all
    at once."""

    max_total_sequence_length: int = Field(default=2048, ge=2)
    """Longest prompt + response in tokens (vLLM's ``max_model_len`` unless ``vllm_cfg.max_model_len`` is set)."""

    generation_batch_size: int | None = Field(default=None, ge=1)
    """Sequences per generation call on one embedded-engine replica; ``None`` generates its whole share at
    once."""

    trust_remote_code: bool = False
    """Allow the model and tokenizer repositories to run their own code."""

    @model_validator(mode="after")
    def _check_vllm_sampling(self) -> Self:
        # Replaces the training check: 0 means greedy here, which every backend decodes per call.
        low, high = VLLM_TEMPERATURE_RANGE
        if self.backend == "vllm" and self.temperature != 0.0 and not low <= self.temperature <= high:
            raise ValueError(
                f"generation.temperature={self.temperature}: vLLM samples at temperatures in [{low}, {high}] "
                "(or 0 for greedy decoding); pick one of those or use generation.backend=embedded"
            )
        return self

    @model_validator(mode="after")
    def _check_batching(self) -> Self:
        if self.num_prompts_per_step == 0:
            raise ValueError(
                "generation.num_prompts_per_step must be -1 (all problems at once) or at least 1"
            )
        if self.embedded_cfg.in_policy_workers:
            raise ValueError(
                "generation.embedded_cfg.in_policy_workers=true: evaluation trains no policy whose workers "
                "could host the engine; set it false"
            )
        return self


class EvalDataConfig(ConfigModel):
    """The benchmark: a built-in dataset (from the hub or a local copy in its hub schema) or any file of
    problems and answers."""

    dataset_name: str = "aime2024"
    """``tiny_math`` (the held-out arithmetic problems of the tiny recipes), ``tiny_clevr`` (the held-out
    counting pictures of the tiny vision-language recipes; score them with ``env_name: tiny_clevr``), ``aime2024``
    (HuggingFaceH4/aime_2024), ``aime2025`` (opencompass/AIME2025, parts I and II), ``math500``
    (HuggingFaceH4/MATH-500) or ``gsm8k`` (openai/gsm8k, answer after ``####``), case-insensitive; any other
    value is a local file (``.jsonl``, ``.json``, ``.parquet``, ``.csv``) or a hub dataset read with
    ``problem_key`` / ``solution_key``."""

    data_path: str | None = None
    """A local file or hub name holding a built-in dataset in its hub schema (e.g. a copy of GSM8K's test
    split as ``.jsonl``); ``None`` reads the dataset's hub source."""

    split: str | None = None
    """Hub split to read; ``None`` uses the dataset's test split (``train`` for AIME 2024, whose only split it
    is). Ignored for local files."""

    problem_key: str = "problem"
    """Column holding the problem, for datasets that are not built in."""

    solution_key: str = "answer"
    """Column holding the reference answer, for datasets that are not built in."""

    max_num_problems: int | None = Field(default=None, ge=1)
    """Evaluate only the first this many problems; ``None`` evaluates them all."""

    prompt_file: str | None = None
    """Text file with a prompt template for the problem: ``{}`` marks where the problem goes (write literal
    braces as ``{{`` and ``}}``); ``None`` uses the problem as is. Use the template the model was trained with."""

    system_prompt_file: str | None = None
    """Text file whose content becomes a system message before each problem."""

    add_bos: bool = True
    """Start every prompt with the tokenizer's BOS token when its chat template does not."""

    max_input_seq_length: int | None = Field(default=None, ge=1)
    """Longest prompt in tokens; longer prompts are cut (and counted). ``None`` uses
    ``generation.max_total_sequence_length``."""

    env_name: str = "math"
    """Environment that scores the responses (a name in the environment registry; its settings come from
    ``env.<env_name>``)."""

    seed: int = 42
    """Seed of the ``tiny_math`` problem order; the held-out problems are the first ``num_val_samples`` of it,
    the same ones the tiny SFT and GRPO recipes validate on with the same seed."""

    num_val_samples: int = Field(default=256, ge=1)
    """How many held-out ``tiny_math`` problems to evaluate."""

    tiny_math_max_operand: int = Field(default=50, ge=1)
    """Largest operand of a ``tiny_math`` problem (as in the recipe that trained the model)."""

    tiny_clevr_image_size: int = Field(default=84, ge=28)
    """Side in pixels of the ``tiny_clevr`` pictures (as in the recipe that trained the model)."""

    tiny_clevr_max_objects: int = Field(default=5, ge=1, le=9)
    """Most shapes in a ``tiny_clevr`` picture (as in the recipe that trained the model)."""

    blank_images: bool = False
    """Replace every image of a multimodal benchmark by a blank one of the same size (the same image
    tokens): the same checkpoint's score without the pictures, which shows how much it reads them."""

    @property
    def builtin_name(self) -> str | None:
        """The built-in dataset ``dataset_name`` names (lower case), or ``None`` for a file or hub name."""
        name = self.dataset_name.lower()
        return name if name in KNOWN_EVAL_DATASETS else None

    @property
    def multimodal(self) -> bool:
        """Whether the benchmark's prompts hold images (``tiny_clevr``)."""
        return self.builtin_name == "tiny_clevr"

    @model_validator(mode="after")
    def _check_source(self) -> Self:
        if self.data_path is not None and self.builtin_name is None:
            raise ValueError(
                f"data.data_path is for built-in datasets {list(KNOWN_EVAL_DATASETS)}; with "
                f"data.dataset_name={self.dataset_name!r} put the file or hub name in data.dataset_name itself"
            )
        if self.builtin_name in ("tiny_math", "tiny_clevr") and self.data_path is not None:
            raise ValueError(
                f"data.dataset_name={self.builtin_name} is generated and reads no file: unset data.data_path"
            )
        if self.blank_images and not self.multimodal:
            raise ValueError(
                f"data.blank_images=true blanks the images of a multimodal benchmark, and {self.dataset_name} has "
                "none: set data.dataset_name=tiny_clevr or remove it"
            )
        return self
