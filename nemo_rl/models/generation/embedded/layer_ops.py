"""The embedded decoder's numerical building blocks, each written to match Hugging Face bit for bit on CPU:
RMSNorm, a projection over token rows with a pre-transposed weight, the residual projection and rotary
embedding, and the per-layer weights they read (:class:`LayerWeights`). :mod:`.model` composes them into a
decoder layer.

Tensor legend: M = token rows, H = hidden size, I = a projection's input width, O = its output width,
N = attention heads, K = key/value heads, D = head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nemo_rl.models.generation.embedded.moe import MoeWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def linear(x_MI: torch.Tensor, weight_IO: torch.Tensor, bias_O: torch.Tensor | None) -> torch.Tensor:
    """``linear`` over token rows with a weight already transposed to ``[in, out]``: one ``mm``/``addmm``."""
    if bias_O is None:
        return torch.mm(x_MI, weight_IO)
    return torch.addmm(bias_O, x_MI, weight_IO)


def residual_linear(
    x_MH: torch.Tensor, input_MI: torch.Tensor, weight_IH: torch.Tensor, bias_H: torch.Tensor | None
) -> torch.Tensor:
    """``x + linear(input)``; without a bias one ``addmm``, the residual added inside the matmul."""
    if bias_H is None:
        return torch.addmm(x_MH, input_MI, weight_IH)
    return x_MH + torch.addmm(bias_H, input_MI, weight_IH)


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(layer, q [M, N, D], k [M, K, D], v [M, K, D]) -> attention output [M, N * D]``."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout, with full-width tables ``cos = [c, c]``, ``sin = [-s, s]``.

    Equal, bit for bit, to Hugging Face's ``x * cos + rotate_half(x) * sin`` (negation is exact), in four ops.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the forward passes read them: views into the fused storage (so a refit
    writing the Hugging Face-named views is seen here), projections transposed to ``[in, out]``."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv_t: torch.Tensor
    qkv_b: torch.Tensor | None
    o_t: torch.Tensor
    o_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up_t: torch.Tensor | None
    gate_up_b: torch.Tensor | None
    down_t: torch.Tensor | None
    down_b: torch.Tensor | None
    moe: MoeWeights | None
    """The MoE block's weights (then the dense MLP's are None)."""


def transposed(weight: torch.Tensor | None) -> torch.Tensor | None:
    """``weight.t()``, or None."""
    return weight.t() if weight is not None else None
