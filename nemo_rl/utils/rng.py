"""The random-number state of one process (Python's ``random``, numpy's global generator, torch's CPU and CUDA
generators), as a value that can be saved with a checkpoint and put back.

A run that is killed and resumed continues bit for bit only if every source of randomness continues where it
stood: the driver saves its own state with each training checkpoint (see
:class:`nemo_rl.algorithms.loop.TrainLoop`) and each policy worker saves its own next to its shards.
:class:`ProcessRNG` wraps the two functions as a ``state_dict`` / ``load_state_dict`` object.

The state holds only tensors, numbers, strings and tuples, so it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch


def get_rng_state() -> dict[str, Any]:
    """This process's RNG state: ``python``, ``numpy``, ``torch`` and, when CUDA is initialised, ``cuda``."""
    kind, keys, position, has_gauss, cached_gaussian = cast(
        tuple[str, np.ndarray[Any, Any], int, int, float], np.random.get_state(legacy=True)
    )
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what :func:`get_rng_state` returned (the CUDA part only where CUDA is initialised)."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


class ProcessRNG:
    """This process's RNG state as a checkpointable object (``state_dict`` / ``load_state_dict``)."""

    def state_dict(self) -> dict[str, Any]:
        """See :func:`get_rng_state`."""
        return get_rng_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """See :func:`set_rng_state`."""
        set_rng_state(state)
