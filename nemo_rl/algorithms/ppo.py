"""PPO with a learned critic.

Each step (see docs/algorithms/ppo.md):

1. take ``ppo.num_prompts_per_step`` prompts, repeat each ``num_generations_per_prompt`` times, refit stale
   generation weights, roll out and score, and transform the rewards, as GRPO does
   (:mod:`nemo_rl.algorithms.scored_rollouts`, dynamic sampling included);
2. the critic (``run.models["value"]``, a value model on its own workers) values the state before every token
   of the rollouts;
3. GAE (:mod:`nemo_rl.algorithms.gae`): each response's reward on its last assistant token, advantages and
   returns over the assistant tokens (multi-turn holes carried over), VAPO's decoupled lambdas, advantages
   whitened over the batch;
4. the policy scores the rollouts under its current weights (unless the training forward gives the same
   numbers) and, with the KL term on, under the reference weights;
5. ``max(ppo_epochs, critic_ppo_epochs)`` passes over the batch, each training the critic (clipped value loss)
   and then the policy (clipped policy-gradient loss), each in mini-batches of its ``train_global_batch_size``;
   before ``ppo.policy_training_start_step`` only the critic trains (warm-up) and the generation weights stay
   current;
6. log (``train/critic/*`` besides the policy's metrics), validate and checkpoint (the critic under
   ``value/``, next to ``policy/``) when due.

``setup`` builds every piece from a :class:`PPOMasterConfig` (resuming policy and critic from the latest
checkpoint when there is one) and ``ppo_train`` runs the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.dynamic_sampling import EndlessBatches
from nemo_rl.algorithms.gae import gae_advantages_and_returns, terminal_token_rewards
from nemo_rl.algorithms.loop import train_metrics
from nemo_rl.algorithms.loss_functions import ClippedPGLossFn, ValueLossFn
from nemo_rl.algorithms.losses import explained_variance
from nemo_rl.algorithms.run import EnvMetrics, Run
from nemo_rl.algorithms.run_build import ExtraPolicy, RunSpec, SamplingSpec, build_run
from nemo_rl.algorithms.scored_rollouts import PromptsState, draw, sample_step
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import PPOMasterConfig
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.train_batch import build_train_batch
from nemo_rl.models.policy.hf_io import trains_with_dropout
from nemo_rl.models.policy.interfaces import TrainResult
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.models.tokenizer import get_policy_tokenizer
from nemo_rl.utils.timer import Timer

MasterConfig = PPOMasterConfig
"""The config of a PPO run, under NeMo RL's name (``from nemo_rl.algorithms.ppo import MasterConfig``)."""

VALUE = "value"
"""The critic's key in ``Run.models`` and its folder in a checkpoint (NeMo RL's ``value/``)."""


@dataclasses.dataclass
class PPOState(PromptsState):
    """What a checkpoint records about the PPO loop's progress (steps, tokens trained on, validation accuracy,
    prompts consumed)."""


PPORun = Run[PPOMasterConfig, PPOState]
"""A started PPO run: the trained ``policy`` and the critic ``models["value"]``."""


@dataclasses.dataclass(frozen=True)
class PPOLosses:
    """The two losses of a PPO step."""

    policy: ClippedPGLossFn
    value: ValueLossFn


