"""Redirects of megatron-core's CUDA-only calls, so the Megatron backend also runs on a machine without a GPU.

megatron-core assumes CUDA in a few places that have nothing to do with the maths: it keeps its RNG states
with ``torch.cuda.get_rng_state``, allocates small bookkeeping tensors with ``device="cuda"`` or
``torch.cuda.current_device()``, moves tied embeddings with ``.cuda()``, asserts gradient types with
``grad.type() == "torch.cuda.FloatTensor"`` and calls ``torch.cuda.synchronize()`` after pipeline sends.
On a CPU-only machine each of those raises, although everything else runs fine over gloo.

Nothing here is used when CUDA is available: :func:`install` and :func:`device_redirect` check
:func:`~nemo_rl.distributed.device.cuda_available` and do nothing then, so on a GPU the normal CUDA path runs.
Without CUDA:

- :func:`install` (once per process) replaces megatron's RNG tracker by :class:`CpuRNGStatesTracker`, which
  keeps the same named states (data-parallel, tensor-parallel, expert) as CPU generator states, points
  megatron's own "CUDA RNG state" getter and setter (used by activation recomputation) at the CPU generator,
  and builds the default causal attention mask on the host (recomputation calls it from the backward pass,
  which runs outside :func:`device_redirect`).
- :func:`device_redirect` is a context manager the worker enters around every call into megatron-core. Inside
  it, :class:`CudaToHost` (a ``TorchFunctionMode``) creates tensors asked for on ``cuda`` on the CPU, makes
  ``Tensor.cuda()`` a no-op, drops ``pin_memory`` and reports CPU float tensors under their CUDA type name;
  ``torch.cuda.current_device`` returns ``"cpu"`` and ``torch.cuda.synchronize`` does nothing. All of it is
  undone when the block exits, so code outside megatron calls sees plain torch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.fusions import fused_softmax
from megatron.core.tensor_parallel import random as megatron_random
from torch.overrides import TorchFunctionMode

from nemo_rl.distributed.device import cuda_available


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's named RNG states (``fork`` / ``add``) kept as CPU generator states."""

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed`` (both must be new, as in Megatron)."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block with the CPU generator in state ``name``, then restore the previous state."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added")
        previous = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(previous)


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer is a CUDA ordinal.
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToHost(TorchFunctionMode):
    """Turns megatron-core's CUDA allocations and moves into host ones (see the module docstring)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts e.g. grad.type() == "torch.cuda.FloatTensor".
            name: str = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_lock = threading.Lock()
_depth = 0
_saved: dict[str, Any] = {}


def install() -> None:
    """Use CPU RNG states for megatron's RNG tracker in this process (no-op with CUDA; idempotent)."""
    if cuda_available():
        return
    if not isinstance(megatron_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    megatron_random._get_cuda_rng_state = _get_host_rng_state
    megatron_random._set_cuda_rng_state = _set_host_rng_state
    fused_softmax.get_default_causal_mask = _host_causal_mask


@functools.lru_cache(maxsize=16)
def _host_causal_mask(sq: int) -> torch.Tensor:
    """megatron's default causal mask ([sq, sq], True above the diagonal), on the host."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _get_host_rng_state(device: object = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_host_rng_state(new_state: torch.Tensor, device: object = None, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


@contextlib.contextmanager
def device_redirect() -> Iterator[None]:
    """Run megatron-core calls inside this block; on a machine without CUDA their CUDA calls go to the host.

    Re-entrant: only the outermost block patches and restores ``torch.cuda.current_device`` and
    ``torch.cuda.synchronize``.
    """
    if cuda_available():
        yield
        return
    global _depth
    with _lock:
        if _depth == 0:
            _saved["current_device"] = torch.cuda.current_device
            _saved["synchronize"] = torch.cuda.synchronize
            torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
            torch.cuda.synchronize = lambda device=None: None
        _depth += 1
    try:
        with CudaToHost():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.cuda.current_device = _saved.pop("current_device")
                torch.cuda.synchronize = _saved.pop("synchronize")
