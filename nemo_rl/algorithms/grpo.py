"""GRPO: group relative policy optimisation with verifiable rewards.

Each step (see DESIGN.md, "One GRPO step"):

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

import contextlib
import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.advantages import compute_advantages
from nemo_rl.algorithms.dynamic_sampling import EndlessBatches, sample_until_full
from nemo_rl.algorithms.loop import step_budget, train_metrics
from nemo_rl.algorithms.loss_functions import ClippedPGLossFn
from nemo_rl.algorithms.rewards import first_response_lengths, scale_rewards, shape_rewards
from nemo_rl.algorithms.rl_startup import RLLoop, RLRun, RLState, start_rl_run
from nemo_rl.algorithms.run_setup import make_train_loop
from nemo_rl.config.algorithms import GRPOConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.data.llm_message_utils import flat_token_positions, message_logs_to_batch
from nemo_rl.data.prompt_messages import KeepPromptMessages
from nemo_rl.data.routed_experts import ROUTED_EXPERTS_KEY, routed_experts_batch
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.agent_endpoint import AgentEndpoint
from nemo_rl.experience.agent_rollouts import run_agent_rollout, start_agent_endpoint
from nemo_rl.experience.async_rollouts import AsyncRollouts, InFlightUpdatable, RolloutBatch
from nemo_rl.experience.validation import request_environment_metrics
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.generation.replicated import WORKER_CALL_TIMEOUT_S
from nemo_rl.models.policy.hf_io import trains_with_dropout
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.utils.timer import Timer

MasterConfig = GRPOMasterConfig
"""The config of a GRPO run, under NeMo RL's name (``from nemo_rl.algorithms.grpo import MasterConfig``)."""

_TRAIN_ROLES = ("assistant",)


@dataclasses.dataclass
class GRPOState(RLState):
    """What a checkpoint records about the GRPO loop's progress (steps, tokens trained on, validation
    accuracy, prompts consumed)."""

    consumed_prompts: int = 0
    """Prompts drawn by the steps taken: trained on, dropped by dynamic sampling or, under asynchronous GRPO,
    dropped as too old (its loader reads ahead of training, and only what the steps took counts)."""


