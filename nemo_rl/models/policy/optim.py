"""Optimizer, learning-rate schedule and gradient clipping for DTensor-sharded parameters."""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import ConstantLR, LRScheduler, SequentialLR

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import OptimizerConfig, PolicyConfig, SchedulerEntry, SchedulerMilestones
from nemo_rl.models.policy.parallelize import import_by_path

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def frozen_names(names: Sequence[str], patterns: Sequence[str]) -> set[str]:
    """The parameter ``names`` that match one of the glob ``patterns`` (``policy.frozen_parameters``).

    A pattern that matches nothing, or patterns that match every name, raise :class:`UserError`: a typo must
    not silently train the whole model, nor leave nothing to train.
    """
    frozen: set[str] = set()
    for pattern in patterns:
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise UserError(
                f"policy.frozen_parameters pattern {pattern!r} matches no parameter of the model (its parameters "
                f"are named like {names[0]!r} ... {names[-1]!r}): fix the pattern"
            )
        frozen.update(matched)
    if frozen and len(frozen) == len(names):
        raise UserError("policy.frozen_parameters freezes every parameter of the model: leave some to train")
    return frozen


def freeze_parameters(model: torch.nn.Module, patterns: Sequence[str]) -> list[torch.nn.Parameter]:
    """Stop training the parameters of ``model`` named by ``policy.frozen_parameters`` (see
    :func:`frozen_names`) and return the ones that still train, for the optimizer.

    Names are the model's own (those of its Hugging Face checkpoint), the same whatever the sharding.
    """
    frozen = frozen_names([name for name, _ in model.named_parameters()], patterns)
    trainable = []
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
        elif param.requires_grad:  # not frozen before (LoRA freezes the base model)
            trainable.append(param)
    return trainable


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig | None
) -> torch.optim.Optimizer:
    """Instantiate ``cfg.name`` (an optimizer class import path) over ``params`` with ``cfg.kwargs``."""
    if cfg is None:
        raise ValueError("policy.optimizer is null: set policy.optimizer (the DTensor backend's optimizer)")
    optimizer_cls = import_by_path(cfg.name)
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise ValueError(f"policy.optimizer.name={cfg.name!r} is not a torch.optim.Optimizer subclass")
    optimizer: torch.optim.Optimizer = optimizer_cls(list(params), **cfg.kwargs)
    return optimizer


def build_scheduler(
    optimizer: torch.optim.Optimizer, entries: list[SchedulerEntry | SchedulerMilestones] | None
) -> LRScheduler:
    """The learning-rate schedule of ``policy.scheduler``, stepped once per optimizer step.

    No entry: a constant learning rate. One scheduler: that scheduler. Several: a ``SequentialLR`` switching
    at the ``milestones`` entry's steps (e.g. linear warm-up, then constant). The schema has already checked
    that the milestone count matches.
    """
    schedulers: list[LRScheduler] = []
    milestones: list[int] = []
    for entry in entries or []:
        if isinstance(entry, SchedulerMilestones):
            milestones = list(entry.milestones)
            continue
        scheduler_cls = import_by_path(entry.name)
        if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, LRScheduler)):
            raise ValueError(f"policy.scheduler name {entry.name!r} is not a torch LRScheduler subclass")
        schedulers.append(scheduler_cls(optimizer, **entry.kwargs))
    if not schedulers:
        return ConstantLR(optimizer, factor=1.0, total_iters=0)
    if len(schedulers) == 1:
        return schedulers[0]
    return SequentialLR(optimizer, schedulers=schedulers, milestones=milestones)


def check_optimizer_config(cfg: PolicyConfig) -> None:
    """Build ``policy.optimizer`` and ``policy.scheduler`` once on a dummy parameter, so a bad class name or
    keyword argument (``lr=abc``, a misspelt key) fails in the driver before any worker starts, as a
    :class:`UserError` naming the section. The Megatron backend builds its own optimizer and is not checked."""
    if cfg.megatron_cfg.enabled or cfg.optimizer is None:
        return
    dummy = torch.nn.Parameter(torch.zeros(1))
    with _without_dynamo_guard():
        try:
            optimizer = build_optimizer([dummy], cfg.optimizer)
        except (TypeError, ValueError, ImportError, AttributeError) as err:
            raise UserError(
                f"policy.optimizer ({cfg.optimizer.name} with kwargs {cfg.optimizer.kwargs}) cannot be built: "
                f"{err}"
            ) from None
        try:
            build_scheduler(optimizer, cfg.scheduler)
        except (TypeError, ValueError, ImportError, AttributeError, KeyError) as err:
            raise UserError(f"policy.scheduler cannot be built: {err}") from None


@contextlib.contextmanager
def _without_dynamo_guard() -> Iterator[None]:
    """Build the check's throw-away optimizer without importing torch._dynamo.

    ``Optimizer.add_param_group`` is wrapped to keep torch.compile out of it, and the wrapper imports
    torch._dynamo on its first call: seconds of CPU in the driver, which never compiles or steps an optimizer.
    The check calls the undecorated method; the workers' optimizers keep the wrapper.
    """
    decorated = torch.optim.Optimizer.add_param_group
    undecorated = getattr(decorated, "__wrapped__", decorated)
    torch.optim.Optimizer.add_param_group = undecorated  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.optim.Optimizer.add_param_group = decorated  # type: ignore[method-assign]


def _shard_mesh_dims(tensor: DTensor) -> list[int]:
    """Mesh dims along which ``tensor`` is split (its local pieces must be summed over them). FSDP2 over a
    tensor-parallel weight shards the dim TP already split as a ``_StridedShard``, which is not a ``Shard``
    (nor ``is_shard()``), and splits the tensor just the same."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return [i for i, p in enumerate(tensor.placements) if isinstance(p, Shard | _StridedShard)]


def total_grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """The global L2 norm of all gradients, whatever mix of FSDP / TP DTensor layouts they have.

    ``torch.nn.utils.clip_grad_norm_`` cannot stack norms of DTensors living on different meshes (FSDP-only
    params sit on the 1-D dp mesh, TP params on the 2-D mesh). Instead each rank sums the squares of its
    local pieces, grouped by (mesh, sharded mesh dims), and all-reduces each group over exactly the mesh
    dims it is sharded on; replicated dims are not summed, so nothing is counted twice.
    """
    # Imported here, not with the module: the driver imports this module and never holds a DTensor.
    from torch.distributed.tensor import DTensor

    groups: dict[tuple[Any, tuple[int, ...]], torch.Tensor] = {}
    plain_sq: torch.Tensor | None = None
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            key = (grad.device_mesh, tuple(_shard_mesh_dims(grad)))
            sq = grad.to_local().detach().float().pow(2).sum()
            groups[key] = groups[key] + sq if key in groups else sq
        else:
            sq = grad.detach().float().pow(2).sum()
            plain_sq = sq if plain_sq is None else plain_sq + sq
    total = 0.0 if plain_sq is None else float(plain_sq)
    for (mesh, dims), sq in groups.items():
        for dim in dims:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total += float(sq)
    return math.sqrt(total)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm *before* clipping.

    ``max_norm=None`` only measures. Every rank must call this (the norm needs collectives).
    """
    params = list(params)
    norm = total_grad_norm(params)
    if max_norm is not None and math.isfinite(norm):
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return norm
