"""Building a :class:`~nemo_rl.algorithms.run.Run`: one function, :func:`build_run`, from the typed config, the
runtime objects (tokenizer, datasets, environments) and a :class:`RunSpec` that says what the algorithm needs.

It goes, in this order:

1. the input checks that need no workers (environments for every task of the data, tools, the policy's layout
   and optimizer, the checkpoint metric, writable folders), so a mistake ends the driver before Ray starts;
2. the checkpoint to resume (its loop state) and the loaders, put where that checkpoint left them;
3. Ray and the cluster's slots;
4. for a run that samples: the environment actors of the tasks the caller did not pass in (created first, so
   their imports overlap the workers' start), then the policy, the extra policies and the generation backend
   in the order the backend needs (:func:`~nemo_rl.models.generation.factory.start_policy_and_generation`),
   then it waits for the environments (if anything failed so far, the environments it started are stopped),
   then the :class:`~nemo_rl.weight_sync.refitter.Refitter` (both ends' manifests checked); otherwise the
   policy (and the extra policies) on every slot;
5. the logger, with the config logged and saved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.generation_weights import GenerationWeights, InFlightUpdatable
from nemo_rl.algorithms.loop import Resume, check_run_setup, find_resume
from nemo_rl.algorithms.placement import Placement, placement, single_process_refusal_of
from nemo_rl.algorithms.run import Loader, Run, RunState, Sampling, TrainingConfig
from nemo_rl.config.agent import AgentConfig
from nemo_rl.config.env import EnvConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.loader import save_config
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.collate_fn import rl_collate_fn
from nemo_rl.data.dataloader import StatefulDataLoader
from nemo_rl.data.datasets import ProcessedDataset, dataset_task_names
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.device import cuda_available
from nemo_rl.distributed.ray_start import init_ray
from nemo_rl.distributed.single_process import LocalCluster, runs_in_one_process
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.environments.registry import check_task_envs, create_task_envs, stop_envs, wait_envs_started
from nemo_rl.environments.tools import TaskTools, wire_task_tools
from nemo_rl.experience.agent_rollouts import start_agent_endpoint
from nemo_rl.experience.validation import ENV_TIMEOUT_S
from nemo_rl.models.generation.factory import start_policy_and_generation
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.policy.lm_policy import Policy, check_policy_layout
from nemo_rl.models.policy.optim import check_optimizer_config
from nemo_rl.utils.checkpoint import CheckpointManager
from nemo_rl.utils.logger import Logger
from nemo_rl.weight_sync.refitter import Refitter

C = TypeVar("C", bound=TrainingConfig)
S = TypeVar("S", bound=RunState)

Collate = Callable[[list[Any]], BatchedDataDict[Any]]


@dataclasses.dataclass(frozen=True)
class ExtraPolicy:
    """A policy started with the run's policy, on its slots: frozen, it only scores (distillation's teacher)
    and keeps its weights off the device except while scoring; trained (a critic), it is checkpointed with the
    run and resumed from its checkpoint."""

    cfg: PolicyConfig
    name: str
    """Its key in ``Run.models`` and its folder in a checkpoint; also names its worker actors."""
    trained: bool = False
    warm_start: str | None = None
    """A trained policy's weights (a ``<step>/<name>/weights`` folder of another run) that a fresh run starts
    from instead of ``cfg.model_name``; a resumed run restores its own checkpoint and ignores this."""
    own_slots_per_node: int = 0
    """Worker slots of its own on each node (see :mod:`nemo_rl.algorithms.placement`); 0 shares the
    policy's slots and takes turns on them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """What a run that samples needs besides the policy: environments, and how its generation is used."""

    env: EnvConfig
    """The ``env`` section: the environments started for the data's tasks, and their tools."""
    task_to_env: Mapping[str, Any] | None = None
    """The caller's environment actor per task of the training data; ``None``: started from ``env``."""
    val_task_to_env: Mapping[str, Any] | None = None
    """The same for validation; ``None``: ``task_to_env``'s (or started from ``env``)."""
    concurrent_refit: bool = False
    """The generation workers take refits while they generate (asynchronous GRPO's in-flight updates)."""
    agent: AgentConfig | None = None
    """External agents roll the samples out through an endpoint serving the generation workers."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec(Generic[S]):
    """What an algorithm asks of :func:`build_run`."""

    name: str
    """Names the run in messages ("Resuming GRPO from ..."); lower-cased, the cluster."""
    state_cls: type[S]
    """The loop's checkpointed progress."""
    metric_names: Collection[str]
    """What ``checkpointing.metric_name`` may be (what the loop records)."""
    seed: int
    """Seeds the loaders' shuffle (and the generation workers' sampling)."""
    batch_size: int
    """Samples (prompts, conversations, pairs) per batch of the training loader."""
    batch_size_key: str
    """The key that sets ``batch_size``, named in the error for data smaller than one batch."""
    collate_fn: Collate
    train_groups: Sequence[Sequence[int]] | None = None
    """Samples the training loader serves together (see :class:`StatefulDataLoader`)."""
    val_batch_size: int | None = None
    """Batches of a validation loader over ``val_dataset`` (loops on a fixed data set); ``None``: no loader."""
    keep_reference_model: bool = False
    """The policy keeps its initial weights for reference log-probabilities."""
    models: Sequence[ExtraPolicy] = ()
    """Policies besides the trained one (a frozen teacher, a trained critic)."""
    sampling: SamplingSpec | None = None
    """Generation workers, environments and refit; ``None`` for a loop on a fixed data set."""

    @classmethod
    def sampling_loop(
        cls,
        name: str,
        state_cls: type[S],
        sampling: SamplingSpec,
        *,
        section: str,
        seed: int,
        num_prompts: int,
        keep_reference_model: bool = False,
        models: Sequence[ExtraPolicy] = (),
    ) -> RunSpec[S]:
        """The spec of a loop that samples (GRPO, distillation): prompt batches of ``num_prompts``, set by
        ``<section>.num_prompts_per_step``; checkpoints ranked by validation accuracy."""
        return cls(
            name=name,
            state_cls=state_cls,
            metric_names={"val_accuracy", "validation/accuracy", "val:accuracy"},
            seed=seed,
            batch_size=num_prompts,
            batch_size_key=f"{section}.num_prompts_per_step",
            collate_fn=rl_collate_fn,
            keep_reference_model=keep_reference_model,
            models=models,
            sampling=sampling,
        )