@dataclasses.dataclass(kw_only=True)
class GRPOSetup(RLRun):
    """Everything ``grpo_train`` needs, built by ``setup``: the run (see :class:`RLRun`) and its loss."""

    config: GRPOMasterConfig
    loss_fn: ClippedPGLossFn
    state: GRPOState
    agent_endpoint: AgentEndpoint | None = None
    """The endpoint external agents roll out through (``grpo.agent.enabled``), serving ``generation``."""

    def shutdown(self) -> None:
        """Stop the agent endpoint, then everything :meth:`RLRun.shutdown` stops."""
        if self.agent_endpoint is not None:
            self.agent_endpoint.stop()
        super().shutdown()


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
) -> GRPOSetup:
    """Start Ray, the policy, generation and environment workers; restore the latest checkpoint if any.

    Environments: ``task_to_env`` maps each ``task_name`` of the data to an environment actor (see
    ``nemo_rl.environments.registry.create_env``); ``val_task_to_env`` does the same for validation and
    defaults to ``task_to_env``. For data whose environments are not passed in, one environment is started
    per task (``task_name``), the one registered under the task's name, configured by ``env.<task>``; those
    are the ones :meth:`GRPOSetup.shutdown` stops.

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
    loop = RLLoop(GRPOState, "GRPO", seed=grpo.seed, prompts_per_batch=grpo.prompts_per_generation_batch)
    run = start_rl_run(
        config,
        tokenizer,
        train_dataset,
        val_dataset,
        loop,
        task_to_env=task_to_env,
        val_task_to_env=val_task_to_env,
        init_reference_model=config.loss_fn.reference_policy_kl_penalty > 0,
    )
    loss_fn = ClippedPGLossFn(
        config.loss_fn, prev_logprobs_from_forward=prev_logprobs_from_training_forward(config, run.policy)
    )
    endpoint = None
    if grpo.agent.enabled:
        try:
            endpoint = start_agent_endpoint(grpo.agent, config.policy, run.generation, tokenizer)
        except BaseException:
            run.shutdown()
            raise
    return GRPOSetup(**run.run_fields(), loss_fn=loss_fn, agent_endpoint=endpoint)


def prev_logprobs_from_training_forward(config: GRPOMasterConfig, policy: Policy | None = None) -> bool:
    """Whether the training forward itself gives the previous policy's log-probs, so no separate scoring pass
    is needed: one optimizer step per batch (all of its forward passes run on the weights the batch would be
    scored with) and a training forward equal to the scoring one (no dropout)."""
    samples = config.grpo.samples_per_step
    if samples != config.policy.train_global_batch_size:
        return False
    # The started policy answers from its workers; without one the driver loads the model's config itself.
    return not (policy.trains_with_dropout() if policy is not None else trains_with_dropout(config.policy))


def build_train_batch(
    rollout: BatchedDataDict[Any], advantages_B: torch.Tensor, pad_token_id: int, overlong_filtering: bool
) -> BatchedDataDict[Any]:
    """Flatten the rolled-out conversations into the policy's training batch.

    Adds to the flattened ``input_ids`` / ``input_lengths`` / ``token_mask`` (assistant tokens): per-token
    ``advantages`` and ``generation_logprobs``, and ``sample_mask`` (prompts cut for length, and truncated
    responses when ``overlong_filtering`` is on, are masked out); with routing replay the sampler's
    ``routed_experts`` ``[B, T, MoE layers, top_k]``.
    """
    logs = rollout["message_log"]
    batch = message_logs_to_batch(logs, pad_token_id=pad_token_id, train_roles=_TRAIN_ROLES)
    generation_logprobs_BT = torch.zeros_like(batch["token_mask"])
    # One scatter for the batch: the trained messages' sampling log-probs, zeros for the other tokens.
    rows_N, cols_N = flat_token_positions(batch["input_lengths"].tolist())
    generation_logprobs_BT[rows_N, cols_N] = torch.cat(
        [
            message["generation_logprobs"].to(generation_logprobs_BT.dtype)
            if message["role"] in _TRAIN_ROLES
            else generation_logprobs_BT.new_zeros(int(message["token_ids"].numel()))
            for log in logs
            for message in log
        ]
    )
    sample_mask_B = rollout["loss_multiplier"].float().clone()
    if overlong_filtering:
        sample_mask_B *= (~rollout["truncated"]).float()
    batch["advantages"] = advantages_B[:, None].expand_as(batch["token_mask"]).contiguous()
    batch["generation_logprobs"] = generation_logprobs_BT
    batch["sample_mask"] = sample_mask_B
    routed_BTLK = routed_experts_batch(logs, int(batch["input_ids"].shape[1]))
    if routed_BTLK is not None:
        batch[ROUTED_EXPERTS_KEY] = routed_BTLK
    return batch


def validate(s: GRPOSetup, step: int, rollouts: AsyncRollouts | None = None) -> dict[str, float]:
    """Accuracy on up to ``grpo.max_val_samples`` held-out prompts (one response each); logged at ``step``.
    Under asynchronous GRPO it runs between two of the generation thread's calls."""
    cfg = s.config.grpo
    with contextlib.nullcontext() if rollouts is None else rollouts.exclusive():
        return s.validate_accuracy(step, cfg, greedy=cfg.val_greedy)


def transformed_rewards(rollout: BatchedDataDict[Any], cfg: GRPOConfig) -> torch.Tensor:
    """The rollout's rewards after ``grpo.reward_scaling`` then ``grpo.reward_shaping`` (the environments'
    own metrics keep the raw rewards)."""
    rewards_B = scale_rewards(rollout["total_reward"], cfg.reward_scaling)
    if not cfg.reward_shaping.enabled:
        return rewards_B
    lengths_B = first_response_lengths(rollout["message_log"])
    return shape_rewards(rewards_B, lengths_B, rollout["truncated"], cfg.reward_shaping)


def roll_out(
    s: GRPOSetup,
    batch: BatchedDataDict[Any],
    timer: Timer,
    generation: GenerationInterface | None = None,
) -> tuple[BatchedDataDict[Any], dict[str, float], Callable[[], dict[str, float]]]:
    """Sample ``num_generations_per_prompt`` responses per prompt of ``batch`` and score them; the rollout's
    ``total_reward`` holds the transformed rewards (see :func:`transformed_rewards`), its metrics ``reward``
    (their mean); the function returned last waits for the environments' own metrics. ``generation``
    defaults to the run's generation workers. With ``grpo.agent`` external agents roll the samples out
    through the run's agent endpoint instead (:func:`~nemo_rl.experience.agent_rollouts.run_agent_rollout`),
    and their rewards replace the environments'."""
    cfg = s.config
    if s.agent_endpoint is not None:
        return _roll_out_agents(s, s.agent_endpoint, batch, timer)
    rollout, metrics = s.sample(batch, cfg.grpo, timer, generation)
    env_metrics = request_environment_metrics(s.task_to_env, rollout)
    rollout["total_reward"] = transformed_rewards(rollout, cfg.grpo)
    metrics["reward"] = float(rollout["total_reward"].mean())
    return rollout, metrics, env_metrics


