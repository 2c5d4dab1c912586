"""Generalized advantage estimation (GAE) for PPO with a learned critic, as pure functions over [B, T].

With per-token rewards ``r_t``, the critic's values ``V_t`` and ``V`` after a sequence's last token taken
as 0 (the episode ends there)::

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lambda * A_{t+1}          (A after the last token = 0)
    R_t     = A_t + V_t                                   (the critic's target, the "return")

The recursion runs over the *masked-in* tokens of a sequence only: where ``response_mask`` is 0 (the
prompt, padding, a tool's or the user's tokens between two assistant turns) both running quantities,
``V_{t+1}`` and ``A_{t+1}``, are carried over unchanged, so the assistant token before a hole is followed
directly by the first assistant token after it (as NeMo RL's carry-forward masking does). Advantages and
returns are 0 at masked positions.

VAPO (arXiv:2504.05118) decouples the two uses of lambda: the value targets take ``gae_lambda_value``
(VAPO uses 1.0, unbiased Monte-Carlo-like returns), the policy advantages ``gae_lambda_policy`` or, with
``length_adaptive_alpha`` > 0, a per-sequence ``lambda = 1 - 1 / (alpha * l)`` for a response of ``l``
masked-in tokens (``alpha * l`` clamped to at least 1, lambda to [0, 1], as NeMo RL does). Unset values
fall back to ``gae_lambda``; with none set this is plain GAE. ``normalize_advantages`` whitens the policy
advantages over the masked-in tokens of the whole batch.

Tensor legend: B = sequences, T = positions (any alignment; the mask says which count).
"""

from __future__ import annotations

from typing import Protocol

import torch

WHITEN_EPSILON = 1e-8
"""Added to the variance before the inverse square root when whitening (NeMo RL's value)."""


class GAESettings(Protocol):
    """The advantage-estimator settings GAE reads (NeMo RL's ``ppo.adv_estimator`` keys)."""

    @property
    def gae_gamma(self) -> float:
        """Discount per token."""
        ...

    @property
    def gae_lambda(self) -> float:
        """Lambda of both the policy advantages and the value targets unless decoupled."""
        ...

    @property
    def gae_lambda_value(self) -> float | None:
        """Lambda of the value targets; ``None`` uses ``gae_lambda``."""
        ...

    @property
    def gae_lambda_policy(self) -> float | None:
        """Lambda of the policy advantages; ``None`` uses ``gae_lambda``."""
        ...

    @property
    def length_adaptive_alpha(self) -> float:
        """VAPO's alpha: > 0 replaces the policy lambda by ``1 - 1 / (alpha * length)``; 0 is off."""
        ...

    @property
    def normalize_advantages(self) -> bool:
        """Whiten the policy advantages over the batch's masked-in tokens."""
        ...


def _check_shapes(**tensors_BT: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors_BT.items()}
    if len(set(shapes.values())) != 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError(f"GAE needs [B, T] tensors of one shape; got {shapes}")


