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

import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.advantages import compute_advantages
from nemo_rl.algorithms.dynamic_sampling import EndlessBatches, sample_until_full
from nemo_rl.algorithms.loop import (
    TrainLoop,
    check_run_setup,
    find_resume,
    save_training_checkpoint,
    step_budget,
    train_metrics,
)
from nemo_rl.algorithms.loss_functions import ClippedPGLossFn
from nemo_rl.algorithms.rewards import first_response_lengths, scale_rewards, shape_rewards
from nemo_rl.config.algorithms import GRPOConfig
from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.env import EnvConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.loader import save_config
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.collate_fn import rl_collate_fn
from nemo_rl.data.dataloader import StatefulDataLoader
from nemo_rl.data.datasets import ProcessedDataset, dataset_task_names
from nemo_rl.data.llm_message_utils import flat_token_positions, message_logs_to_batch
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster, init_ray
from nemo_rl.distributed.worker_groups import start_together
from nemo_rl.environments.registry import (
    check_task_envs,
    create_task_envs,
    stop_envs,
    wait_envs_started,
)
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.models.generation.embedded.in_policy import InPolicyEmbeddedGeneration
from nemo_rl.models.generation.factory import (
    create_generation,
    create_policy_refit_transport,
    refit_from_policy,
)
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.policy.hf_io import trains_with_dropout
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.utils.checkpoint import CheckpointManager
from nemo_rl.utils.logger import Logger
from nemo_rl.utils.timer import Timer
from nemo_rl.weight_sync.interfaces import RefitTransport

MasterConfig = GRPOMasterConfig
"""The config of a GRPO run, under NeMo RL's name (``from nemo_rl.algorithms.grpo import MasterConfig``)."""

_TRAIN_ROLES = ("assistant",)
# Longest wait for an environment actor's metrics or shutdown.
_ENV_TIMEOUT_S = 600.0


@dataclasses.dataclass
class GRPOState:
    """What a checkpoint records about the loop's progress."""

    step: int = 0
    """GRPO steps taken."""

    total_valid_tokens: float = 0.0
    """Tokens trained on so far."""

    val_accuracy: float | None = None
    """Latest validation accuracy."""


@dataclasses.dataclass
class GRPOSetup:
    """Everything ``grpo_train`` needs, built by ``setup``."""

    config: GRPOMasterConfig
    tokenizer: PreTrainedTokenizerBase
    cluster: RayVirtualCluster
    policy: Policy
    generation: GenerationInterface
    refit_transport: RefitTransport | None
    """``None`` when the generation engines live in the policy workers (an in-process refit)."""
    train_loader: StatefulDataLoader[Any, BatchedDataDict[Any]]
    val_dataset: ProcessedDataset | None
    loss_fn: ClippedPGLossFn
    task_to_env: dict[str, Any]
    """Environment actor per task for training rollouts."""
    val_task_to_env: dict[str, Any]
    """Environment actor per task for validation rollouts (the training ones unless given separately)."""
    logger: Logger
    checkpointer: CheckpointManager
    state: GRPOState
    owned_envs: list[Any] = dataclasses.field(default_factory=list)
    """Environment actors ``setup`` started (and ``shutdown`` stops); those passed in stay the caller's."""
    generation_stale: bool = True

    def shutdown(self) -> None:
        """Stop the workers and the environments ``setup`` started, flush the loggers, release the placement
        groups. Environments passed to ``setup`` in ``task_to_env`` / ``val_task_to_env`` are left running."""
        self.logger.close()
        self.generation.shutdown()
        self.policy.shutdown()
        if self.refit_transport is not None:
            self.refit_transport.shutdown()
        stop_envs(self.owned_envs, _ENV_TIMEOUT_S)
        self.cluster.shutdown()