def _roll_out_agents(
    s: GRPOSetup, endpoint: AgentEndpoint, batch: BatchedDataDict[Any], timer: Timer
) -> tuple[BatchedDataDict[Any], dict[str, float], Callable[[], dict[str, float]]]:
    """:func:`roll_out` by external agents through the run's endpoint: their rewards score the samples (no
    environment step), so there are no environment metrics to wait for."""
    cfg = s.config
    samples = batch.repeat_interleave(cfg.grpo.num_generations_per_prompt)
    rollout, metrics = run_agent_rollout(endpoint, samples, s.tokenizer, cfg.grpo.agent, timer=timer)
    rollout["total_reward"] = transformed_rewards(rollout, cfg.grpo)
    metrics["reward"] = float(rollout["total_reward"].mean())
    return rollout, metrics, dict


def _roll_out_and_wait(
    s: GRPOSetup, batch: BatchedDataDict[Any], timer: Timer, generation: GenerationInterface | None = None
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    rollout, metrics, env_metrics = roll_out(s, batch, timer, generation)
    return rollout, {**metrics, **env_metrics()}


def grpo_step(
    s: GRPOSetup,
    batch: BatchedDataDict[Any],
    timer: Timer,
    next_batch: Callable[[], BatchedDataDict[Any]] | None = None,
) -> dict[str, float]:
    """One GRPO step on a batch of prompts; returns its ``train/`` metrics. Under dynamic sampling,
    ``next_batch`` gives the further prompt batches the step draws."""
    cfg = s.config
    s.state.consumed_prompts += len(batch["message_log"])
    s.refit_if_stale(timer)
    if cfg.grpo.use_dynamic_sampling:
        if next_batch is None:
            raise ValueError("grpo.use_dynamic_sampling needs grpo_step(..., next_batch=...) to draw batches")
        with timer.time("dynamic_sampling"):
            rollout, rollout_metrics = sample_until_full(
                batch,
                next_batch,
                lambda b: _roll_out_and_wait(s, b, timer),
                num_samples=cfg.grpo.samples_per_step,
                group_size=cfg.grpo.num_generations_per_prompt,
                max_gen_batches=cfg.grpo.dynamic_sampling_max_gen_batches,
            )
        env_metrics: Callable[[], dict[str, float]] = dict
    else:
        rollout, rollout_metrics, env_metrics = roll_out(s, batch, timer)
    s.generation.finish_generation()
    return train_on_rollout(s, rollout, rollout_metrics, timer, env_metrics)


def train_on_rollout(
    s: GRPOSetup,
    rollout: BatchedDataDict[Any],
    rollout_metrics: Mapping[str, float],
    timer: Timer,
    env_metrics: Callable[[], dict[str, float]] = dict,
) -> dict[str, float]:
    """The training half of a step: advantages, the log-probs the loss needs, the optimizer step(s); returns
    the step's ``train/`` metrics (``env_metrics`` is waited for after training)."""
    cfg = s.config
    advantages_B = compute_advantages(
        rollout["total_reward"],
        group_size=cfg.grpo.num_generations_per_prompt,
        use_leave_one_out_baseline=cfg.grpo.use_leave_one_out_baseline,
        normalize_rewards=cfg.grpo.normalize_rewards,
    )
    pad_token_id = int(s.tokenizer.pad_token_id)
    train_data = build_train_batch(rollout, advantages_B, pad_token_id, cfg.grpo.overlong_filtering)

    # The loss reads reference log-probs only with the KL term on, and the previous policy's from the training
    # forward when that is exact (see prev_logprobs_from_training_forward): then no scoring pass is needed.
    use_kl = cfg.loss_fn.reference_policy_kl_penalty > 0
    if use_kl or not s.loss_fn.prev_logprobs_from_forward:
        with timer.time("logprobs"):
            s.policy.prepare_for_lp_inference()
            if not s.loss_fn.prev_logprobs_from_forward:
                train_data["prev_logprobs"] = s.policy.get_logprobs(train_data)["logprobs"]
            if use_kl:
                reference = s.policy.get_reference_policy_logprobs(train_data)["reference_logprobs"]
                train_data["reference_policy_logprobs"] = reference
    with timer.time("policy_training"):
        s.policy.prepare_for_training()
        train_result = s.policy.train(train_data, s.loss_fn)
    s.refitter.mark_stale()
    s.state.total_valid_tokens += float(train_result["global_valid_toks"].sum())
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


def start_async_rollouts(s: GRPOSetup, total_steps: int) -> AsyncRollouts:
    """Refit the generation workers with the current policy, then start generation running ahead of training
    (``grpo.async_grpo``) for the steps left to ``total_steps``."""
    cfg = s.config.grpo.async_grpo
    s.refit_if_stale(Timer())
    if cfg.in_flight_weight_updates:
        cast(InFlightUpdatable, s.generation).enable_in_flight_weight_updates(
            cfg.recompute_kv_cache_after_weight_updates
        )
    # The rollout thread's own timer: the step's timings are the trainer's.
    rollout_timer = Timer()
    rollouts = AsyncRollouts(
        s.generation,
        lambda generation, batch: _roll_out_and_wait(s, batch, rollout_timer, generation),
        s.refit,
        batches=EndlessBatches(s.train_loader),
        loader_state=s.train_loader.state_dict,
        start_version=s.state.step,
        num_batches=max(total_steps - s.state.step, 0),
        max_age=cfg.max_trajectory_age_steps,
        in_flight=cfg.in_flight_weight_updates,
        max_failures=cfg.max_generation_failures,
        take_timeout_s=WORKER_CALL_TIMEOUT_S,
    )
    rollouts.start()
    return rollouts


def async_grpo_step(s: GRPOSetup, rollouts: AsyncRollouts, timer: Timer) -> dict[str, float]:
    """One step of asynchronous GRPO: train on the next batch that generation finished (no older than
    ``max_trajectory_age_steps``), then hand the new weights to the generation workers; returns the step's
    ``train/`` metrics, ``async/*`` among them. Each step's prompts, versions and drops are appended to
    ``<logger.log_dir>/async_trajectories.jsonl``."""
    step = s.state.step + 1
    with timer.time("wait_for_rollouts"):
        batch, async_metrics, dropped = rollouts.take(step)
    s.state.consumed_prompts += batch.num_prompts + sum(d.num_prompts for d in dropped)
    _record_trajectories(s, step, batch, dropped)
    metrics = train_on_rollout(s, batch.rollout, batch.metrics, timer)
    with timer.time("refit"):
        refit_metrics = rollouts.publish_weights(step)
    s.logger.log_metrics(refit_metrics, step + 1)
    return {**metrics, **async_metrics, "async/consumed_prompts": float(s.state.consumed_prompts)}


def _record_trajectories(s: GRPOSetup, step: int, batch: RolloutBatch, dropped: list[RolloutBatch]) -> None:
    group_size = s.config.grpo.num_generations_per_prompt
    record = {
        "step": step,
        "version": batch.version,
        "age": step - 1 - batch.version,
        "prompt_idx": batch.rollout["idx"][::group_size].tolist(),
        "dropped": [
            {"version": d.version, "prompt_idx": d.rollout["idx"][::group_size].tolist()} for d in dropped
        ],
    }
    path = Path(s.logger.log_dir) / "async_trajectories.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _drawn(s: GRPOSetup, batch: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """A further prompt batch drawn within a step (dynamic sampling), counted as consumed."""
    s.state.consumed_prompts += len(batch["message_log"])
    return batch


def grpo_train(s: GRPOSetup) -> dict[str, float]:
    """Run GRPO to ``grpo.max_num_steps`` (or ``max_num_epochs``); returns the last step's metrics. With
    ``grpo.async_grpo.enabled`` each step's batch comes from generation running ahead (see
    :mod:`nemo_rl.experience.async_rollouts`) instead of being sampled in the step."""
    cfg = s.config
    metrics: dict[str, float] = {}
    total_steps = step_budget(cfg.grpo.max_num_steps, cfg.grpo.max_num_epochs, len(s.train_loader))
    rollouts = start_async_rollouts(s, total_steps) if cfg.grpo.async_grpo.enabled else None
    # One stream of prompt batches: the loop takes one per step, dynamic sampling may draw more. Under async
    # GRPO the generation thread draws them, and the loop only counts steps.
    batches = EndlessBatches(s.train_loader)
    loop = make_train_loop(
        "grpo",
        s,
        cfg.grpo,
        save_checkpoint=s.save_checkpoint
        if rollouts is None
        else partial(s.save_checkpoint, rollouts.position),
        validate=lambda step: validate(s, step, rollouts),
        # Async: the loop's "batches" only count steps (each step takes its batch from the rollouts).
        loader=batches if rollouts is None else cast(Iterable[BatchedDataDict[Any]], itertools.count()),
        total_steps=total_steps,
    )
    try:
        for batch in loop:
            if rollouts is None:
                metrics = grpo_step(s, batch, loop.timer, next_batch=lambda: _drawn(s, next(batches)))
            else:
                metrics = async_grpo_step(s, rollouts, loop.timer)
            loop.end_step(metrics, num_tokens=metrics["mean_conversation_tokens"] * cfg.grpo.samples_per_step)
    finally:
        if rollouts is not None:
            rollouts.close()
    return metrics
