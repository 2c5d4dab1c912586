"""One training run: the object every algorithm's loop calls.

A :class:`Run` owns everything a training loop touches besides its own step: the cluster, the trained policy
and any further policies (distillation's frozen teacher, a trained critic), for the loops that sample the generation workers with their
environments, tools and weights (:class:`Sampling`), the checkpoint manager, the logger, the loaders and the
loop state. :func:`nemo_rl.algorithms.run_build.build_run` builds it from the typed config and the runtime
objects; an algorithm file holds only its setup call, its step and its loss wiring::

    run = build_run(config, tokenizer, train_dataset, val_dataset, RunSpec(...))   # setup
    loop = run.train_loop("sft", config.sft, validate=lambda step: validate(run, step))
    for batch in loop:                                                                # the loop
        with loop.timer.time("policy_training"):
            result = run.policy.train(batch, loss_fn)
        loop.end_step(train_metrics(result))

An RL step calls the run in order: :meth:`Run.refit_if_stale`, :meth:`Run.sample`, then the policy, and after
training :meth:`Run.mark_trained`; the loop validates with :meth:`Run.validate_by_sampling` and saves with
:meth:`Run.save_checkpoint`. Nothing here calls back into an algorithm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.generation_weights import GenerationWeights
from nemo_rl.algorithms.loop import (
    LoopState,
    SupportsStateDict,
    TrainLoop,
    save_training_checkpoint,
    step_budget,
)
from nemo_rl.config.agent import AgentConfig
from nemo_rl.config.algorithms import LoopConfig as LoopConfigBase
from nemo_rl.config.algorithms import RolloutLoopConfig
from nemo_rl.config.master import (
    DistillationMasterConfig,
    GRPOMasterConfig,
    PPOMasterConfig,
    PreferenceMasterConfig,
    SFTMasterConfig,
)
from nemo_rl.data.collate_fn import repeat_prompts
from nemo_rl.data.dataloader import StatefulDataLoader
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.single_process import LocalCluster
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.environments.registry import stop_envs
from nemo_rl.environments.tools import TaskTools
from nemo_rl.experience.agent_endpoint import AgentEndpoint
from nemo_rl.experience.agent_rollouts import run_agent_rollout
from nemo_rl.experience.async_rollouts import RollOut
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.experience.validation import ENV_TIMEOUT_S, request_environment_metrics, validation_rollouts
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.utils.checkpoint import CheckpointManager
from nemo_rl.utils.logger import Logger
from nemo_rl.utils.timer import Timer

TrainingConfig = (
    SFTMasterConfig | GRPOMasterConfig | DistillationMasterConfig | PreferenceMasterConfig | PPOMasterConfig
)
"""The master configs of the training loops (each has ``policy``, ``checkpointing``, ``logger``, ``cluster``)."""

LoopConfig = LoopConfigBase
"""A loop's own config section: its step budget (``max_num_steps``, ``max_num_epochs``) and when it
validates (``val_period``, ``val_at_start``, ``val_at_end``)."""

SamplingLoopConfig = RolloutLoopConfig
"""The section of a loop that samples: responses per prompt, rollout turns, validation sample counts."""

Loader = StatefulDataLoader[Any, BatchedDataDict[Any]]
EnvMetrics = Callable[[], dict[str, float]]
"""Waits for the environments' own metrics of a rollout (requested when it was scored)."""

C = TypeVar("C", bound=TrainingConfig)
S = TypeVar("S", bound="RunState")


class RunState(LoopState, Protocol):
    """What a run's loop state gives besides its step count: the value that ranks its checkpoints."""

    @property
    def checkpoint_metric(self) -> float | None:
        """Recorded under ``checkpointing.metric_name`` (see :func:`~nemo_rl.algorithms.loop.training_info`)."""


@dataclasses.dataclass
class SupervisedState:
    """What a checkpoint records about the progress of a loop trained on a fixed data set (SFT, DPO, RM): the
    optimizer steps taken, the epochs begun, and the latest validation loss (what
    ``checkpointing.metric_name: val_loss`` ranks checkpoints by)."""

    step: int = 0
    epoch: int = 0
    val_loss: float | None = None

    @property
    def checkpoint_metric(self) -> float | None:
        """The validation loss."""
        return self.val_loss


@dataclasses.dataclass
class RLState:
    """What a checkpoint records about an RL loop's progress: the steps taken, the tokens trained on so far and
    the latest validation accuracy (what ranks its checkpoints)."""

    @property
    def checkpoint_metric(self) -> float | None:
        """The validation accuracy."""
        return self.val_accuracy

    step: int = 0
    total_valid_tokens: float = 0.0
    val_accuracy: float | None = None