def placement(policy: PolicyConfig, cluster: ClusterConfig) -> tuple[list[int], list[int]]:
    """Bundle indices of the policy and the generation workers.

    Colocated: both use every bundle and take turns. Otherwise the last
    ``policy.generation.colocated.resources.gpus_per_node`` bundles of each node go to generation.
    """
    total = cluster.gpus_per_node * cluster.num_nodes
    if policy.generation.colocated.enabled:
        return list(range(total)), list(range(total))
    gen_per_node = policy.generation.colocated.resources.gpus_per_node
    assert gen_per_node is not None  # checked by the master config
    if gen_per_node >= cluster.gpus_per_node:
        raise UserError(
            f"non-colocated generation takes policy.generation.colocated.resources.gpus_per_node="
            f"{gen_per_node} of cluster.gpus_per_node={cluster.gpus_per_node} slots per node, leaving "
            "none for the policy: raise cluster.gpus_per_node or lower the generation slots"
        )
    policy_bundles: list[int] = []
    generation_bundles: list[int] = []
    for node in range(cluster.num_nodes):
        first = node * cluster.gpus_per_node
        split = first + cluster.gpus_per_node - gen_per_node
        policy_bundles += range(first, split)
        generation_bundles += range(split, first + cluster.gpus_per_node)
    return policy_bundles, generation_bundles


def _check_batch_sizes(config: GRPOMasterConfig) -> None:
    samples = config.grpo.samples_per_step
    if samples % config.policy.train_global_batch_size != 0:
        raise UserError(
            f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {samples} responses per step must "
            f"be a multiple of policy.train_global_batch_size={config.policy.train_global_batch_size}"
        )


