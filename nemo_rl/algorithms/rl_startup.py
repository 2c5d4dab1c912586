"""The start-up every RL loop shares (GRPO, distillation): which slots the policy and the generation workers
take, the workers started together, the refit transport between them, and the environments.

:func:`start_rl_workers` starts, in this order:

1. Ray and the cluster's slots;
2. the environment actors of the tasks the caller did not pass in, so their imports overlap the workers'
   start instead of delaying the first step;
3. the policy (and any frozen scoring policies, such as distillation's teacher) and the generation backend,
   in the order the backend needs (:func:`~nemo_rl.models.generation.factory.start_policy_and_generation`);
4. it waits for the environments; if anything failed so far, the environments it started are stopped;
5. the :class:`~nemo_rl.weight_sync.refitter.Refitter` that moves the policy's weights into the generation
   backend (it checks both ends' manifests first).

The result, :class:`RLWorkers`, is the base of :class:`RLRun`, which adds what every RL loop's setup holds
(loader, logger, checkpoints, state) and what it does besides its step: refit, validate, save and shut down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.loop import Resume, SupportsStateDict
from nemo_rl.algorithms.run_setup import (
    Loader,
    make_train_loader,
    open_run,
    save_run_checkpoint,
    start_cluster,
    start_logger,
    start_policy,
)
from nemo_rl.config.algorithms import DistillationConfig, GRPOConfig
from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.env import EnvConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import DistillationMasterConfig, GRPOMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.collate_fn import rl_collate_fn
from nemo_rl.data.datasets import ProcessedDataset, dataset_task_names
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.environments.registry import check_task_envs, create_task_envs, stop_envs, wait_envs_started
from nemo_rl.environments.tools import TaskTools, build_task_tools
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.experience.validation import ENV_TIMEOUT_S, validation_rollouts
from nemo_rl.models.generation.factory import start_policy_and_generation
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.utils.checkpoint import CheckpointManager
from nemo_rl.utils.logger import Logger
from nemo_rl.utils.timer import Timer
from nemo_rl.weight_sync.refitter import Refitter

RLConfig = GRPOMasterConfig | DistillationMasterConfig
"""The master configs of the RL loops: a policy with generation settings, environments and a cluster."""


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


@dataclasses.dataclass(frozen=True)
class ScoringPolicy:
    """A frozen policy started with the trained one, on its slots, that only scores (distillation's teacher).
    It keeps its weights off the device except while scoring."""

    cfg: PolicyConfig
    name_prefix: str
    """Names its worker actors apart from the trained policy's."""


@dataclasses.dataclass(kw_only=True)
class RLWorkers:
    """The workers of an RL run, started by :func:`start_rl_workers`."""

    cluster: RayVirtualCluster
    policy: Policy
    """The trained policy."""
    scorers: list[Policy]
    """The frozen scoring policies, in the order of :func:`start_rl_workers`'s ``scorers``."""
    generation: GenerationInterface
    """The trained policy's generation workers."""
    refitter: Refitter
    """Moves the policy's weights into ``generation`` (scope, transport, offloads, staleness)."""
    task_to_env: dict[str, Any]
    """Environment actor per task for training rollouts."""
    val_task_to_env: dict[str, Any]
    """Environment actor per task for validation rollouts (the training ones unless given separately)."""
    owned_envs: list[Any]
    """Environment actors the start-up started (and ``shutdown_workers`` stops); those passed in stay the
    caller's."""

    def worker_fields(self) -> dict[str, Any]:
        """This object's fields by name, to build a loop's setup dataclass (a subclass) from it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RLWorkers)}

    def shutdown_workers(self) -> None:
        """Stop the workers and the environments the start-up started, release the placement groups."""
        self.generation.shutdown()
        for scorer in self.scorers:
            scorer.shutdown()
        self.policy.shutdown()
        self.refitter.shutdown()
        stop_envs(self.owned_envs, ENV_TIMEOUT_S)
        self.cluster.shutdown()


def _refits_in_flight(config: RLConfig) -> bool:
    """Whether the generation workers take refits while they generate (asynchronous GRPO's
    ``in_flight_weight_updates``)."""
    return isinstance(config, GRPOMasterConfig) and (
        config.grpo.async_grpo.enabled and config.grpo.async_grpo.in_flight_weight_updates
    )


def _start_policies(
    cluster: RayVirtualCluster,
    config: RLConfig,
    tokenizer: PreTrainedTokenizerBase,
    resume: Resume,
    *,
    seed: int,
    init_reference_model: bool,
    scorers: Sequence[ScoringPolicy],
) -> tuple[Policy, list[Policy], GenerationInterface]:
    """Start the policy, the scoring policies and the generation backend (step 3 of the module docstring)."""
    policy_bundles, generation_bundles = placement(config.policy, config.cluster)

    def start_policies() -> tuple[Policy, list[Policy]]:
        policy = start_policy(
            cluster,
            config.policy,
            resume,
            init_reference_model=init_reference_model,
            bundle_indices=policy_bundles,
        )
        started_scorers = [
            Policy(
                cluster,
                scorer.cfg,
                name_prefix=scorer.name_prefix,
                bundle_indices=policy_bundles,
                init_reference_model=False,
            )
            for scorer in scorers
        ]
        return policy, started_scorers

    return start_policy_and_generation(
        cluster,
        config.policy,
        tokenizer,
        start_policies,
        seed=seed,
        bundle_indices=generation_bundles,
        concurrent_refit=_refits_in_flight(config),
    )


def start_rl_workers(
    config: RLConfig,
    tokenizer: PreTrainedTokenizerBase,
    checkpointer: CheckpointManager,
    resume: Resume,
    *,
    name: str,
    seed: int,
    envs_to_start: set[str],
    task_to_env: Mapping[str, Any] | None,
    val_task_to_env: Mapping[str, Any] | None,
    init_reference_model: bool = False,
    scorers: Sequence[ScoringPolicy] = (),
) -> RLWorkers:
    """Start the workers of an RL run as the module docstring says, restoring ``resume``'s checkpoint.

    ``envs_to_start`` (see :func:`tasks_to_start`) are the tasks whose environments are started here;
    ``task_to_env`` / ``val_task_to_env`` are the caller's environments, ``None`` for those started here
    (validation defaults to the training ones).
    """
    # The trained policy, its generation workers and each scoring policy share a slot and take turns on it.
    cluster = start_cluster(config, name, max_colocated_worker_groups=2 + len(scorers))
    started: dict[str, Any] = {}
    try:
        started = create_task_envs(envs_to_start, config.env)
        policy, started_scorers, generation = _start_policies(
            cluster,
            config,
            tokenizer,
            resume,
            seed=seed,
            init_reference_model=init_reference_model,
            scorers=scorers,
        )
        wait_envs_started(started.values(), ENV_TIMEOUT_S)
    except BaseException:
        stop_envs(started.values(), ENV_TIMEOUT_S)
        raise
    # The per-call sampling seeds continue where the checkpoint left them.
    checkpointer.track("generation", generation)
    for scorer in started_scorers:
        scorer.offload_after_refit()
    task_to_env = started if task_to_env is None else task_to_env
    val_task_to_env = task_to_env if val_task_to_env is None else val_task_to_env
    return RLWorkers(
        refitter=Refitter.create(config.policy, policy, generation),
        cluster=cluster,
        policy=policy,
        scorers=started_scorers,
        generation=generation,
        task_to_env=dict(task_to_env),
        val_task_to_env=dict(val_task_to_env),
        owned_envs=list(started.values()),
    )


@dataclasses.dataclass
class RLState:
    """What a checkpoint records about an RL loop's progress."""

    step: int = 0
    """Steps taken."""

    total_valid_tokens: float = 0.0
    """Tokens trained on so far."""

    val_accuracy: float | None = None
    """Latest validation accuracy."""


@dataclasses.dataclass(kw_only=True)
class RLRun(RLWorkers):
    """The workers of an RL run and what its loop needs besides them; each loop's setup dataclass adds its
    loss function and narrows ``config``."""

    config: RLConfig
    tokenizer: PreTrainedTokenizerBase
    train_loader: Loader
    val_dataset: ProcessedDataset | None
    logger: Logger
    checkpointer: CheckpointManager
    state: RLState
    task_to_tools: dict[str, TaskTools]
    """The tools of each task whose ``env.<task>.tools`` is not empty; its rollouts run their calls."""

    def refit(self) -> dict[str, float]:
        """Copy the policy's current weights into the generation workers; returns the ``refit/*`` metrics."""
        return self.refitter.refit()

    def refit_if_stale(self, timer: Timer) -> None:
        """Before sampling: refit the generation workers when the policy trained since they were last
        updated (its ``refit/*`` metrics are logged at the coming step), then wake them."""
        if self.refitter.stale:
            with timer.time("refit"):
                refit_metrics = self.refit()
            self.logger.log_metrics(refit_metrics, self.state.step + 1)
        self.generation.prepare_for_generation()

    def sample(
        self,
        batch: BatchedDataDict[Any],
        loop_cfg: GRPOConfig | DistillationConfig,
        timer: Timer,
        generation: GenerationInterface | None = None,
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """Roll out ``loop_cfg.num_generations_per_prompt`` responses per prompt of ``batch`` on ``generation``
        (default: the run's generation workers) with the run's environments and tools; returns the rolled-out
        batch and its rollout metrics (see :func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout`)."""
        return run_multi_turn_rollout(
            self.generation if generation is None else generation,
            batch.repeat_interleave(loop_cfg.num_generations_per_prompt),
            self.tokenizer,
            self.task_to_env,
            max_seq_len=self.config.policy.max_total_sequence_length,
            max_rollout_turns=loop_cfg.max_rollout_turns,
            timer=timer,
            task_to_tools=self.task_to_tools,
        )

    def validate_accuracy(
        self, step: int, loop_cfg: GRPOConfig | DistillationConfig, *, greedy: bool
    ) -> dict[str, float]:
        """Sampled accuracy on up to ``loop_cfg.max_val_samples`` held-out prompts (one response each),
        logged at ``step`` with the samples, and kept in ``state.val_accuracy``."""
        if self.val_dataset is None or len(self.val_dataset) == 0:
            return {}
        if self.refitter.stale:
            self.refit()
        metrics, samples = validation_rollouts(
            self.generation,
            self.val_dataset,
            self.tokenizer,
            self.val_task_to_env,
            max_val_samples=loop_cfg.max_val_samples,
            val_batch_size=loop_cfg.val_batch_size,
            max_seq_len=self.config.policy.max_total_sequence_length,
            max_rollout_turns=loop_cfg.max_rollout_turns,
            greedy=greedy,
            task_to_tools=self.task_to_tools,
        )
        self.logger.print_samples(samples, step)
        self.logger.log_metrics(metrics, step, prefix="validation")
        self.state.val_accuracy = metrics["accuracy"]
        return metrics

    def run_fields(self) -> dict[str, Any]:
        """This object's fields by name, to build a loop's setup dataclass (a subclass) from it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RLRun)}

    def save_checkpoint(self, loader_position: SupportsStateDict | None = None) -> Path:
        """Write the policy (weights, optimizer, scheduler), the loader position (``loader_position``'s state
        when given) and the loop state."""
        return save_run_checkpoint(self, self.state.val_accuracy, loader_position)

    def shutdown(self) -> None:
        """Stop the workers and the environments ``setup`` started, flush the loggers, release the placement
        groups. Environments passed to ``setup`` in ``task_to_env`` / ``val_task_to_env`` are left running."""
        self.logger.close()
        self.shutdown_workers()


@dataclasses.dataclass(frozen=True)
class RLLoop:
    """What an RL loop tells the shared start-up about itself."""

    state_cls: type[RLState]
    """The loop's checkpointed progress (a subclass of :class:`RLState`)."""

    name: str
    """Labels the cluster, the run and the workers in messages; lower-cased, it is the loop's config section."""

    seed: int
    """Seeds the prompt loader's shuffle and the workers."""

    prompts_per_batch: int
    """Prompts per batch of the training loader."""

    @property
    def prompts_per_batch_key(self) -> str:
        """The key that sets ``prompts_per_batch`` (in the loop's config section, ``name`` lower-cased), named
        in the error for data smaller than one batch."""
        return f"{self.name.lower()}.num_prompts_per_step"


def start_rl_run(
    config: RLConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
    loop: RLLoop,
    *,
    task_to_env: Mapping[str, Any] | None = None,
    val_task_to_env: Mapping[str, Any] | None = None,
    init_reference_model: bool = False,
    scorers: Sequence[ScoringPolicy] = (),
) -> RLRun:
    """Check the inputs (environments for every task of the data, see :func:`tasks_to_start`, and
    :func:`open_run`'s checks), find the checkpoint to resume, build the prompt loader, start the workers
    (:func:`start_rl_workers`) and the logger. Runs rank checkpoints by validation accuracy."""
    envs_to_start = tasks_to_start(
        config.env,
        dataset_task_names(train_dataset),
        dataset_task_names(val_dataset),
        task_to_env,
        val_task_to_env,
    )
    task_to_tools = build_task_tools(config.env)  # an unknown tool fails here, before anything starts
    run = open_run(
        config,
        loop.state_cls,
        run_name=loop.name,
        metric_names={"val_accuracy", "validation/accuracy", "val:accuracy"},
        policy_world_size=len(placement(config.policy, config.cluster)[0]),
    )
    train_loader = make_train_loader(
        train_dataset,
        run.resume,
        batch_size=loop.prompts_per_batch,
        batch_size_key=loop.prompts_per_batch_key,
        shuffle=config.data.shuffle,
        seed=loop.seed,
        collate_fn=rl_collate_fn,
    )
    workers = start_rl_workers(
        config,
        tokenizer,
        run.checkpointer,
        run.resume,
        name=loop.name.lower(),
        seed=loop.seed,
        envs_to_start=envs_to_start,
        task_to_env=task_to_env,
        val_task_to_env=val_task_to_env,
        init_reference_model=init_reference_model,
        scorers=scorers,
    )
    return RLRun(
        **workers.worker_fields(),
        config=config,
        tokenizer=tokenizer,
        train_loader=train_loader,
        val_dataset=val_dataset,
        logger=start_logger(config),
        checkpointer=run.checkpointer,
        state=run.state,
        task_to_tools=task_to_tools,
    )
