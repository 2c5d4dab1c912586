"""Device and process-group helpers shared by every worker process.

The same code runs on CUDA (NCCL, one GPU per rank) and on CPU (gloo); nothing else branches on hardware.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


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
    torch.set_num_threads(int(os.environ.get("NEMO_RL_TORCH_THREADS", "1")))


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
