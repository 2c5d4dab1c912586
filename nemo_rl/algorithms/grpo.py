"""GRPO: group relative policy optimisation with verifiable rewards.

Each step (see docs/design.md, "One GRPO step", for its path through the modules):

1. take ``grpo.num_prompts_per_step`` prompts and repeat each ``num_generations_per_prompt`` times;
2. refit the generation workers if the policy changed since they were last updated;
3. roll out: sample responses, let the environments score them (several turns if configured);
4. advantages: each response's reward minus its prompt group's baseline (optionally over the group std);
5. the policy scores the responses under the current (previous-step) weights, unless the training forward
   gives the same numbers (one optimizer step per batch), and under the reference weights (KL term on);
6. one or more optimizer steps with the clipped policy-gradient loss; generation weights become stale;
7. log, validate and checkpoint when due.

``setup`` builds every piece from a :class:`GRPOMasterConfig` (resuming from the latest checkpoint when
there is one) and ``grpo_train`` runs the loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.advantages import compute_advantages
from nemo_rl.algorithms.dynamic_sampling import EndlessBatches
from nemo_rl.algorithms.loop import train_metrics
from nemo_rl.algorithms.loss_functions import ClippedPGLossFn
from nemo_rl.algorithms.run import EnvMetrics, Run
from nemo_rl.algorithms.run_build import RunSpec, SamplingSpec, build_run
from nemo_rl.algorithms.scored_rollouts import (
    PromptsState,
    draw,
    sample_step,
    with_transformed_rewards,
)
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.data.prompt_messages import KeepPromptMessages
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.async_rollouts import AheadBatchesOnResume, AsyncRollouts, RolloutBatch
from nemo_rl.experience.train_batch import build_train_batch
from nemo_rl.models.generation.replicated import WORKER_CALL_TIMEOUT_S
from nemo_rl.models.policy.hf_io import trains_with_dropout
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.utils.timer import Timer

MasterConfig = GRPOMasterConfig
"""The config of a GRPO run, under NeMo RL's name (``from nemo_rl.algorithms.grpo import MasterConfig``)."""


@dataclasses.dataclass
class GRPOState(PromptsState):
    """What a checkpoint records about the GRPO loop's progress (steps, tokens trained on, validation
    accuracy, prompts consumed)."""


GRPORun = Run[GRPOMasterConfig, GRPOState]
"""A started GRPO run: what ``setup`` returns and ``grpo_train`` runs."""

ASYNC_STATE = "async_rollouts"
"""The name asynchronous GRPO's batches sampled ahead are checkpointed under (``run_state.pt``)."""


def _check_batch_sizes(config: GRPOMasterConfig) -> None:
    samples = config.grpo.samples_per_step
    if samples % config.policy.train_global_batch_size != 0:
        raise UserError(
            f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {samples} responses per step must "
            f"be a multiple of policy.train_global_batch_size={config.policy.train_global_batch_size}"
        )


def setup(
    config: GRPOMasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
    task_to_env: Mapping[str, Any] | None = None,
    val_task_to_env: Mapping[str, Any] | None = None,
) -> GRPORun:
    """Start Ray, the policy, generation and environment workers; restore the latest checkpoint if any.

    Environments: ``task_to_env`` maps each ``task_name`` of the data to an environment actor (see
    ``nemo_rl.environments.registry.create_env``); ``val_task_to_env`` does the same for validation and
    defaults to ``task_to_env``. For data whose environments are not passed in, one environment is started
    per task (``task_name``), the one registered under the task's name, configured by ``env.<task>``; those
    are the ones the run's ``shutdown`` stops.

    With ``grpo.agent`` the training samples also keep their prompts as OpenAI messages, which the external
    agents are given (:class:`~nemo_rl.data.prompt_messages.KeepPromptMessages`), and the agent endpoint starts.
    """
    # Input checks that need no workers, before Ray starts.
    _check_batch_sizes(config)
    grpo = config.grpo
    if grpo.agent.enabled and isinstance(train_dataset, ProcessedDataset):
        train_dataset = dataclasses.replace(
            train_dataset, processor=KeepPromptMessages(train_dataset.processor)
        )
    spec = RunSpec.sampling_loop(
        "GRPO",
        GRPOState,
        SamplingSpec(
            env=config.env,
            task_to_env=task_to_env,
            val_task_to_env=val_task_to_env,
            concurrent_refit=grpo.async_grpo.enabled and grpo.async_grpo.in_flight_weight_updates,
            agent=grpo.agent if grpo.agent.enabled else None,
        ),
        section="grpo",
        seed=grpo.seed,
        num_prompts=grpo.prompts_per_generation_batch,
        keep_reference_model=config.loss_fn.reference_policy_kl_penalty > 0,
    )
    return build_run(config, tokenizer, train_dataset, val_dataset, spec)