def check_critic(config: PPOMasterConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """The critic reads the policy's token ids, so both need one vocabulary (a critic with the policy's
    tokenizer source is not loaded again)."""
    source = config.value.tokenizer.name or config.value.model_name
    if source == (config.policy.tokenizer.name or config.policy.model_name):
        return
    if tokenizer.get_vocab() != get_policy_tokenizer(config.value).get_vocab():
        raise UserError(
            f"the critic's tokenizer ({source}) maps tokens to ids differently from the policy's "
            f"({config.policy.tokenizer.name or config.policy.model_name}): PPO's critic values the policy's "
            "token ids; give value.model_name a model with the same tokenizer"
        )


def _check_warm_up(config: PPOMasterConfig, train_dataset: ProcessedDataset) -> None:
    """The critic warm-up must end before the run does (the config alone checks ``max_num_steps``; a run
    bounded by its epochs is known from the data)."""
    ppo = config.ppo
    steps = min(
        ppo.max_num_steps, ppo.max_num_epochs * (len(train_dataset) // ppo.prompts_per_generation_batch)
    )
    if ppo.policy_training_start_step >= steps:
        raise UserError(
            f"ppo.policy_training_start_step={ppo.policy_training_start_step} is not before the run's last step "
            f"({steps} steps: ppo.max_num_steps / max_num_epochs over {len(train_dataset)} prompts): the policy "
            "would never train; lower the warm-up or train longer"
        )


def setup(
    config: PPOMasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
    task_to_env: Mapping[str, Any] | None = None,
    val_task_to_env: Mapping[str, Any] | None = None,
) -> PPORun:
    """Start Ray, the policy, the critic, generation and environment workers; restore the latest checkpoint if
    any (policy and critic), else warm-start the critic from ``ppo.warm_start_value_checkpoint`` when set.
    Environments are passed in or started per task, as for GRPO (``nemo_rl.algorithms.grpo.setup``)."""
    check_critic(config, tokenizer)
    _check_warm_up(config, train_dataset)
    ppo = config.ppo
    warm_start = ppo.warm_start_value_checkpoint
    colocated = ppo.value_colocated
    critic = ExtraPolicy(
        config.value,
        VALUE,
        trained=True,
        warm_start=None if warm_start is None else str(Path(warm_start) / VALUE / "weights"),
        own_slots_per_node=0 if colocated.enabled else colocated.resources.gpus_per_node or 0,
    )
    spec = RunSpec.sampling_loop(
        "PPO",
        PPOState,
        SamplingSpec(env=config.env, task_to_env=task_to_env, val_task_to_env=val_task_to_env),
        section="ppo",
        seed=ppo.seed,
        num_prompts=ppo.prompts_per_generation_batch,
        keep_reference_model=config.loss_fn.reference_policy_kl_penalty > 0,
        models=[critic],
    )
    return build_run(config, tokenizer, train_dataset, val_dataset, spec)


def losses(run: PPORun) -> PPOLosses:
    """The step's losses: the clipped policy gradient (taking the previous policy's log-probs from the training
    forward when exact) and the critic's clipped value loss."""
    config = run.config
    return PPOLosses(
        policy=ClippedPGLossFn(
            config.loss_fn, prev_logprobs_from_forward=prev_logprobs_from_training_forward(config, run.policy)
        ),
        value=ValueLossFn(config.value_loss_fn),
    )


def prev_logprobs_from_training_forward(config: PPOMasterConfig, policy: Policy | None = None) -> bool:
    """Whether the training forward itself gives the previous policy's log-probs: the policy takes one optimizer
    step per batch (one pass, one mini-batch) and its training forward equals the scoring one (no dropout)."""
    if config.ppo.ppo_epochs != 1 or config.ppo.samples_per_step != config.policy.train_global_batch_size:
        return False
    return not (policy.trains_with_dropout() if policy is not None else trains_with_dropout(config.policy))


def _trained_tokens(data: BatchedDataDict[Any]) -> torch.Tensor:
    """[B, T]: 1 on the assistant tokens of the samples that count, 0 elsewhere."""
    return data["token_mask"] * data["sample_mask"][:, None]


def _masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    return float((x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))


def advantages_and_returns(
    rewards_B: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, run: PPORun
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over ``mask_BT``'s tokens (:func:`_trained_tokens`): each response's (transformed) reward on its last
    assistant token, the critic's ``values_BT`` (aligned with the tokens)."""
    token_rewards_BT = terminal_token_rewards(rewards_B.to(values_BT.dtype), mask_BT)
    return gae_advantages_and_returns(token_rewards_BT, values_BT, mask_BT, run.config.ppo.adv_estimator)


def _critic_metrics(
    result: TrainResult, values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, float]:
    """``critic/*``: the critic's training metrics and, over ``mask_BT``'s tokens, how well its values before
    this step's updates explained the returns."""
    metrics = {f"critic/{name}": value for name, value in train_metrics(result).items()}
    returns, values = returns_BT[mask_BT != 0], values_BT[mask_BT != 0]
    if returns.numel():
        metrics["critic/explained_var"] = explained_variance(
            float(returns.mean()),
            float(values.mean()),
            float((returns**2).mean()),
            float(((returns - values) ** 2).mean()),
        )
    return metrics


def train_on_rollout(
    run: PPORun,
    loss: PPOLosses,
    rollout: BatchedDataDict[Any],
    rollout_metrics: Mapping[str, float],
    timer: Timer,
    env_metrics: EnvMetrics = dict,
) -> dict[str, float]:
    """The training half of a PPO step (steps 2-5 of the module docstring); returns its ``train/`` metrics."""
    cfg = run.config
    critic = run.models[VALUE]
    data = build_train_batch(rollout, None, int(run.tokenizer.pad_token_id), cfg.ppo.overlong_filtering)
    with timer.time("value_inference"):
        critic.prepare_for_lp_inference()
        values_BT = critic.get_values(data)["values"]
    mask_BT = _trained_tokens(data)
    advantages_BT, returns_BT = advantages_and_returns(rollout["total_reward"], values_BT, mask_BT, run)
    data["advantages"], data["returns"], data["old_values"] = advantages_BT, returns_BT, values_BT
    trains_policy = run.state.step >= cfg.ppo.policy_training_start_step
    if trains_policy:
        _score_policy(run, loss.policy, data, timer)
    critic_result = policy_result = None
    for epoch in range(max(cfg.ppo.ppo_epochs, cfg.ppo.critic_epochs)):
        if epoch < cfg.ppo.critic_epochs:
            with timer.time("value_training"):
                critic.prepare_for_training()
                critic_result = critic.train(data, loss.value)
                if cfg.ppo.value_colocated.enabled:
                    # The critic shares the policy's devices: its weights and optimizer leave them in turn.
                    critic.offload_after_refit()
        if trains_policy and epoch < cfg.ppo.ppo_epochs:
            with timer.time("policy_training"):
                run.policy.prepare_for_training()
                policy_result = run.policy.train(data, loss.policy)
    assert critic_result is not None  # critic_epochs >= 1
    metrics = _critic_metrics(critic_result, values_BT, returns_BT, mask_BT)
    extra = {
        "advantages/mean": _masked_mean(advantages_BT, mask_BT),
        "returns/mean": _masked_mean(returns_BT, mask_BT),
        "policy_trained": float(trains_policy),
        **rollout_metrics,
        **metrics,
    }
    if policy_result is None:
        return {**extra, **env_metrics()}
    run.mark_trained()
    run.state.total_valid_tokens += float(policy_result["global_valid_toks"].sum())
    return train_metrics(policy_result, {**extra, **env_metrics()})


def _score_policy(run: PPORun, loss_fn: ClippedPGLossFn, data: BatchedDataDict[Any], timer: Timer) -> None:
    """The log-probs the policy loss reads: the previous policy's (unless the training forward gives them) and,
    with the KL term on, the reference policy's."""
    use_kl = run.config.loss_fn.reference_policy_kl_penalty > 0
    if not use_kl and loss_fn.prev_logprobs_from_forward:
        return
    with timer.time("logprobs"):
        run.policy.prepare_for_lp_inference()
        if not loss_fn.prev_logprobs_from_forward:
            data["prev_logprobs"] = run.policy.get_logprobs(data)["logprobs"]
        if use_kl:
            data["reference_policy_logprobs"] = run.policy.get_reference_policy_logprobs(data)[
                "reference_logprobs"
            ]


def ppo_step(
    run: PPORun, batch: BatchedDataDict[Any], timer: Timer, loss: PPOLosses, batches: EndlessBatches[Any]
) -> dict[str, float]:
    """One PPO step on a batch of prompts (``batches`` gives dynamic sampling's further batches); returns its
    ``train/`` metrics."""
    rollout, rollout_metrics, env_metrics = sample_step(
        run, batch, run.config.ppo, timer, next_batch=partial(draw, run, batches)
    )
    return train_on_rollout(run, loss, rollout, rollout_metrics, timer, env_metrics)


def ppo_train(run: PPORun) -> dict[str, float]:
    """Run PPO to ``ppo.max_num_steps`` (or ``max_num_epochs``); returns the last step's metrics."""
    cfg = run.config.ppo
    loss = losses(run)
    metrics: dict[str, float] = {}
    # One stream of prompt batches: the loop takes one per step, dynamic sampling may draw more.
    batches = EndlessBatches(run.train_loader)
    loop = run.train_loop(
        "ppo",
        cfg,
        validate=lambda step: run.validate_by_sampling(step, cfg, greedy=cfg.val_greedy),
        loader=batches,
    )
    for batch in loop:
        metrics = ppo_step(run, batch, loop.timer, loss, batches)
        loop.end_step(metrics, num_tokens=metrics["mean_conversation_tokens"] * cfg.samples_per_step)
    return metrics