def tasks_to_start(
    spec: SamplingSpec, train_dataset: ProcessedDataset, val_dataset: ProcessedDataset | None
) -> set[str]:
    """The tasks :func:`build_run` starts environments for (those not passed in); fails before anything starts
    when a task of the data would have no environment."""
    to_start: set[str] = set()
    val_given = spec.val_task_to_env if spec.val_task_to_env is not None else spec.task_to_env
    for name, dataset, given in (
        ("train_dataset", train_dataset, spec.task_to_env),
        ("val_dataset", val_dataset, val_given),
    ):
        tasks = dataset_task_names(dataset)
        if given is None:
            to_start |= tasks
        elif tasks - given.keys():
            raise UserError(
                f"{name} has samples of task {sorted(tasks - given.keys())[0]!r}, which the environments passed "
                f"to setup do not cover (they cover {sorted(given)}); add an environment for it"
            )
    check_task_envs(to_start, spec.env)
    return to_start


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


def start_logger(config: TrainingConfig) -> Logger:
    """The run's logger, with the config logged as hyperparameters and saved next to the logs."""
    logger = Logger(config.logger)
    logger.log_hyperparams(config.model_dump(mode="json"))
    save_config(config, config.logger.log_dir)
    return logger


@dataclasses.dataclass(frozen=True)
class _SamplingChecks:
    """What the checks before Ray found for a run that samples."""

    envs_to_start: set[str]
    """The tasks whose environments the run starts (see :func:`tasks_to_start`)."""
    task_to_tools: dict[str, TaskTools]


@dataclasses.dataclass
class _Workers:
    policy: Policy
    models: dict[str, Policy]
    sampling: Sampling | None


