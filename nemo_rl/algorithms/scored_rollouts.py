"""The sampling half of a policy-gradient step, shared by GRPO and PPO: draw prompts, refit stale generation
weights, roll out, score, transform the rewards (``reward_scaling`` then ``reward_shaping``) and, under DAPO's
dynamic sampling, draw further prompt batches until enough groups carry a learning signal.

What differs between the two algorithms is what they do with the scored rollout (group baselines, or a critic
and GAE); that stays in their own modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from nemo_rl.algorithms.dynamic_sampling import sample_until_full
from nemo_rl.algorithms.rewards import first_response_lengths, scale_rewards, shape_rewards
from nemo_rl.algorithms.run import EnvMetrics, RLState, Run
from nemo_rl.config.algorithms import PolicyGradientLoopConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.utils.timer import Timer


@dataclasses.dataclass
class PromptsState(RLState):
    """An RL loop's progress plus the prompts its steps consumed."""

    consumed_prompts: int = 0
    """Prompts drawn by the steps taken: trained on, dropped by dynamic sampling or, under asynchronous GRPO,
    dropped as too old (its loader reads ahead of training, and only what the steps took counts)."""


S = TypeVar("S", bound=PromptsState)

PGRun = Run[Any, S]
"""A run whose loop samples prompts and records how many it consumed (GRPO, PPO)."""


def transformed_rewards(rollout: BatchedDataDict[Any], cfg: PolicyGradientLoopConfig) -> torch.Tensor:
    """The rollout's rewards after ``reward_scaling`` then ``reward_shaping`` (the environments' own metrics
    keep the raw rewards)."""
    rewards_B = scale_rewards(rollout["total_reward"], cfg.reward_scaling)
    if not cfg.reward_shaping.enabled:
        return rewards_B
    lengths_B = first_response_lengths(rollout["message_log"])
    return shape_rewards(rewards_B, lengths_B, rollout["truncated"], cfg.reward_shaping)


def with_transformed_rewards(
    rollout: BatchedDataDict[Any], metrics: dict[str, float], cfg: PolicyGradientLoopConfig
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    """``rollout`` with its ``total_reward`` transformed (:func:`transformed_rewards`), and ``metrics`` with
    ``reward``, their mean."""
    rollout["total_reward"] = transformed_rewards(rollout, cfg)
    return rollout, {**metrics, "reward": float(rollout["total_reward"].mean())}


def score(
    run: PGRun[S], batch: BatchedDataDict[Any], cfg: PolicyGradientLoopConfig, timer: Timer
) -> tuple[BatchedDataDict[Any], dict[str, float], EnvMetrics]:
    """Sample ``num_generations_per_prompt`` responses per prompt of ``batch`` and score them (see
    :meth:`Run.sample`), with the transformed rewards; the function returned last waits for the
    environments' own metrics."""
    rollout, metrics, env_metrics = run.sample(batch, cfg, timer)
    return (*with_transformed_rewards(rollout, metrics, cfg), env_metrics)


def draw(run: PGRun[S], batches: Iterator[BatchedDataDict[Any]]) -> BatchedDataDict[Any]:
    """A further prompt batch drawn within a step (dynamic sampling), counted as consumed."""
    batch = next(batches)
    run.state.consumed_prompts += len(batch["message_log"])
    return batch


def sample_step(
    run: PGRun[S],
    batch: BatchedDataDict[Any],
    cfg: PolicyGradientLoopConfig,
    timer: Timer,
    next_batch: Callable[[], BatchedDataDict[Any]] | None = None,
) -> tuple[BatchedDataDict[Any], dict[str, float], EnvMetrics]:
    """The sampling half of one step on ``batch``: count its prompts, refit stale generation weights, roll
    out and score (drawing ``next_batch`` under dynamic sampling), then release the generation workers."""
    run.state.consumed_prompts += len(batch["message_log"])
    run.refit_if_stale(timer)
    env_metrics: EnvMetrics = dict
    if cfg.use_dynamic_sampling:
        if next_batch is None:
            raise ValueError("use_dynamic_sampling needs a next_batch to draw further prompt batches from")

        def score_and_wait(b: BatchedDataDict[Any]) -> tuple[BatchedDataDict[Any], dict[str, float]]:
            rollout, metrics, wait = score(run, b, cfg, timer)
            return rollout, {**metrics, **wait()}

        with timer.time("dynamic_sampling"):
            rollout, rollout_metrics = sample_until_full(
                batch,
                next_batch,
                score_and_wait,
                num_samples=cfg.samples_per_step,
                group_size=cfg.num_generations_per_prompt,
                max_gen_batches=cfg.dynamic_sampling_max_gen_batches,
            )
    else:
        rollout, rollout_metrics, env_metrics = score(run, batch, cfg, timer)
    run.rl.generation.finish_generation()
    return rollout, rollout_metrics, env_metrics
