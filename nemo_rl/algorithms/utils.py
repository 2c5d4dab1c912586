"""Tensor helpers shared by the loss functions and advantage estimators.

Tensor legend: B = sequences, T = padded sequence length, V = vocabulary size.
"""

from __future__ import annotations

from typing import Literal

import torch

KLType = Literal["k1", "k2", "k3"]

# Guards divisions by a count of zero valid tokens / sequences; small enough to never bias a real count.
_DIV_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` weighted by ``mask``, over ``dim`` or everything.

    Masked-out entries contribute exactly 0 even when they hold NaN or inf (e.g. log-probs at padding).
    """
    weighted = torch.where(
        mask != 0, values * mask, torch.zeros((), dtype=values.dtype, device=values.device)
    )
    if dim is None:
        return weighted.sum()
    return weighted.sum(dim=dim)


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    global_normalization_factor: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Masked mean of ``values``, or the masked sum divided by a global count.

    Args:
        values: Values to average.
        mask: Same shape as ``values`` (or broadcastable); 0 excludes a value.
        dim: Dimension to reduce; ``None`` reduces everything.
        global_normalization_factor: Divide by this count instead of the local ``mask`` sum, which turns
            the result into this micro-batch's additive share of a mean over the whole global batch.

    Returns:
        The (share of the) mean. An empty mask gives 0, not NaN.
    """
    total = masked_sum(values, mask, dim)
    if global_normalization_factor is None:
        count = mask.sum() if dim is None else mask.sum(dim=dim)
    else:
        count = torch.as_tensor(global_normalization_factor, dtype=total.dtype, device=total.device)
    return total / (count + _DIV_EPS)


def calculate_kl(
    logprobs: torch.Tensor,
    logprobs_reference: torch.Tensor,
    *,
    kl_type: KLType,
    input_clamp_value: float | None,
    output_clamp_value: float | None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (Schulman's k1/k2/k3).

    With ``log_r = logprobs_reference - logprobs``: k1 = ``-log_r``, k2 = ``log_r**2 / 2``,
    k3 = ``exp(log_r) - 1 - log_r`` (unbiased and non-negative).

    Args:
        logprobs: Log-probs of the sampled tokens under the policy, any shape.
        logprobs_reference: Log-probs of the same tokens under the reference, same shape.
        kl_type: Which estimator.
        input_clamp_value: Clamp ``log_r`` to ``[-v, v]`` first (``None`` disables); keeps exp() finite.
        output_clamp_value: Clamp the estimate to ``[-v, v]`` (``None`` disables).
    """
    log_ratio = logprobs_reference - logprobs
    if input_clamp_value is not None:
        log_ratio = log_ratio.clamp(min=-input_clamp_value, max=input_clamp_value)
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = log_ratio.square() / 2
    elif kl_type == "k3":
        kl = torch.exp(log_ratio) - 1 - log_ratio
    else:
        raise ValueError(f"Unknown KL estimator {kl_type!r}; use one of 'k1', 'k2', 'k3'.")
    if output_clamp_value is not None:
        kl = kl.clamp(min=-output_clamp_value, max=output_clamp_value)
    return kl


def _at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def next_token_logprobs(next_token_logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``input_ids[:, 1:]`` under ``next_token_logits[:, :-1]``, in at least float32.

    Returns a [B, T-1] tensor whose column ``t`` is ``log p(input_ids[t + 1] | input_ids[:t + 1])``, i.e.
    the per-token convention of :mod:`nemo_rl.models.policy.loss_interface` without its (always zero) position 0.
    """
    if next_token_logits_BTV.shape[:2] != input_ids_BT.shape:
        raise ValueError(
            f"logits of shape {tuple(next_token_logits_BTV.shape)} do not match input_ids of shape "
            f"{tuple(input_ids_BT.shape)}: the policy must return one logit row per input position."
        )
    # At least float32: log-softmax in bf16 loses the small differences that policy ratios are made of.
    logits_BTV = _at_least_fp32(next_token_logits_BTV[:, :-1])
    targets_BT = input_ids_BT[:, 1:].to(logits_BTV.device).long().unsqueeze(-1)
    # gather - logsumexp avoids materialising a second [B, T, V] log-softmax tensor.
    return logits_BTV.gather(-1, targets_BT).squeeze(-1) - torch.logsumexp(logits_BTV, dim=-1)


def token_entropy(next_token_logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each position's next-token distribution, [B, T-1] for ``logits[:, :-1]``."""
    logits_BTV = _at_least_fp32(next_token_logits_BTV[:, :-1])
    # entr(p) = -p log p with entr(0) = 0: tokens a top-k/top-p filter set to -inf add nothing (not NaN).
    return torch.special.entr(torch.softmax(logits_BTV, dim=-1)).sum(dim=-1)