def _start_policies(
    cluster: RayVirtualCluster | LocalCluster,
    config: TrainingConfig,
    spec: RunSpec[Any],
    resume: Resume,
    slots: Placement | None,
) -> tuple[Policy, list[Policy]]:
    """The trained policy and the extra policies (the trained ones with the resumed checkpoint's weights and
    optimizer), on their ``slots`` (every slot when ``None``)."""
    bundles = None if slots is None else slots.policy
    policy = Policy(
        cluster,
        config.policy,
        bundle_indices=bundles,
        init_reference_model=spec.keep_reference_model,
        weights_path=resume.weights_path,
        optimizer_path=resume.optimizer_path,
    )
    models = []
    for extra in spec.models:
        weights_path, optimizer_path = resume.policy_paths(extra.name) if extra.trained else (None, None)
        if weights_path is None and extra.warm_start is not None:
            weights_path = extra.warm_start
        models.append(
            Policy(
                cluster,
                extra.cfg,
                name_prefix=extra.name,
                bundle_indices=None if slots is None else slots.of_extra(extra.name),
                init_reference_model=False,
                weights_path=weights_path,
                optimizer_path=optimizer_path,
            )
        )
    return policy, models


def _start_sampling_workers(
    cluster: RayVirtualCluster | LocalCluster,
    config: TrainingConfig,
    tokenizer: PreTrainedTokenizerBase,
    spec: RunSpec[Any],
    sampling: SamplingSpec,
    resume: Resume,
    envs_to_start: set[str],
) -> tuple[Policy, list[Policy], GenerationInterface, dict[str, Any]]:
    """Step 4 of the module docstring for a run that samples: environments, then the workers."""
    slots = _placement(config, spec, samples=True)
    started: dict[str, Any] = {}
    try:
        # In one process there is no actor to start: every environment is built here.
        in_driver = True if isinstance(cluster, LocalCluster) else None
        started = create_task_envs(envs_to_start, sampling.env, in_driver=in_driver)
        policy, models, generation = start_policy_and_generation(
            cluster,
            config.policy,
            tokenizer,
            lambda: _start_policies(cluster, config, spec, resume, slots),
            seed=spec.seed,
            bundle_indices=slots.generation,
            concurrent_refit=sampling.concurrent_refit,
        )
        wait_envs_started(started.values(), ENV_TIMEOUT_S)
    except BaseException:
        stop_envs(started.values(), ENV_TIMEOUT_S)
        raise
    for extra, model in zip(spec.models, models, strict=True):
        if not extra.trained:
            model.offload_after_refit()
    return policy, models, generation, started


def _start_workers(
    cluster: RayVirtualCluster | LocalCluster,
    config: TrainingConfig,
    tokenizer: PreTrainedTokenizerBase,
    spec: RunSpec[Any],
    resume: Resume,
    checkpointer: CheckpointManager,
    val_dataset: ProcessedDataset | None,
    checks: _SamplingChecks | None,
) -> _Workers:
    """Step 4 of the module docstring."""
    sampling = spec.sampling
    if sampling is None or checks is None:
        policy, models = _start_policies(cluster, config, spec, resume, None)
        return _Workers(policy, {s.name: p for s, p in zip(spec.models, models, strict=True)}, None)
    policy, models, generation, started = _start_sampling_workers(
        cluster, config, tokenizer, spec, sampling, resume, checks.envs_to_start
    )
    # The per-call sampling seeds continue where the checkpoint left them.
    checkpointer.track("generation", generation)
    # Only backends that take refits while they generate are started with concurrent_refit.
    in_flight = cast(InFlightUpdatable, generation) if sampling.concurrent_refit else None
    task_to_env = dict(started if sampling.task_to_env is None else sampling.task_to_env)
    run_sampling = Sampling(
        generation=generation,
        weights=GenerationWeights(Refitter.create(config.policy, policy, generation), in_flight),
        task_to_env=task_to_env,
        val_task_to_env=dict(task_to_env if sampling.val_task_to_env is None else sampling.val_task_to_env),
        owned_envs=list(started.values()),
        task_to_tools=checks.task_to_tools,
        val_dataset=val_dataset,
        max_seq_len=config.policy.max_total_sequence_length,
        agent=sampling.agent,
    )
    return _Workers(policy, {s.name: p for s, p in zip(spec.models, models, strict=True)}, run_sampling)


def _placement(config: TrainingConfig, spec: RunSpec[Any], *, samples: bool) -> Placement:
    own = {extra.name: extra.own_slots_per_node for extra in spec.models}
    return placement(config.policy, config.cluster, samples=samples, own_slots_per_node=own)


def check_extra_policy(extra: ExtraPolicy, world_size: int) -> None:
    """The checks of an extra policy before Ray starts: its layout on its ``world_size`` slots, and a trained
    one's optimizer and scheduler."""
    check_policy_layout(extra.cfg, world_size)
    if extra.trained:
        check_optimizer_config(extra.cfg)
    if extra.warm_start is not None and not Path(extra.warm_start).is_dir():
        raise UserError(
            f"{extra.name}'s warm start {extra.warm_start} is not a folder: give the step_<n> folder of a run "
            f"that saved a {extra.name}/ checkpoint"
        )


