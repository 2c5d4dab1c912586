"""The opening every training loop's ``setup`` shares: checks, checkpoints and resume, loaders, Ray and the
cluster, the policy, the logger and the saved config.

A loop's ``setup`` reads as its own story with these steps::

    run = open_run(config, SFTState, run_name="SFT", metric_names={"val_loss"}, policy_world_size=2)
    train_loader = make_train_loader(train_dataset, run.resume, batch_size=..., batch_size_key=..., ...)
    cluster = start_cluster(config, "sft")
    policy = start_policy(cluster, config.policy, run.resume)
    logger = start_logger(config)

Every input check runs before Ray starts, so a mistake ends the driver within seconds, before any worker
process exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.loop import (
    LoopState,
    Resume,
    SupportsStateDict,
    TrainLoop,
    check_run_setup,
    find_resume,
    save_training_checkpoint,
    step_budget,
)
from nemo_rl.config.algorithms import DistillationConfig, DPOConfig, GRPOConfig, RMConfig, SFTConfig
from nemo_rl.config.loader import save_config
from nemo_rl.config.master import (
    DistillationMasterConfig,
    GRPOMasterConfig,
    PreferenceMasterConfig,
    SFTMasterConfig,
)
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.dataloader import StatefulDataLoader
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster, init_ray
from nemo_rl.models.policy.interfaces import PolicyInterface
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.utils.checkpoint import CheckpointManager
from nemo_rl.utils.logger import Logger

S = TypeVar("S")

TrainingConfig = SFTMasterConfig | GRPOMasterConfig | DistillationMasterConfig | PreferenceMasterConfig
"""The master configs of the training loops (each has ``policy``, ``checkpointing``, ``logger``, ``cluster``)."""

Loader = StatefulDataLoader[Any, BatchedDataDict[Any]]
Collate = Callable[[list[Any]], BatchedDataDict[Any]]


@dataclasses.dataclass
class RunOpening(Generic[S]):
    """What :func:`open_run` gives a loop's setup: where checkpoints go and what the run continues from."""

    checkpointer: CheckpointManager
    resume: Resume
    """The latest complete checkpoint, or a fresh start."""
    state: S
    """The loop's state, read back from that checkpoint (fresh on a fresh start)."""


def open_run(
    config: TrainingConfig,
    state_cls: type[S],
    *,
    run_name: str,
    metric_names: Collection[str],
    policy_world_size: int,
) -> RunOpening[S]:
    """Check the run's inputs (see :func:`check_run_setup`), then find the checkpoint it resumes from and read
    its loop state as ``state_cls``. Starts nothing: it runs before Ray."""
    check_run_setup(
        config.policy,
        config.checkpointing,
        config.logger.log_dir,
        policy_world_size=policy_world_size,
        run_name=run_name,
        metric_names=metric_names,
    )
    checkpointer = CheckpointManager(config.checkpointing)
    resume = find_resume(checkpointer, run_name, config)
    return RunOpening(checkpointer=checkpointer, resume=resume, state=resume.state(state_cls))


def make_train_loader(
    dataset: ProcessedDataset,
    resume: Resume,
    *,
    batch_size: int,
    batch_size_key: str,
    shuffle: bool,
    seed: int,
    collate_fn: Collate,
    groups: Sequence[Sequence[int]] | None = None,
) -> Loader:
    """The training loader (whole batches only), put where the resumed checkpoint left it; ``batch_size_key``
    names the key that sets ``batch_size`` in the error for data smaller than one batch, and ``groups``
    are samples served together (see :class:`StatefulDataLoader`)."""
    loader: Loader = StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=True,
        collate_fn=collate_fn,
        batch_size_key=batch_size_key,
        groups=groups,
        # Custom datasets (the sliding-puzzle script's generator) come without a source to name.
        data_name=(
            f"the training data ({dataset.source})"
            if isinstance(dataset, ProcessedDataset)
            else "the training data"
        ),
    )
    resume.restore_loader(loader)
    return loader


def make_val_loader(
    dataset: ProcessedDataset | None, *, batch_size: int, seed: int, collate_fn: Collate
) -> Loader | None:
    """The validation loader, in order and keeping the last short batch; ``None`` without validation data."""
    if dataset is None or len(dataset) == 0:
        return None
    return StatefulDataLoader(
        dataset, batch_size=batch_size, shuffle=False, seed=seed, drop_last=False, collate_fn=collate_fn
    )


def start_cluster(
    config: TrainingConfig, name: str, *, max_colocated_worker_groups: int | None = None
) -> RayVirtualCluster:
    """Start (or attach to) Ray and reserve the run's worker slots; ``max_colocated_worker_groups`` is how
    many worker groups share a slot (``None``: the cluster's own default)."""
    init_ray(config.cluster)
    if max_colocated_worker_groups is None:
        return RayVirtualCluster(config.cluster, name=name)
    return RayVirtualCluster(
        config.cluster, name=name, max_colocated_worker_groups=max_colocated_worker_groups
    )


def start_policy(
    cluster: RayVirtualCluster,
    policy_cfg: PolicyConfig,
    resume: Resume,
    *,
    init_reference_model: bool = False,
    bundle_indices: Sequence[int] | None = None,
) -> Policy:
    """The trained policy on ``bundle_indices`` of ``cluster`` (all of its slots when ``None``), with the
    resumed checkpoint's weights and optimizer."""
    return Policy(
        cluster,
        policy_cfg,
        bundle_indices=bundle_indices,
        init_reference_model=init_reference_model,
        weights_path=resume.weights_path,
        optimizer_path=resume.optimizer_path,
    )


