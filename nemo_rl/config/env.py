"""Schema of the ``env`` section: one subsection per environment (``env.math``, ``env.number_guessing``)."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel


class MathEnvConfig(ConfigModel):
    """The math environment: the last ``\\boxed{}`` answer checked against the ground truth by math-verify."""

    num_workers: int = Field(default=8, ge=1)
    """Verifier processes checking answers in parallel."""

    verify_timeout_s: float = Field(default=10.0, gt=0.0)
    """Longest time one answer may take to verify; a slower answer counts as wrong and its verifier process
    is killed and replaced."""

    stop_strings: list[str] | None = None
    """Stop strings for the response (``None``: stop at end of sequence only)."""

    math_verify_impl: Literal["hf_math_verify"] = "hf_math_verify"
    """Verifier implementation (NeMo RL key); Hugging Face math-verify is the one provided."""


class NumberGuessingEnvConfig(ConfigModel):
    """A multi-turn game: the assistant guesses a hidden integer and is told "higher", "lower" or "correct"."""

    max_guesses: int = Field(default=5, ge=1)
    """Guesses allowed per game (unparsable replies count); the game ends after the last one."""

    low: int = 1
    """Smallest number the hidden number can be."""

    high: int = 20
    """Largest number the hidden number can be."""

    stop_strings: list[str] | None = None
    """Stop strings for each guess (``None``: stop at end of sequence only)."""

    @model_validator(mode="after")
    def _check_range(self) -> Self:
        if self.low > self.high:
            raise ValueError(f"env.number_guessing.low ({self.low}) must not exceed high ({self.high})")
        return self


class EnvConfig(ConfigModel):
    """Environments that score rollouts; each subsection configures the environment of that name."""

    math: MathEnvConfig = Field(default_factory=MathEnvConfig)
    """The math (verifiable answer) environment."""

    number_guessing: NumberGuessingEnvConfig = Field(default_factory=NumberGuessingEnvConfig)
    """The number-guessing game (multi-turn)."""
