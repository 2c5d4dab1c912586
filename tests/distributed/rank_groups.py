"""Scenarios run on groups of gloo ranks, one process per rank, for the worker tests of this folder.

A test module writes its scenarios as functions ``(save, model_dir, out_dir) -> None`` and runs them with
:func:`run_groups`: every group on its own ``world_size`` ranks (its own rendezvous port), all groups at once.
Each rank has RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set as ``RayWorkerGroup`` sets them, and one torch
thread. ``save(name, value)`` writes ``<group>.<name>.rank<r>.pt``; :func:`load` reads it back as
``load(out_dir, "<group>.<name>", rank)``. A scenario's exception is written to ``error.<group>.rank<r>.txt``
and raised by :func:`run_groups` with the others.

Every process forks from one forkserver that imported torch, transformers and both policy workers once: the
import cost is paid once per test session instead of once per rank (multiprocessing keeps one server per
process, so the first module to run starts it for all). A test module's own functions are imported by each
rank when it unpickles its scenarios, which costs little once torch is loaded.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_rl.distributed.virtual_cluster import free_port

SaveFn = Callable[[str, Any], None]
Scenarios = Callable[[SaveFn, Any, Path], None]
"""``(save, model_dir, out_dir)``; ``model_dir`` is whatever the test passes to :func:`run_groups`."""

PRELOAD = ["transformers", "nemo_rl.models.policy.dtensor_worker", "nemo_rl.models.policy.megatron_worker"]
"""What the forkserver imports first (a module that fails to import, megatron-core's without it, is skipped)."""


def _entry(
    rank: int, world_size: int, port: int, group: str, run: Scenarios, model_dir: Any, out_dir: str
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NEMO_RL_TORCH_THREADS="1",
    )

    def save(name: str, value: Any) -> None:
        torch.save(value, Path(out_dir) / f"{group}.{name}.rank{rank}.pt")

    try:
        run(save, model_dir, Path(out_dir))
    except BaseException:
        (Path(out_dir) / f"error.{group}.rank{rank}.txt").write_text(traceback.format_exc())
        raise


def run_groups(
    groups: Sequence[tuple[str, int, Scenarios]],
    model_dir: Any,
    out_dir: Path,
    *,
    timeout_s: float,
) -> None:
    """Run each ``(group, world_size, scenarios)`` on its own ranks, all at once; raise on any failure."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    processes = []
    for group, world_size, run in groups:
        port = free_port()
        for rank in range(world_size):
            process = context.Process(
                target=_entry, args=(rank, world_size, port, group, run, model_dir, str(out_dir))
            )
            process.start()
            processes.append(process)
    deadline = time.monotonic() + timeout_s
    try:
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    errors = sorted(out_dir.glob("error.*.txt"))
    if errors:
        raise RuntimeError("\n".join(p.read_text() for p in errors))
    if any(p.exitcode != 0 for p in processes):
        raise RuntimeError(
            f"scenario processes exited with {[p.exitcode for p in processes]} (timeout {timeout_s} s)"
        )


def load(out_dir: Path, name: str, rank: int = 0) -> Any:
    """What rank ``rank`` saved as ``name`` (``"<group>.<name>"``)."""
    group, _, rest = name.partition(".")
    return torch.load(out_dir / f"{group}.{rest}.rank{rank}.pt", weights_only=False)


def spawn_and_wait(entry: Callable[..., None], args: tuple[Any, ...], nprocs: int, timeout_s: float) -> None:
    """Run ``entry(rank, *args)`` in ``nprocs`` spawned processes until all end (for modules whose ranks run
    one script of their own rather than :func:`run_groups`' scenarios); kill them and raise after
    ``timeout_s``."""
    context = torch.multiprocessing.start_processes(
        entry, args=args, nprocs=nprocs, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=5.0):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{getattr(entry, '__module__', entry)}'s ranks did not finish within {timeout_s} s"
                )
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