def loss_function(run: GRPORun) -> ClippedPGLossFn:
    """The clipped policy-gradient loss of ``loss_fn``, taking the previous policy's log-probs from the
    training forward when that is exact (see :func:`prev_logprobs_from_training_forward`)."""
    config = run.config
    return ClippedPGLossFn(
        config.loss_fn, prev_logprobs_from_forward=prev_logprobs_from_training_forward(config, run.policy)
    )


def prev_logprobs_from_training_forward(config: GRPOMasterConfig, policy: Policy | None = None) -> bool:
    """Whether the training forward itself gives the previous policy's log-probs, so no separate scoring pass
    is needed: one optimizer step per batch (all of its forward passes run on the weights the batch would be
    scored with) and a training forward equal to the scoring one (no dropout)."""
    samples = config.grpo.samples_per_step
    if samples != config.policy.train_global_batch_size:
        return False
    # The started policy answers from its workers; without one the driver loads the model's config itself.
    return not (policy.trains_with_dropout() if policy is not None else trains_with_dropout(config.policy))


def grpo_step(
    run: GRPORun,
    batch: BatchedDataDict[Any],
    timer: Timer,
    loss_fn: ClippedPGLossFn,
    next_batch: Callable[[], BatchedDataDict[Any]] | None = None,
) -> dict[str, float]:
    """One GRPO step on a batch of prompts; returns its ``train/`` metrics. Under dynamic sampling,
    ``next_batch`` gives the further prompt batches the step draws."""
    rollout, rollout_metrics, env_metrics = sample_step(run, batch, run.config.grpo, timer, next_batch)
    metrics = train_on_rollout(run, loss_fn, rollout, rollout_metrics, timer, env_metrics)
    if "gen_kl_error" in metrics:  # sampled and scored with the same weights: the refit guard's probe
        run.rl.weights.probe(metrics["gen_kl_error"])
    return metrics


def train_on_rollout(
    run: GRPORun,
    loss_fn: ClippedPGLossFn,
    rollout: BatchedDataDict[Any],
    rollout_metrics: Mapping[str, float],
    timer: Timer,
    env_metrics: EnvMetrics = dict,
) -> dict[str, float]:
    """The training half of a step: advantages, the log-probs the loss needs, the optimizer step(s); returns
    the step's ``train/`` metrics (``env_metrics`` is waited for after training)."""
    cfg = run.config
    policy = run.policy
    advantages_B = compute_advantages(
        rollout["total_reward"],
        group_size=cfg.grpo.num_generations_per_prompt,
        use_leave_one_out_baseline=cfg.grpo.use_leave_one_out_baseline,
        normalize_rewards=cfg.grpo.normalize_rewards,
    )
    pad_token_id = int(run.tokenizer.pad_token_id)
    train_data = build_train_batch(rollout, advantages_B, pad_token_id, cfg.grpo.overlong_filtering)

    # The loss reads reference log-probs only with the KL term on, and the previous policy's from the training
    # forward when that is exact (see prev_logprobs_from_training_forward): then no scoring pass is needed.
    use_kl = cfg.loss_fn.reference_policy_kl_penalty > 0
    if use_kl or not loss_fn.prev_logprobs_from_forward:
        with timer.time("logprobs"):
            policy.prepare_for_lp_inference()
            if not loss_fn.prev_logprobs_from_forward:
                train_data["prev_logprobs"] = policy.get_logprobs(train_data)["logprobs"]
            if use_kl:
                reference = policy.get_reference_policy_logprobs(train_data)["reference_logprobs"]
                train_data["reference_policy_logprobs"] = reference
    with timer.time("policy_training"):
        policy.prepare_for_training()
        train_result = policy.train(train_data, loss_fn)
    run.mark_trained()
    run.state.total_valid_tokens += float(train_result["global_valid_toks"].sum())
    return train_metrics(
        train_result,
        {
            "advantages/mean": float(advantages_B.mean()),
            "advantages/min": float(advantages_B.min()),
            "advantages/max": float(advantages_B.max()),
            **rollout_metrics,
            **env_metrics(),  # computed by the environments while the policy trained
        },
    )


def build_async_rollouts(run: GRPORun, total_steps: int) -> AsyncRollouts:
    """Refit the generation workers with the current policy and build generation running ahead of training
    (``grpo.async_grpo``) for the steps left to ``total_steps``, with the batches a resumed checkpoint had
    sampled ahead put back; :meth:`AsyncRollouts.start` starts it."""
    cfg = run.config.grpo.async_grpo
    run.refit_if_stale(Timer())
    weights = run.rl.weights
    weights.publish(run.state.step)
    if cfg.in_flight_weight_updates:
        weights.enable_in_flight_updates(cfg.recompute_kv_cache_after_weight_updates)
    rollouts = AsyncRollouts(
        run.rl.generation,
        weights,
        # The rollout thread's own timer: the step's timings are the trainer's.
        run.sampler(run.config.grpo, Timer()),
        batches=EndlessBatches(run.train_loader),
        loader_state=run.train_loader.state_dict,
        num_batches=max(total_steps - run.state.step, 0),
        max_age=cfg.max_trajectory_age_steps,
        max_failures=cfg.max_generation_failures,
        take_timeout_s=WORKER_CALL_TIMEOUT_S,
        seed=run.config.grpo.seed,
        deterministic=not cfg.in_flight_weight_updates,
    )
    run.checkpointer.track(ASYNC_STATE, rollouts, optional=True)
    return rollouts


