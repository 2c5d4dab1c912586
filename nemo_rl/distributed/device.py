"""Device and process-group helpers shared by every worker process.

The same code runs on CUDA (NCCL, one GPU per rank) and on CPU (gloo); nothing else branches on hardware.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from nemo_rl.config.errors import UserError


def cuda_available() -> bool:
    """Whether this process can use a CUDA device."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def get_device() -> torch.device:
    """The device this rank computes on: its local GPU, or the CPU."""
    if cuda_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend() -> str:
    """``nccl`` when CUDA is available, ``gloo`` otherwise."""
    return "nccl" if cuda_available() else "gloo"


def configure_worker_threads() -> None:
    """Use one intra-op thread per worker: several workers share a node's cores, and more threads thrash."""
    torch.set_num_threads(_threads_from_env("NEMO_RL_TORCH_THREADS"))


def _threads_from_env(name: str) -> int:
    """The thread count environment variable ``name`` gives (1 when unset)."""
    value = os.environ.get(name, "1")
    if not value.strip().isdigit() or int(value) < 1:
        raise UserError(
            f"{name}={value!r}: give a whole number of torch threads, at least 1 (or unset it for 1)"
        )
    return int(value)


DRIVER_TORCH_THREADS_ENV = "NEMO_RL_DRIVER_TORCH_THREADS"
"""Environment variable with the driver process's intra-op thread count (default 1, see
:func:`configure_driver_threads`)."""


def configure_driver_threads() -> None:
    """Give the driver process ``$NEMO_RL_DRIVER_TORCH_THREADS`` intra-op threads, 1 unless set.

    The driver's tensor work is per-step bookkeeping on small tensors (advantages, flattening the rollout into
    the training batch, rewards, metrics) while the workers keep every core busy. With torch's default of one
    thread per core, each of those small operations starts a parallel region whose threads wait for cores the
    workers hold, and one thread is several times faster (benchmarks/README.md, "The step's overheads at
    64x32"). :func:`~nemo_rl.distributed.ray_start.init_ray` calls this.
    """
    torch.set_num_threads(_threads_from_env(DRIVER_TORCH_THREADS_ENV))


def init_process_group_from_env(timeout_s: float = 600.0) -> None:
    """Join the default process group described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

    A no-op when the group already exists. CUDA ranks also get the ``gloo`` backend for CPU tensors.
    """
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if cuda_available() else "gloo"
    if cuda_available():
        torch.cuda.set_device(get_device())
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