def tasks_to_start(
    env: EnvConfig,
    train_tasks: set[str],
    val_tasks: set[str],
    task_to_env: Mapping[str, Any] | None,
    val_task_to_env: Mapping[str, Any] | None,
) -> set[str]:
    """The tasks ``setup`` starts environments for (those not passed in); fails before anything starts when
    a task of the data would have no environment."""
    to_start: set[str] = set()
    for name, tasks, given in (
        ("train_dataset", train_tasks, task_to_env),
        ("val_dataset", val_tasks, val_task_to_env if val_task_to_env is not None else task_to_env),
    ):
        if given is None:
            to_start |= tasks
        elif tasks - given.keys():
            raise UserError(
                f"{name} has samples of task {sorted(tasks - given.keys())[0]!r}, which the environments passed "
                f"to setup do not cover (they cover {sorted(given)}); add an environment for it"
            )
    check_task_envs(to_start, env)
    return to_start


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
    """
    _check_batch_sizes(config)
    # Input checks that need no workers, before Ray starts.
    check_run_setup(
        config.policy,
        config.checkpointing,
        config.logger.log_dir,
        policy_world_size=len(placement(config.policy, config.cluster)[0]),
        run_name="GRPO",
        metric_names={"val_accuracy", "validation/accuracy", "val:accuracy"},
    )
    train_tasks = dataset_task_names(train_dataset)
    val_tasks = dataset_task_names(val_dataset)
    to_start = tasks_to_start(config.env, train_tasks, val_tasks, task_to_env, val_task_to_env)
    checkpointer = CheckpointManager(config.checkpointing)
    resume = find_resume(checkpointer, "GRPO", config)
    state = resume.state(GRPOState)

    train_loader: StatefulDataLoader[Any, BatchedDataDict[Any]] = StatefulDataLoader(
        train_dataset,
        batch_size=config.grpo.prompts_per_generation_batch,
        shuffle=config.data.shuffle,
        seed=config.grpo.seed,
        drop_last=True,
        collate_fn=rl_collate_fn,
    )
    resume.restore_loader(train_loader)

    init_ray(config.cluster)
    cluster = RayVirtualCluster(config.cluster, name="grpo", max_colocated_worker_groups=2)
    policy_bundles, generation_bundles = placement(config.policy, config.cluster)
    # vLLM first: it starts only when gpu_memory_utilization of each GPU is free, and colocated engines then
    # sleep (weights to host memory, caches freed) while the policy loads. The embedded engine's workers and
    # the policy's start together.
    colocated = config.policy.generation.colocated.enabled
    together = config.policy.generation.backend != "vllm"
    in_policy = config.policy.generation.embedded_cfg.in_policy_workers
    generation: GenerationInterface
    started: dict[str, Any] = {}
    try:
        # The environment actors start first, so their imports overlap the workers' start instead of
        # delaying the first step; setup waits for them after the workers.
        started = create_task_envs(to_start, config.env)
        with start_together(enabled=together):
            if not in_policy:
                generation = create_generation(
                    cluster,
                    config.policy,
                    tokenizer,
                    seed=config.grpo.seed,
                    bundle_indices=generation_bundles,
                )
                if colocated and not together:
                    generation.finish_generation()
            policy = Policy(
                cluster,
                config.policy,
                bundle_indices=policy_bundles,
                init_reference_model=config.loss_fn.reference_policy_kl_penalty > 0,
                weights_path=resume.weights_path,
                optimizer_path=resume.optimizer_path,
            )
        if in_policy:
            generation = InPolicyEmbeddedGeneration(policy, tokenizer, seed=config.grpo.seed)
        wait_envs_started(started.values(), _ENV_TIMEOUT_S)
    except BaseException:
        stop_envs(started.values(), _ENV_TIMEOUT_S)
        raise
    if colocated and together:
        generation.finish_generation()
    # The per-call sampling seeds continue where the checkpoint left them.
    checkpointer.track("generation", generation)
    refit_transport = create_policy_refit_transport(
        cluster,
        config.policy,
        policy,
        generation,
        policy_bundles=policy_bundles,
        generation_bundles=generation_bundles,
    )
    task_to_env = started if task_to_env is None else task_to_env
    val_task_to_env = task_to_env if val_task_to_env is None else val_task_to_env
    logger = Logger(config.logger)
    logger.log_hyperparams(config.model_dump(mode="json"))
    save_config(config, config.logger.log_dir)
    return GRPOSetup(
        config=config,
        tokenizer=tokenizer,
        cluster=cluster,
        policy=policy,
        generation=generation,
        refit_transport=refit_transport,
        train_loader=train_loader,
        val_dataset=val_dataset,
        loss_fn=ClippedPGLossFn(
            config.loss_fn, prev_logprobs_from_forward=prev_logprobs_from_training_forward(config, policy)
        ),
        task_to_env=dict(task_to_env),
        val_task_to_env=dict(val_task_to_env),
        logger=logger,
        checkpointer=checkpointer,
        state=state,
        owned_envs=list(started.values()),
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


def refit_generation(s: GRPOSetup) -> dict[str, float]:
    """Copy the policy's current weights into the generation workers."""
    metrics = refit_from_policy(
        s.policy, s.generation, s.refit_transport, timeout_s=s.config.policy.refit.timeout_s
    )
    s.generation_stale = False
    return metrics


def build_train_batch(
    rollout: BatchedDataDict[Any], advantages_B: torch.Tensor, pad_token_id: int, overlong_filtering: bool
) -> BatchedDataDict[Any]:
    """Flatten the rolled-out conversations into the policy's training batch.

    Adds to the flattened ``input_ids`` / ``input_lengths`` / ``token_mask`` (assistant tokens): per-token
    ``advantages`` and ``generation_logprobs``, and ``sample_mask`` (prompts cut for length, and truncated
    responses when ``overlong_filtering`` is on, are masked out).
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
    return batch


def request_environment_metrics(
    task_to_env: Mapping[str, Any], rollout: BatchedDataDict[Any]
) -> Callable[[], dict[str, float]]:
    """Ask each environment for its own metrics (accuracy, pass@k...) over its samples; the returned function
    waits for them, as ``<task>/<metric>``. The environments compute them while the caller goes on (GRPO
    trains meanwhile)."""
    task_names = list(rollout["task_name"])
    requests = []
    for task, env in task_to_env.items():
        indices = [i for i, name in enumerate(task_names) if name == task]
        if indices:
            ref = env.global_post_process_and_metrics.remote(rollout.select_indices(indices))
            requests.append((task, ref))

    def wait() -> dict[str, float]:
        metrics: dict[str, float] = {}
        for task, ref in requests:
            _, task_metrics = ray.get(ref, timeout=_ENV_TIMEOUT_S)
            metrics.update({f"{task}/{name}": value for name, value in task_metrics.items()})
        return metrics

    return wait


def environment_metrics(task_to_env: Mapping[str, Any], rollout: BatchedDataDict[Any]) -> dict[str, float]:
    """Each environment's own metrics (accuracy, pass@k...) over its samples, as ``<task>/<metric>``."""
    return request_environment_metrics(task_to_env, rollout)()