@dataclasses.dataclass(kw_only=True, eq=False)
class Sampling:
    """The sampling side of a run: the generation workers, their weights (refit), the environments and tools
    that score and extend the rollouts, and the held-out prompts validation samples."""

    generation: GenerationInterface
    weights: GenerationWeights
    """The generation workers' copy of the policy's weights: every refit goes through it."""
    task_to_env: dict[str, Any]
    """Environment actor per task for training rollouts."""
    val_task_to_env: dict[str, Any]
    """Environment actor per task for validation rollouts (the training ones unless given separately)."""
    owned_envs: list[Any]
    """Environments the run started (and stops); those passed in stay the caller's."""
    task_to_tools: dict[str, TaskTools]
    """The tools of each task whose ``env.<task>.tools`` is not empty; its rollouts run their calls."""
    val_dataset: ProcessedDataset | None
    max_seq_len: int
    """``policy.max_total_sequence_length``: a conversation's token budget."""
    agent: AgentConfig | None = None
    """External agents roll the samples out instead (``grpo.agent``), through ``agent_endpoint``."""
    agent_endpoint: AgentEndpoint | None = None
    """The endpoint external agents roll out through, serving ``generation``."""


@dataclasses.dataclass(kw_only=True, eq=False)
class Run(Generic[C, S]):
    """A started training run (see the module docstring); built by
    :func:`~nemo_rl.algorithms.run_build.build_run`."""

    config: C
    tokenizer: PreTrainedTokenizerBase
    cluster: RayVirtualCluster | LocalCluster
    policy: Policy
    """The trained policy."""
    models: dict[str, Policy]
    """Policies besides the trained one, by name, on its slots: frozen scorers (distillation's ``"teacher"``)
    and further trained models (a critic)."""
    trained_models: tuple[str, ...] = ()
    """The names in ``models`` that train: checkpointed with the run and resumed with it."""
    sampling: Sampling | None
    """Generation, weights and environments; ``None`` for loops on a fixed data set (SFT, DPO, RM)."""
    train_loader: Loader
    val_loader: Loader | None
    """Held-out batches of a loop on a fixed data set (RL loops validate by sampling ``sampling.val_dataset``)."""
    logger: Logger
    checkpointer: CheckpointManager
    state: S

    @property
    def rl(self) -> Sampling:
        """The sampling side (a run built without one has no generation workers to sample)."""
        if self.sampling is None:
            raise RuntimeError("this run was built without generation workers (RunSpec.sampling is None)")
        return self.sampling

    # ------------------------------------------------------------------------------------ the loop
    def step_budget(self, loop_cfg: LoopConfig) -> int:
        """Steps the run takes: ``loop_cfg.max_num_steps``, or fewer when its ``max_num_epochs`` of the
        training loader end first."""
        return step_budget(loop_cfg.max_num_steps, loop_cfg.max_num_epochs, len(self.train_loader))

    def train_loop(
        self,
        name: str,
        loop_cfg: LoopConfig,
        *,
        validate: Callable[[int], object],
        save_checkpoint: Callable[[], object] | None = None,
        loader: Iterable[BatchedDataDict[Any]] | None = None,
        total_steps: int | None = None,
    ) -> TrainLoop[BatchedDataDict[Any]]:
        """The :class:`TrainLoop` over ``loader`` (the training loader unless given), to ``total_steps`` (by
        default ``loop_cfg``'s budget: its steps, or its epochs of the training loader if fewer), validating as
        ``loop_cfg`` says and saving with :meth:`save_checkpoint` unless told otherwise."""
        return TrainLoop(
            name,
            loader=self.train_loader if loader is None else loader,
            state=self.state,
            total_steps=self.step_budget(loop_cfg) if total_steps is None else total_steps,
            logger=self.logger,
            checkpointer=self.checkpointer,
            save_checkpoint=self.save_checkpoint if save_checkpoint is None else save_checkpoint,
            validate=validate,
            val_period=loop_cfg.val_period,
            val_at_start=loop_cfg.val_at_start,
            val_at_end=loop_cfg.val_at_end,
            # Generation workers replaced during the step (its rollout, refit or validation).
            step_events=None if self.sampling is None else self.sampling.generation.take_metrics,
        )

    def save_checkpoint(self, loader_position: SupportsStateDict | None = None) -> Path:
        """Write the policy (weights, optimizer, scheduler), the loader position (``loader_position``'s state when
        given: asynchronous GRPO's loader reads ahead) and the loop state as ``step_<N>``, atomically."""
        return save_training_checkpoint(
            self.checkpointer,
            state=self.state,
            run_config=self.config,
            policy=self.policy,
            train_loader=self.train_loader if loader_position is None else loader_position,
            metric_value=self.state.checkpoint_metric,
            other_policies={name: self.models[name] for name in self.trained_models},
        )

    # ---------------------------------------------------------------------------------- sampling
    def refit(self, version: int | None = None) -> dict[str, float]:
        """Copy the policy's current weights into the generation workers (publishing ``version``); returns the
        ``refit/*`` metrics."""
        return self.rl.weights.refit(version)

    def refit_if_stale(self, timer: Timer) -> None:
        """Before sampling: refit the generation workers when the policy trained since they were last updated
        (its ``refit/*`` metrics are logged at the coming step), then wake them."""
        if self.rl.weights.stale:
            with timer.time("refit"):
                refit_metrics = self.refit()
            self.logger.log_metrics(refit_metrics, self.state.step + 1)
        self.rl.generation.prepare_for_generation()

    def mark_trained(self) -> None:
        """After an optimizer step: the generation workers' weights are stale."""
        self.rl.weights.mark_stale()

    def sample(
        self,
        batch: BatchedDataDict[Any],
        loop_cfg: SamplingLoopConfig,
        timer: Timer,
        generation: GenerationInterface | None = None,
    ) -> tuple[BatchedDataDict[Any], dict[str, float], EnvMetrics]:
        """Roll out ``loop_cfg.num_generations_per_prompt`` responses per prompt of ``batch`` on ``generation``
        (default: the run's generation workers) with the run's environments and tools, or by the external
        agents of ``grpo.agent``; returns the rollout (raw rewards), its metrics, and the wait for the
        environments' own metrics (requested here, computed while the caller goes on)."""
        rl = self.rl
        samples = repeat_prompts(batch, loop_cfg.num_generations_per_prompt)
        if rl.agent_endpoint is not None and rl.agent is not None:
            rollout, metrics = run_agent_rollout(
                rl.agent_endpoint, samples, self.tokenizer, rl.agent, timer=timer
            )
            return rollout, metrics, dict  # the agents' rewards score the samples: no environment step
        rollout, metrics = run_multi_turn_rollout(
            rl.generation if generation is None else generation,
            samples,
            self.tokenizer,
            rl.task_to_env,
            max_seq_len=rl.max_seq_len,
            max_rollout_turns=loop_cfg.max_rollout_turns,
            timer=timer,
            task_to_tools=rl.task_to_tools,
        )
        return rollout, metrics, request_environment_metrics(rl.task_to_env, rollout)

    def sampler(self, loop_cfg: SamplingLoopConfig, timer: Timer) -> RollOut:
        """:meth:`sample` as asynchronous GRPO's rollout thread calls it: on the generation it is given, the
        environments' metrics waited for (the thread has nothing else to do meanwhile)."""

        def roll_out(
            generation: GenerationInterface, batch: BatchedDataDict[Any]
        ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
            rollout, metrics, env_metrics = self.sample(batch, loop_cfg, timer, generation)
            return rollout, {**metrics, **env_metrics()}

        return roll_out

    def validate_by_sampling(
        self, step: int, loop_cfg: SamplingLoopConfig, *, greedy: bool
    ) -> dict[str, float]:
        """Sampled accuracy on up to ``loop_cfg.max_val_samples`` held-out prompts (one response each), logged at
        ``step`` with the samples and kept in ``state.val_accuracy``. It holds the generation workers between
        two calls of a rollout thread, if one runs."""
        rl = self.rl
        if not isinstance(self.state, RLState):
            raise TypeError(f"validation by sampling records an RLState, not {type(self.state).__name__}")
        if rl.val_dataset is None or len(rl.val_dataset) == 0:
            return {}
        if rl.weights.stale:
            rl.weights.refit()
        with rl.weights.exclusive():
            metrics, samples = validation_rollouts(
                rl.generation,
                rl.val_dataset,
                self.tokenizer,
                rl.val_task_to_env,
                max_val_samples=loop_cfg.max_val_samples,
                val_batch_size=loop_cfg.val_batch_size,
                max_seq_len=rl.max_seq_len,
                max_rollout_turns=loop_cfg.max_rollout_turns,
                greedy=greedy,
                task_to_tools=rl.task_to_tools,
            )
        self.logger.print_samples(samples, step)
        self.logger.log_metrics(metrics, step, prefix="validation")
        self.state.val_accuracy = metrics["accuracy"]
        return metrics

    def shutdown(self) -> None:
        """Stop every worker and the environments the run started, flush the loggers, release the placement
        groups. Environments passed in (``task_to_env`` / ``val_task_to_env``) are left running."""
        self.logger.close()
        rl = self.sampling
        if rl is not None:
            if rl.agent_endpoint is not None:
                rl.agent_endpoint.stop()
            rl.generation.shutdown()
        for model in self.models.values():
            model.shutdown()
        self.policy.shutdown()
        if rl is not None:
            rl.weights.shutdown()
            stop_envs(rl.owned_envs, ENV_TIMEOUT_S)
        self.cluster.shutdown()