def save_async_checkpoint(run: GRPORun, rollouts: AsyncRollouts) -> Path:
    """Save a checkpoint of asynchronous GRPO: the run's, with the batches sampled ahead (tracked) and the
    loader position after them, both as they stand at one moment."""
    with rollouts.snapshot() as position:
        return run.save_checkpoint(position)


def async_grpo_step(
    run: GRPORun, rollouts: AsyncRollouts, timer: Timer, loss_fn: ClippedPGLossFn
) -> dict[str, float]:
    """One step of asynchronous GRPO: train on the next batch that generation finished (no older than
    ``max_trajectory_age_steps``), then refit the generation workers with the new version; returns the step's
    ``train/`` metrics, ``async/*`` among them. Each step's prompts, versions and drops are appended to
    ``<logger.log_dir>/async_trajectories.jsonl``."""
    step = run.state.step + 1
    with timer.time("wait_for_rollouts"):
        batch, async_metrics, dropped = rollouts.take(step)
    run.state.consumed_prompts += batch.num_prompts + sum(d.num_prompts for d in dropped)
    _record_trajectories(run, step, batch, dropped)
    rollout, rollout_metrics = with_transformed_rewards(batch.rollout, batch.metrics, run.config.grpo)
    metrics = train_on_rollout(run, loss_fn, rollout, rollout_metrics, timer)
    with timer.time("wait_before_refit"):
        rollouts.wait_before_refit(step)
    with timer.time("refit"):
        refit_metrics = run.refit(version=step)
    run.logger.log_metrics(refit_metrics, step + 1)
    return {**metrics, **async_metrics, "async/consumed_prompts": float(run.state.consumed_prompts)}


def _record_trajectories(run: GRPORun, step: int, batch: RolloutBatch, dropped: list[RolloutBatch]) -> None:
    group_size = run.config.grpo.num_generations_per_prompt
    record = {
        "step": step,
        "version": batch.version,
        "age": step - 1 - batch.version,
        "prompt_idx": batch.rollout["idx"][::group_size].tolist(),
        "dropped": [
            {"version": d.version, "prompt_idx": d.rollout["idx"][::group_size].tolist()} for d in dropped
        ],
    }
    path = Path(run.logger.log_dir) / "async_trajectories.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def grpo_train(run: GRPORun) -> dict[str, float]:
    """Run GRPO to ``grpo.max_num_steps`` (or ``max_num_epochs``); returns the last step's metrics. With
    ``grpo.async_grpo.enabled`` each step's batch comes from generation running ahead (see
    :mod:`nemo_rl.experience.async_rollouts`) instead of being sampled in the step."""
    cfg = run.config.grpo
    loss_fn = loss_function(run)
    metrics: dict[str, float] = {}
    total_steps = run.step_budget(cfg)
    rollouts = build_async_rollouts(run, total_steps) if cfg.async_grpo.enabled else None
    if rollouts is None:
        run.checkpointer.track(ASYNC_STATE, AheadBatchesOnResume(run.train_loader), optional=True)
    # One stream of prompt batches: the loop takes one per step, dynamic sampling may draw more. Under async
    # GRPO the generation thread draws them, and the loop's "batches" only count steps.
    batches = EndlessBatches(run.train_loader)
    loop = run.train_loop(
        "grpo",
        cfg,
        validate=lambda step: run.validate_by_sampling(step, cfg, greedy=cfg.val_greedy),
        save_checkpoint=None if rollouts is None else partial(save_async_checkpoint, run, rollouts),
        loader=batches if rollouts is None else cast(Iterable[BatchedDataDict[Any]], itertools.count()),
        total_steps=total_steps,
    )
    try:
        if rollouts is not None:
            # Once the loop has restored the driver's RNG: nothing the thread does then races with it.
            rollouts.start()
        for batch in loop:
            if rollouts is None:
                metrics = grpo_step(run, batch, loop.timer, loss_fn, next_batch=partial(draw, run, batches))
            else:
                metrics = async_grpo_step(run, rollouts, loop.timer, loss_fn)
            loop.end_step(metrics, num_tokens=metrics["mean_conversation_tokens"] * cfg.samples_per_step)
    finally:
        if rollouts is not None:
            rollouts.close()
    return metrics
