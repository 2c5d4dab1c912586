"""Schemas of the algorithm sections: ``sft``, ``grpo``, ``dpo`` and ``rm``."""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.loss import DPOLossConfig


class SFTConfig(ConfigModel):
    """The supervised fine-tuning loop."""

    max_num_epochs: int = Field(default=1, ge=1)
    """Passes over the training set; training stops at whichever of this and ``max_num_steps`` comes first."""

    max_num_steps: int = Field(default=60, ge=1)
    """Optimizer steps to run in total (a resumed run counts the steps already taken)."""

    val_period: int = Field(default=10, ge=0)
    """Validate every this many steps; 0 disables periodic validation."""

    val_batches: int = Field(default=8, ge=0)
    """Validation batches per validation run; 0 uses the whole validation set."""

    val_global_batch_size: int = Field(default=32, ge=1)
    """Sequences per validation batch, summed over data-parallel ranks."""

    val_micro_batch_size: int = Field(default=1, ge=1)
    """Sequences per validation forward pass on one rank."""

    val_at_start: bool = True
    """Validate once before the first training step."""

    seed: int = 42
    """Seed of data shuffling and model initialisation."""

    export_dir: str | None = None
    """Where the final weights are exported as a Hugging Face folder (safetensors, config, tokenizer);
    ``None`` uses ``<checkpointing.checkpoint_dir>/hf_final``."""


class GRPOConfig(ConfigModel):
    """The GRPO loop: sampling, scoring, advantage estimation and policy updates."""

    num_prompts_per_step: int = Field(default=32, ge=1)
    """Distinct prompts sampled per step."""

    num_generations_per_prompt: int = Field(default=16, ge=1)
    """Responses sampled per prompt; advantages compare responses within a prompt's group."""

    max_rollout_turns: int = Field(default=1, ge=1)
    """Generate / environment-step turns per rollout (1 = single turn)."""

    max_num_epochs: int = Field(default=1, ge=1)
    """Passes over the prompt set; training stops at whichever of this and ``max_num_steps`` comes first."""

    max_num_steps: int = Field(default=1_000_000, ge=1)
    """Steps to run in total (a resumed run counts the steps already taken)."""

    normalize_rewards: bool = True
    """Divide advantages by the reward standard deviation of the prompt's group."""

    use_leave_one_out_baseline: bool = True
    """Baseline each response with the mean reward of the *other* responses to its prompt."""

    val_period: int = Field(default=10, ge=0)
    """Validate every this many steps; 0 disables periodic validation."""

    val_at_start: bool = False
    """Validate once before the first step."""

    max_val_samples: int = Field(default=256, ge=1)
    """Validation prompts per validation run."""

    val_batch_size: int = Field(default=256, ge=1)
    """Validation prompts per generation call."""

    val_greedy: bool = False
    """Decode validation responses greedily instead of sampling with ``policy.generation`` settings."""

    seed: int = 42
    """Seed of prompt shuffling, sampling and initialisation."""

    overlong_filtering: bool = False
    """Exclude truncated responses (no end of sequence within the budget) from the loss."""


class DPOConfig(DPOLossConfig):
    """The DPO loop and its loss terms (NeMo RL's ``dpo`` section).

    ``policy.train_global_batch_size`` and ``policy.train_micro_batch_size`` count preference pairs; the
    workers see twice as many sequences, a pair's chosen and rejected responses always in one micro-batch.
    """

    max_num_epochs: int = Field(default=1, ge=1)
    """Passes over the preference pairs; training stops at whichever of this and ``max_num_steps`` comes
    first."""

    max_num_steps: int = Field(default=150, ge=1)
    """Optimizer steps to run in total (a resumed run counts the steps already taken)."""

    val_period: int = Field(default=25, ge=0)
    """Validate every this many steps; 0 disables periodic validation."""

    val_batches: int = Field(default=8, ge=-1)
    """Validation batches per validation run; 0 or -1 use the whole validation set."""

    val_global_batch_size: int = Field(default=8, ge=1)
    """Preference pairs per validation batch, summed over data-parallel ranks."""

    val_micro_batch_size: int = Field(default=1, ge=1)
    """Preference pairs per validation forward pass on one rank."""

    val_at_start: bool = True
    """Validate once before the first training step."""

    val_at_end: bool = False
    """Also validate after the last step when ``val_period`` does not fall on it, so the final checkpoint
    carries validation metrics."""

    seed: int = 42
    """Seed of the shuffling of the preference pairs."""

    export_dir: str | None = None
    """Where the final weights are exported as a Hugging Face folder; ``None`` uses
    ``<checkpointing.checkpoint_dir>/hf_final``."""


class RMConfig(ConfigModel):
    """The Bradley-Terry reward-model loop (NeMo RL's ``rm`` section).

    ``policy.train_global_batch_size`` and ``policy.train_micro_batch_size`` count preference pairs, as in DPO.
    """

    max_num_epochs: int = Field(default=1, ge=1)
    """Passes over the preference pairs; training stops at whichever of this and ``max_num_steps`` comes
    first."""

    max_num_steps: int = Field(default=-1, ge=-1)
    """Optimizer steps to run in total; -1 trains for ``max_num_epochs`` epochs."""

    val_period: int = Field(default=16, ge=0)
    """Validate every this many steps; 0 disables periodic validation."""

    val_batches: int = Field(default=-1, ge=-1)
    """Validation batches per validation run; -1 or 0 use the whole validation set."""

    val_global_batch_size: int = Field(default=32, ge=1)
    """Preference pairs per validation batch, summed over data-parallel ranks."""

    val_micro_batch_size: int = Field(default=1, ge=1)
    """Preference pairs per validation forward pass on one rank."""

    val_at_start: bool = False
    """Validate once before the first training step."""

    val_at_end: bool = False
    """Also validate after the last step when ``val_period`` does not fall on it."""

    seed: int = 42
    """Seed of the shuffling of the preference pairs."""

    export_dir: str | None = None
    """Where the final reward model is exported as a Hugging Face folder (it loads with
    ``AutoModelForSequenceClassification``); ``None`` uses ``<checkpointing.checkpoint_dir>/hf_final``."""

    @model_validator(mode="after")
    def _check_steps(self) -> Self:
        if self.max_num_steps == 0:
            raise ValueError("rm.max_num_steps must be >= 1, or -1 to train for rm.max_num_epochs epochs")
        return self
