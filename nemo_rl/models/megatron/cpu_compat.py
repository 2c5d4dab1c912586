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
  ``torch.cuda.current_device`` returns ``"cpu"`` and ``torch.cuda.synchronize`` does nothing; CUDA streams
  and events (the MoE all-to-all dispatcher copies its split sizes to the host on a side stream) become
  :class:`HostStream` / :class:`HostEvent`, which order nothing because the host has one stream, and ``all_to_all_single`` takes split sizes the
  dispatcher left as host tensors. All of it is
  undone when the block exits, so code outside megatron calls sees plain torch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
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


class HostEvent:
    """A CUDA event's stand-in on the host: everything before it has already happened."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: object = None) -> None:
        """Nothing to wait for."""


class HostStream:
    """A CUDA stream's stand-in on the host, where work runs in program order."""

    def wait_stream(self, stream: object) -> None:
        """Nothing to wait for."""

    def wait_event(self, event: object) -> None:
        """Nothing to wait for."""

    def record_event(self, event: object = None) -> HostEvent:
        """An event that has already happened."""
        return HostEvent()

    def synchronize(self) -> None:
        """Nothing to wait for."""


_HOST_STREAM = HostStream()


def _all_to_all_single(*args: Any, **kwargs: Any) -> Any:
    """``dist.all_to_all_single`` taking split sizes as tensors too: the MoE dispatcher turns them into numpy
    arrays only when it copies them from a GPU; on the host they stay tensors, which gloo does not take."""
    kwargs = {
        k: v.tolist() if k.endswith("_split_sizes") and torch.is_tensor(v) else v for k, v in kwargs.items()
    }
    return _saved[_key(dist, "all_to_all_single")](*args, **kwargs)


_REDIRECTS: dict[tuple[Any, str], Callable[..., Any]] = {
    (torch.cuda, "current_device"): lambda: "cpu",
    (torch.cuda, "synchronize"): lambda device=None: None,
    (torch.cuda, "Stream"): lambda *args, **kwargs: HostStream(),
    (torch.cuda, "current_stream"): lambda device=None: _HOST_STREAM,
    (torch.cuda, "stream"): lambda stream=None: contextlib.nullcontext(),
    (dist, "all_to_all_single"): _all_to_all_single,
}
"""Module attributes replaced inside :func:`device_redirect` (the backward pass, which runs without the
torch function mode, sees them too)."""


def _key(module: Any, name: str) -> str:
    return f"{module.__name__.rsplit('.', 1)[-1]}.{name}"


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

    Re-entrant: only the outermost block patches and restores the functions of :data:`_REDIRECTS`.
    """
    if cuda_available():
        yield
        return
    global _depth
    with _lock:
        if _depth == 0:
            for (module, name), redirect in _REDIRECTS.items():
                _saved[_key(module, name)] = getattr(module, name)
                setattr(module, name, redirect)
        _depth += 1
    try:
        with CudaToHost():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for module, name in _REDIRECTS:
                    setattr(module, name, _saved.pop(_key(module, name)))
