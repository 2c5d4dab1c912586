"""How torch tensors cross Ray's process boundaries: as numpy arrays, not through ``torch.save``.

Ray pickles a CPU tensor the way torch does, which runs ``torch.save`` on the tensor's whole storage: a fixed
cost per tensor however small, and a view pickles the storage it is cut from. A GRPO step sends every
sample's message log to the environments (a prompt, a response and its log-probs: three tensors per sample,
1,500 at 512 samples) and the training batch to the policy, so that cost added up to a visible share of a
step (benchmarks/README.md, "Tensors through Ray"). :func:`register_tensor_serializer` makes Ray send a plain
CPU tensor as the numpy array over its memory instead: pickle protocol 5 then moves the bytes out of band
(shared memory for large ones), many times faster for small tensors, and only the view's own elements travel.

The receiver gets an ordinary writable tensor with the same dtype, shape and values (arrays Ray hands out
read-only are copied once). What differs from torch's own pickling: tensors that shared a storage on the
sender arrive with separate storages (identical tensor objects in one message still arrive as one). Tensors
numpy cannot hold (on an accelerator, requiring grad, sparse, quantized, conjugated, dtypes without a
numpy twin) keep torch's own pickling.

Only the sending process needs the registration (the receiver finds :func:`_tensor_from_payload` by import).
Importing :mod:`nemo_rl.distributed.batched_data_dict` registers it, so the driver, the workers and the
environments all do; the registration needs no running Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import ray.util
import torch

# dtypes sent as the numpy array of the same dtype, or (values) reinterpreted as an integer of the same width.
_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
_SENT_AS = {torch.bfloat16: torch.int16}

TensorPayload = tuple[Any, ...]
"""``("numpy", array, dtype name)`` or ``("torch", rebuild function, its arguments)``."""


def _payload_from_tensor(tensor: torch.Tensor) -> TensorPayload:
    """What Ray pickles in place of ``tensor`` (see the module docstring)."""
    numpy_ok = (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and (tensor.dtype in _NUMPY_DTYPES or tensor.dtype in _SENT_AS)
    )
    if not numpy_ok:
        rebuild, args = tensor.__reduce_ex__(2)[:2]
        return ("torch", rebuild, args)
    sent_as = _SENT_AS.get(tensor.dtype)
    array = (tensor if sent_as is None else tensor.view(sent_as)).numpy()
    return ("numpy", array, str(tensor.dtype).removeprefix("torch."))


def _tensor_from_payload(payload: TensorPayload) -> torch.Tensor:
    """The tensor :func:`_payload_from_tensor` described."""
    if payload[0] == "torch":
        rebuild: Callable[..., torch.Tensor] = payload[1]
        return rebuild(*payload[2])
    _, array, dtype_name = payload
    if not array.flags.writeable:  # a zero-copy view of Ray's object store
        array = np.array(array)
    tensor = torch.from_numpy(array)
    dtype = getattr(torch, dtype_name)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


def register_tensor_serializer() -> None:
    """Make this process's Ray send plain torch tensors as numpy arrays (before or after ``ray.init``; idempotent)."""
    ray.util.register_serializer(
        torch.Tensor, serializer=_payload_from_tensor, deserializer=_tensor_from_payload
    )