def terminal_token_rewards(rewards_B: torch.Tensor, response_mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [B, T] holding each sequence's scalar reward on its last masked-in token.

    The last *masked-in* token, not the last real one: a multi-turn conversation may end with a tool's or
    the user's message, and the reward belongs to the assistant's last token. Sequences with no masked-in
    token get no reward.
    """
    if rewards_B.ndim != 1 or response_mask_BT.ndim != 2 or rewards_B.shape[0] != response_mask_BT.shape[0]:
        raise ValueError(
            f"rewards must be [B] and the mask [B, T]; got {tuple(rewards_B.shape)} and "
            f"{tuple(response_mask_BT.shape)}"
        )
    mask_BT = response_mask_BT != 0
    num_positions = mask_BT.shape[1]
    # argmax returns the first maximum, so on the flipped mask it finds the last masked-in position.
    last_B = num_positions - 1 - mask_BT.flip(1).to(torch.uint8).argmax(dim=1)
    dtype = torch.promote_types(rewards_B.dtype, torch.float32)
    token_rewards_BT = torch.zeros(mask_BT.shape, dtype=dtype, device=rewards_B.device)
    has_response_B = mask_BT.any(dim=1)
    token_rewards_BT.scatter_(
        1, last_B.unsqueeze(1), torch.where(has_response_B, rewards_B.to(dtype), 0.0)[:, None]
    )
    return token_rewards_BT


def length_adaptive_lambda(response_mask_BT: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's per-sequence policy lambda [B]: ``1 - 1 / max(alpha * l, 1)`` for ``l`` masked-in tokens."""
    if alpha <= 0:
        raise ValueError(f"length_adaptive_alpha must be > 0 to adapt lambda to the length; got {alpha}")
    lengths_B = (response_mask_BT != 0).sum(dim=1).to(torch.float32)
    return (1.0 - 1.0 / (alpha * lengths_B).clamp(min=1.0)).clamp(0.0, 1.0)


def gae(
    token_rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BT, returns_BT) of GAE(gamma, lam) over the masked-in tokens (see the module docstring).

    ``lam`` is a number or one lambda per sequence ([B]). Both outputs are 0 at masked positions; they are
    computed in at least float32 and carry no gradient to ``values_BT``.
    """
    _check_shapes(token_rewards=token_rewards_BT, values=values_BT, response_mask=response_mask_BT)
    dtype = torch.promote_types(torch.promote_types(token_rewards_BT.dtype, values_BT.dtype), torch.float32)
    rewards_BT = token_rewards_BT.detach().to(dtype)
    values = values_BT.detach().to(dtype)
    mask_BT = (response_mask_BT != 0).to(dtype)
    lam_B = torch.as_tensor(lam, dtype=dtype, device=values.device).expand(values.shape[0])
    next_value_B = torch.zeros(values.shape[0], dtype=dtype, device=values.device)
    next_advantage_B = torch.zeros_like(next_value_B)
    advantages_BT = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values[:, t]
        advantage_B = delta_B + gamma * lam_B * next_advantage_B
        m_B = mask_BT[:, t]
        # Carry forward over masked positions: the next masked-in token's value and advantage stay.
        next_value_B = m_B * values[:, t] + (1 - m_B) * next_value_B
        next_advantage_B = m_B * advantage_B + (1 - m_B) * next_advantage_B
        advantages_BT[:, t] = m_B * advantage_B
    return advantages_BT, (advantages_BT + values) * mask_BT


def whiten(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + WHITEN_EPSILON)`` over the masked-in entries of the whole tensor, 0 elsewhere.

    ``var`` is the mean squared deviation over the masked-in entries (no Bessel correction).
    """
    mask = (mask_BT != 0).to(values_BT.dtype)
    count = mask.sum().clamp(min=1.0)
    mean = (values_BT * mask).sum() / count
    var = (((values_BT - mean) ** 2) * mask).sum() / count
    return (values_BT - mean) * torch.rsqrt(var + WHITEN_EPSILON) * mask


def gae_advantages_and_returns(
    token_rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    settings: GAESettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BT, returns_BT): the policy's advantages (whitened when ``normalize_advantages``) and the
    critic's value targets, each with its own lambda when VAPO's decoupling is configured."""
    lam_value = settings.gae_lambda if settings.gae_lambda_value is None else settings.gae_lambda_value
    lam_policy: float | torch.Tensor
    if settings.length_adaptive_alpha > 0:
        lam_policy = length_adaptive_lambda(response_mask_BT, settings.length_adaptive_alpha)
    elif settings.gae_lambda_policy is not None:
        lam_policy = settings.gae_lambda_policy
    else:
        lam_policy = settings.gae_lambda
    gamma = settings.gae_gamma
    advantages_BT, returns_BT = gae(token_rewards_BT, values_BT, response_mask_BT, gamma=gamma, lam=lam_value)
    if isinstance(lam_policy, torch.Tensor) or lam_policy != lam_value:
        advantages_BT, _ = gae(token_rewards_BT, values_BT, response_mask_BT, gamma=gamma, lam=lam_policy)
    if settings.normalize_advantages:
        advantages_BT = whiten(advantages_BT, response_mask_BT)
    return advantages_BT, returns_BT
