"""The opening every training loop's ``setup`` shares: checks, checkpoints and resume, loaders, Ray and the
cluster, the policy, the logger and the saved config.

A loop's ``setup`` reads as its own story with these steps::

    run = open_run(config, SFTState, run_name="SFT", metric_names={"val_loss"}, policy_world_size=2)
    train_loader = make_train_loader(train_dataset, run.resume, batch_size=..., shuffle=..., seed=..., collate_fn=...)
    cluster = start_cluster(config, "sft")
    policy = start_policy(cluster, config.policy, run.resume)
    logger = start_logger(config)

Every input check runs before Ray starts, so a mistake ends the driver within seconds, before any worker
process exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any, Generic, TypeVar

from nemo_rl.algorithms.loop import Resume, check_run_setup, find_resume
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
    shuffle: bool,
    seed: int,
    collate_fn: Collate,
) -> Loader:
    """The training loader (whole batches only), put where the resumed checkpoint left it."""
    loader: Loader = StatefulDataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=True, collate_fn=collate_fn
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
) -> Policy:
    """The trained policy on every slot of ``cluster``, with the resumed checkpoint's weights and optimizer."""
    return Policy(
        cluster,
        policy_cfg,
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