def _start_cluster(config: TrainingConfig, spec: RunSpec[Any]) -> RayVirtualCluster | LocalCluster:
    """Reserve the run's slots: the driver's own process (:mod:`nemo_rl.distributed.single_process`), or Ray's
    (started, or attached to)."""
    refusal = single_process_refusal_of(
        config.cluster, config.policy, sampling=spec.sampling, extra_models=[m.name for m in spec.models]
    )
    if runs_in_one_process(config.cluster, refusal, cuda=cuda_available()):
        return LocalCluster(config.cluster, name=spec.name.lower())
    init_ray(config.cluster)
    name = spec.name.lower()
    if spec.sampling is None:
        return RayVirtualCluster(config.cluster, name=name)
    # The trained policy, its generation workers and each extra policy share a slot and take turns on it.
    return RayVirtualCluster(config.cluster, name=name, max_colocated_worker_groups=2 + len(spec.models))


def check_inputs(
    config: TrainingConfig,
    spec: RunSpec[Any],
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
) -> _SamplingChecks | None:
    """Step 1 of the module docstring: every check that needs no worker, each a one-line
    :class:`UserError`; returns what the checks of a run that samples found."""
    checks = None
    if spec.sampling is not None:
        checks = _SamplingChecks(
            envs_to_start=tasks_to_start(spec.sampling, train_dataset, val_dataset),
            # The one place tools are wired: built (an unknown tool fails here, before anything starts) and
            # their schemas declared in the prompts the model reads.
            task_to_tools=wire_task_tools(spec.sampling.env, (train_dataset, val_dataset)),
        )
    slots = _placement(config, spec, samples=checks is not None)
    world_size = len(slots.policy)
    check_run_setup(
        config.policy,
        config.checkpointing,
        config.logger.log_dir,
        policy_world_size=world_size,
        run_name=spec.name,
        metric_names=spec.metric_names,
    )
    for extra in spec.models:
        check_extra_policy(extra, len(slots.of_extra(extra.name)))
    return checks


def build_run(
    config: C,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
    spec: RunSpec[S],
) -> Run[C, S]:
    """Check the inputs, resume, build the loaders, start Ray and the workers, and the logger (see the module
    docstring); the run is the caller's to :meth:`~nemo_rl.algorithms.run.Run.shutdown`."""
    checks = check_inputs(config, spec, train_dataset, val_dataset)
    checkpointer = CheckpointManager(config.checkpointing)
    resume = find_resume(checkpointer, spec.name, config)
    train_loader = make_train_loader(
        train_dataset,
        resume,
        batch_size=spec.batch_size,
        batch_size_key=spec.batch_size_key,
        shuffle=config.data.shuffle,
        seed=spec.seed,
        collate_fn=spec.collate_fn,
        groups=spec.train_groups,
    )
    val_loader = None
    if spec.val_batch_size is not None:
        val_loader = make_val_loader(
            val_dataset, batch_size=spec.val_batch_size, seed=spec.seed, collate_fn=spec.collate_fn
        )
    cluster = _start_cluster(config, spec)
    workers = _start_workers(cluster, config, tokenizer, spec, resume, checkpointer, val_dataset, checks)
    run: Run[C, S] = Run(
        config=config,
        tokenizer=tokenizer,
        cluster=cluster,
        policy=workers.policy,
        models=workers.models,
        trained_models=tuple(m.name for m in spec.models if m.trained),
        sampling=workers.sampling,
        train_loader=train_loader,
        val_loader=val_loader,
        logger=start_logger(config),
        checkpointer=checkpointer,
        state=resume.state(spec.state_cls),
    )
    if workers.sampling is not None and workers.sampling.agent is not None:
        _start_agent_endpoint(run, workers.sampling.agent)
    return run


def _start_agent_endpoint(run: Run[Any, Any], agent: AgentConfig) -> None:
    """Serve the run's generation workers to external agents; a failed start stops the run."""
    try:
        run.rl.agent_endpoint = start_agent_endpoint(
            agent, run.config.policy, run.rl.generation, run.tokenizer
        )
    except BaseException:
        run.shutdown()
        raise