def start_logger(config: TrainingConfig) -> Logger:
    """The run's logger, with the config logged as hyperparameters and saved next to the logs."""
    logger = Logger(config.logger)
    logger.log_hyperparams(config.model_dump(mode="json"))
    save_config(config, config.logger.log_dir)
    return logger


@dataclasses.dataclass
class SupervisedState:
    """What a checkpoint records about the progress of a loop trained on a fixed data set (SFT, DPO, RM)."""

    step: int = 0
    """Optimizer steps taken."""

    epoch: int = 0
    """Epochs begun."""

    val_loss: float | None = None
    """Latest validation loss (what ``checkpointing.metric_name: val_loss`` ranks checkpoints by)."""


class TrainingRun(Protocol):
    """What :func:`save_run_checkpoint` and :func:`make_train_loop` read of a loop's setup (the loops'
    setup dataclasses have these fields; those whose type each loop narrows are read-only here)."""

    checkpointer: CheckpointManager
    logger: Logger
    train_loader: Loader

    @property
    def config(self) -> BaseModel: ...
    @property
    def state(self) -> LoopState: ...
    @property
    def policy(self) -> PolicyInterface: ...


def save_run_checkpoint(
    run: TrainingRun, metric_value: float | None, loader_position: SupportsStateDict | None = None
) -> Path:
    """Write the run's policy (weights, optimizer, scheduler), loader position and loop state as ``step_<N>``
    (atomically), ranked by ``metric_value``; see :func:`save_training_checkpoint`. ``loader_position``
    replaces the training loader's own state (asynchronous GRPO's loader reads ahead of training)."""
    return save_training_checkpoint(
        run.checkpointer,
        state=run.state,
        run_config=run.config,
        policy=run.policy,
        train_loader=run.train_loader if loader_position is None else loader_position,
        metric_value=metric_value,
    )


@dataclasses.dataclass(kw_only=True)
class SupervisedRun:
    """A started loop on a fixed data set (SFT, DPO, RM): the policy on every slot, the loaders, the logger and
    the checkpoints; each loop's setup dataclass adds its config and loss function."""

    tokenizer: PreTrainedTokenizerBase
    cluster: RayVirtualCluster
    policy: Policy
    train_loader: Loader
    val_loader: Loader | None
    logger: Logger
    checkpointer: CheckpointManager
    state: SupervisedState

    def run_fields(self) -> dict[str, Any]:
        """This object's fields by name, to build a loop's setup dataclass (a subclass) from it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SupervisedRun)}

    def shutdown(self) -> None:
        """Stop the policy workers, flush the loggers, release the placement groups."""
        self.logger.close()
        self.policy.shutdown()
        self.cluster.shutdown()


def start_supervised_run(
    config: TrainingConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
    state_cls: type[SupervisedState],
    *,
    name: str,
    metric_names: Collection[str],
    seed: int,
    val_batch_size: int,
    collate_fn: Collate,
    init_reference_model: bool = False,
    train_groups: Sequence[Sequence[int]] | None = None,
) -> SupervisedRun:
    """Check the inputs, find the checkpoint to resume, build the loaders (``policy.train_global_batch_size``
    rows per training batch), then start Ray and the policy on every slot; ``name`` labels the cluster and,
    upper-cased, the run in messages; ``train_groups`` are samples the training loader serves together."""
    run = open_run(
        config,
        state_cls,
        run_name=name.upper(),
        metric_names=metric_names,
        policy_world_size=config.cluster.gpus_per_node * config.cluster.num_nodes,
    )
    train_loader = make_train_loader(
        train_dataset,
        run.resume,
        batch_size=config.policy.train_global_batch_size,
        batch_size_key="policy.train_global_batch_size",
        shuffle=config.data.shuffle,
        seed=seed,
        collate_fn=collate_fn,
        groups=train_groups,
    )
    val_loader = make_val_loader(val_dataset, batch_size=val_batch_size, seed=seed, collate_fn=collate_fn)
    cluster = start_cluster(config, name)
    return SupervisedRun(
        tokenizer=tokenizer,
        cluster=cluster,
        policy=start_policy(cluster, config.policy, run.resume, init_reference_model=init_reference_model),
        train_loader=train_loader,
        val_loader=val_loader,
        logger=start_logger(config),
        checkpointer=run.checkpointer,
        state=run.state,
    )


LoopConfig = SFTConfig | GRPOConfig | DistillationConfig | DPOConfig | RMConfig
"""A loop's own config section: its step budget (``max_num_steps``, ``max_num_epochs``) and when it
validates (``val_period``, ``val_at_start``, ``val_at_end``)."""


def make_train_loop(
    name: str,
    run: TrainingRun,
    loop_cfg: LoopConfig,
    *,
    save_checkpoint: Callable[[], object],
    validate: Callable[[int], object],
    loader: Iterable[BatchedDataDict[Any]] | None = None,
    total_steps: int | None = None,
) -> TrainLoop[BatchedDataDict[Any]]:
    """The :class:`TrainLoop` of a run over ``loader`` (the run's training loader unless given), to
    ``total_steps`` (by default the step budget of ``loop_cfg``: its steps, or its epochs of the training
    loader if fewer), validating as ``loop_cfg`` says."""
    if total_steps is None:
        total_steps = step_budget(loop_cfg.max_num_steps, loop_cfg.max_num_epochs, len(run.train_loader))
    return TrainLoop(
        name,
        loader=run.train_loader if loader is None else loader,
        state=run.state,
        total_steps=total_steps,
        logger=run.logger,
        checkpointer=run.checkpointer,
        save_checkpoint=save_checkpoint,
        validate=validate,
        val_period=loop_cfg.val_period,
        val_at_start=loop_cfg.val_at_start,
        val_at_end=loop_cfg.val_at_end,
    )