def validation_rollouts(
    generation: GenerationInterface,
    val_dataset: ProcessedDataset,
    tokenizer: PreTrainedTokenizerBase,
    val_task_to_env: Mapping[str, Any],
    *,
    max_val_samples: int,
    val_batch_size: int,
    max_seq_len: int,
    max_rollout_turns: int,
    greedy: bool,
) -> tuple[dict[str, float], list[str]]:
    """Roll out the first ``max_val_samples`` prompts of ``val_dataset`` once each, in batches of
    ``val_batch_size``; returns the ``validation/`` metrics (accuracy, mean reward and length, the
    environments' own) and the conversations as text with their rewards."""
    start_s = time.perf_counter()
    rewards: list[torch.Tensor] = []
    lengths: list[float] = []
    samples: list[str] = []
    rollouts: list[BatchedDataDict[Any]] = []
    num_samples = min(max_val_samples, len(val_dataset))
    generation.prepare_for_generation()
    for start in range(0, num_samples, val_batch_size):
        batch = rl_collate_fn(
            [val_dataset[i] for i in range(start, min(start + val_batch_size, num_samples))]
        )
        rollout, rollout_metrics = run_multi_turn_rollout(
            generation,
            batch,
            tokenizer,
            val_task_to_env,
            max_seq_len=max_seq_len,
            max_rollout_turns=max_rollout_turns,
            greedy=greedy,
        )
        rewards.append(rollout["total_reward"])
        rollouts.append(rollout)
        lengths.append(rollout_metrics["mean_gen_tokens_per_sample"] * rollout["total_reward"].numel())
        samples += [
            "".join(m["content"] for m in log) + f"\n[reward {float(r):.1f}]"
            for log, r in zip(rollout["message_log"], rollout["total_reward"], strict=True)
        ]
    generation.finish_generation()
    all_rewards = torch.cat(rewards)
    metrics = {
        "accuracy": float((all_rewards > 0).float().mean()),
        "mean_reward": float(all_rewards.mean()),
        "mean_gen_tokens_per_sample": sum(lengths) / all_rewards.numel(),
        "num_samples": float(all_rewards.numel()),
        "time_s": time.perf_counter() - start_s,
        **environment_metrics(val_task_to_env, BatchedDataDict.from_batches(rollouts)),
    }
    return metrics, samples


def validate(s: GRPOSetup, step: int) -> dict[str, float]:
    """Accuracy on up to ``grpo.max_val_samples`` held-out prompts (one response each); logged at ``step``."""
    if s.val_dataset is None or len(s.val_dataset) == 0:
        return {}
    if s.generation_stale:
        refit_generation(s)
    metrics, samples = validation_rollouts(
        s.generation,
        s.val_dataset,
        s.tokenizer,
        s.val_task_to_env,
        max_val_samples=s.config.grpo.max_val_samples,
        val_batch_size=s.config.grpo.val_batch_size,
        max_seq_len=s.config.policy.max_total_sequence_length,
        max_rollout_turns=s.config.grpo.max_rollout_turns,
        greedy=s.config.grpo.val_greedy,
    )
    s.logger.print_samples(samples, step)
    s.logger.log_metrics(metrics, step, prefix="validation")
    s.state.val_accuracy = metrics["accuracy"]
    return metrics


def save_checkpoint(s: GRPOSetup) -> Path:
    """Write the policy, optimizer, scheduler, loader position and loop state as ``step_<N>`` (atomically)."""
    return save_training_checkpoint(
        s.checkpointer,
        state=s.state,
        run_config=s.config,
        policy=s.policy,
        train_loader=s.train_loader,
        metric_value=s.state.val_accuracy,
    )


def transformed_rewards(rollout: BatchedDataDict[Any], cfg: GRPOConfig) -> torch.Tensor:
    """The rollout's rewards after ``grpo.reward_scaling`` then ``grpo.reward_shaping`` (the environments'
    own metrics keep the raw rewards)."""
    rewards_B = scale_rewards(rollout["total_reward"], cfg.reward_scaling)
    if not cfg.reward_shaping.enabled:
        return rewards_B
    lengths_B = first_response_lengths(rollout["message_log"])
    return shape_rewards(rewards_B, lengths_B, rollout["truncated"], cfg.reward_shaping)


def roll_out(
    s: GRPOSetup, batch: BatchedDataDict[Any], timer: Timer
) -> tuple[BatchedDataDict[Any], dict[str, float], Callable[[], dict[str, float]]]:
    """Sample ``num_generations_per_prompt`` responses per prompt of ``batch`` and score them; the rollout's
    ``total_reward`` holds the transformed rewards (see :func:`transformed_rewards`), its metrics ``reward``
    (their mean); the function returned last waits for the environments' own metrics."""
    cfg = s.config
    rollout, metrics = run_multi_turn_rollout(
        s.generation,
        batch.repeat_interleave(cfg.grpo.num_generations_per_prompt),
        s.tokenizer,
        s.task_to_env,
        max_seq_len=cfg.policy.max_total_sequence_length,
        max_rollout_turns=cfg.grpo.max_rollout_turns,
        timer=timer,
    )
    env_metrics = request_environment_metrics(s.task_to_env, rollout)
    rollout["total_reward"] = transformed_rewards(rollout, cfg.grpo)
    metrics["reward"] = float(rollout["total_reward"].mean())
    return rollout, metrics, env_metrics


def _roll_out_and_wait(
    s: GRPOSetup, batch: BatchedDataDict[Any], timer: Timer
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    rollout, metrics, env_metrics = roll_out(s, batch, timer)
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
    if s.generation_stale:
        with timer.time("refit"):
            refit_metrics = refit_generation(s)
        s.logger.log_metrics(refit_metrics, s.state.step + 1)
    s.generation.prepare_for_generation()
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
    s.generation_stale = True
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


def grpo_train(s: GRPOSetup) -> dict[str, float]:
    """Run GRPO to ``grpo.max_num_steps`` (or ``max_num_epochs``); returns the last step's metrics."""
    cfg = s.config
    metrics: dict[str, float] = {}
    # One stream of prompt batches: the loop takes one per step, dynamic sampling may draw more.
    batches = EndlessBatches(s.train_loader)
    loop = TrainLoop(
        "grpo",
        loader=batches,
        state=s.state,
        total_steps=step_budget(cfg.grpo.max_num_steps, cfg.grpo.max_num_epochs, len(s.train_loader)),
        logger=s.logger,
        checkpointer=s.checkpointer,
        save_checkpoint=lambda: save_checkpoint(s),
        validate=lambda step: validate(s, step),
        val_period=cfg.grpo.val_period,
        val_at_start=cfg.grpo.val_at_start,
        val_at_end=cfg.grpo.val_at_end,
    )
    for batch in loop:
        metrics = grpo_step(s, batch, loop.timer, next_batch=lambda: next(batches))
        loop.end_step(metrics, num_tokens=metrics["mean_conversation_tokens"] * cfg.grpo.samples_per_step)
    return metrics
