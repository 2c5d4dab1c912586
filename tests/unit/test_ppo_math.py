"""PPO's math against plain references: GAE, VAPO's decoupled lambdas, whitening and the clipped value loss.

The GAE reference works on one sequence at a time with Python floats: it keeps the masked-in positions,
runs the textbook backward recursion over them (the value after the last one is 0) and writes the results
back, 0 elsewhere. That is what "skip the masked-out tokens" means, written without the carry-forward trick
the library uses, so the two can disagree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch

from nemo_rl.algorithms.gae import (
    gae,
    gae_advantages_and_returns,
    length_adaptive_lambda,
    terminal_token_rewards,
    whiten,
)
from nemo_rl.algorithms.losses import Masks, clipped_value_loss, explained_variance, value_metrics

Rows = Sequence[Sequence[float]]


def reference_gae_row(
    rewards: Sequence[float], values: Sequence[float], mask: Sequence[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one sequence, by the textbook recursion over its masked-in positions."""
    kept = [t for t, m in enumerate(mask) if m]
    advantages, returns = [0.0] * len(mask), [0.0] * len(mask)
    next_value, next_advantage = 0.0, 0.0
    for t in reversed(kept):
        delta = rewards[t] + gamma * next_value - values[t]
        advantage = delta + gamma * lam * next_advantage
        advantages[t], returns[t] = advantage, advantage + values[t]
        next_value, next_advantage = values[t], advantage
    return advantages, returns


def reference_gae(
    rewards: Rows, values: Rows, mask: Rows, gamma: float, lams: Sequence[float]
) -> tuple[list[list[float]], list[list[float]]]:
    rows = [
        reference_gae_row(r, v, m, gamma, lam)
        for r, v, m, lam in zip(rewards, values, mask, lams, strict=True)
    ]
    return [a for a, _ in rows], [r for _, r in rows]


def t(rows: Rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# Three sequences of 7 positions: right padding, a multi-turn row with a hole (tool tokens), a prompt.
MASK: Rows = [
    [0, 1, 1, 1, 1, 0, 0],  # prompt, 4 response tokens, right padding
    [0, 1, 1, 0, 0, 1, 1],  # two assistant turns around a tool observation
    [0, 0, 1, 1, 1, 1, 1],  # longer prompt, response to the end
]
VALUES: Rows = [
    [0.3, 0.1, -0.4, 0.6, 0.2, 9.0, -9.0],
    [5.0, 0.5, 0.7, -3.0, 4.0, 0.2, -0.1],
    [1.0, -1.0, 0.4, 0.0, 0.9, -0.6, 0.3],
]
DENSE_REWARDS: Rows = [
    [7.0, 0.2, -0.1, 0.0, 1.0, 3.0, 3.0],
    [2.0, 0.0, 0.5, 8.0, 8.0, -0.3, 1.0],
    [0.0, 0.0, 0.1, 0.2, -0.2, 0.0, 0.7],
]
REWARDS_B = [1.0, -0.5, 2.0]


def masked(rows: Rows, mask: Rows) -> list[list[float]]:
    return [[x * m for x, m in zip(r, mr, strict=True)] for r, mr in zip(rows, mask, strict=True)]


@pytest.mark.parametrize(
    ("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0), (0.0, 0.7), (0.5, 1.0)]
)
def test_gae_matches_the_per_sequence_reference(gamma: float, lam: float) -> None:
    rewards = masked(DENSE_REWARDS, MASK)  # per-token rewards live on response tokens
    advantages, returns = gae(t(rewards), t(VALUES), t(MASK), gamma=gamma, lam=lam)
    expected_adv, expected_ret = reference_gae(rewards, VALUES, MASK, gamma, [lam] * 3)
    torch.testing.assert_close(advantages, t(expected_adv))
    torch.testing.assert_close(returns, t(expected_ret))


def test_rewards_off_the_mask_are_ignored() -> None:
    """Rewards at masked positions (tool tokens, padding) change nothing: those steps are skipped."""
    clean, _ = gae(t(masked(DENSE_REWARDS, MASK)), t(VALUES), t(MASK), gamma=0.9, lam=0.9)
    noisy, _ = gae(t(DENSE_REWARDS), t(VALUES), t(MASK), gamma=0.9, lam=0.9)
    torch.testing.assert_close(noisy, clean)


def test_terminal_reward_lands_on_the_last_masked_in_token() -> None:
    mask = [*MASK, [0, 0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0]]  # no response; ends on a tool message
    rewards = terminal_token_rewards(torch.tensor([*REWARDS_B, 4.0, 3.0]), t(mask))
    expected = torch.zeros(5, 7, dtype=torch.float64)
    expected[0, 4], expected[1, 6], expected[2, 6], expected[4, 2] = 1.0, -0.5, 2.0, 3.0
    torch.testing.assert_close(rewards, expected.to(rewards.dtype))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.97, 0.0)])
def test_gae_of_a_final_reward(gamma: float, lam: float) -> None:
    rewards = terminal_token_rewards(torch.tensor(REWARDS_B, dtype=torch.float64), t(MASK))
    advantages, returns = gae(rewards, t(VALUES), t(MASK), gamma=gamma, lam=lam)
    expected_adv, expected_ret = reference_gae(rewards.tolist(), VALUES, MASK, gamma, [lam] * 3)
    torch.testing.assert_close(advantages, t(expected_adv))
    torch.testing.assert_close(returns, t(expected_ret))


def test_lambda_one_gamma_one_returns_are_the_reward_to_go() -> None:
    """With gamma = lambda = 1 the return of every response token is the final reward (Monte Carlo)."""
    rewards = terminal_token_rewards(torch.tensor(REWARDS_B, dtype=torch.float64), t(MASK))
    _, returns = gae(rewards, t(VALUES), t(MASK), gamma=1.0, lam=1.0)
    expected = [[REWARDS_B[b] * m for m in MASK[b]] for b in range(3)]
    torch.testing.assert_close(returns, t(expected))


def test_lambda_zero_is_the_one_step_td_error() -> None:
    rewards = masked(DENSE_REWARDS, MASK)
    advantages, _ = gae(t(rewards), t(VALUES), t(MASK), gamma=0.9, lam=0.0)
    # Row 1: position 2's next masked-in token is 5 (the tool tokens 3-4 are skipped).
    assert advantages[1, 2].item() == pytest.approx(rewards[1][2] + 0.9 * VALUES[1][5] - VALUES[1][2])
    # The last masked-in token bootstraps from 0.
    assert advantages[0, 4].item() == pytest.approx(rewards[0][4] - VALUES[0][4])


def test_gae_by_hand() -> None:
    """Three tokens, final reward 5, values 1, 2, 3, gamma 1: lambda 0 gives the TD errors 1, 1, 2; lambda 1
    gives the reward minus the value, 4, 3, 2; the returns of lambda 1 are 5 everywhere."""
    rewards = terminal_token_rewards(torch.tensor([5.0]), torch.ones(1, 3))
    td, _ = gae(rewards, torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3), gamma=1.0, lam=0.0)
    mc, returns = gae(rewards, torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert td.tolist() == [[1.0, 1.0, 2.0]]
    assert mc.tolist() == [[4.0, 3.0, 2.0]]
    assert returns.tolist() == [[5.0, 5.0, 5.0]]


def test_gae_computes_in_float32_without_gradient() -> None:
    values = torch.tensor([[0.5, 0.25, 0.125]], dtype=torch.bfloat16, requires_grad=True)
    advantages, returns = gae(
        torch.zeros(1, 3, dtype=torch.bfloat16), values, torch.ones(1, 3), gamma=1.0, lam=1.0
    )
    assert advantages.dtype == returns.dtype == torch.float32
    assert not advantages.requires_grad and not returns.requires_grad


def test_per_sequence_lambda_and_vectorised_batch() -> None:
    lams = [0.3, 0.9, 1.0]
    rewards = masked(DENSE_REWARDS, MASK)
    advantages, _ = gae(t(rewards), t(VALUES), t(MASK), gamma=0.95, lam=torch.tensor(lams))
    expected, _ = reference_gae(rewards, VALUES, MASK, 0.95, lams)
    torch.testing.assert_close(advantages, t(expected))


def test_length_adaptive_lambda_is_vapo_formula() -> None:
    lam = length_adaptive_lambda(t(MASK), alpha=0.5)
    lengths = [sum(row) for row in MASK]  # 4, 4, 5
    expected = [min(max(1 - 1 / max(0.5 * n, 1.0), 0.0), 1.0) for n in lengths]
    torch.testing.assert_close(lam, torch.tensor(expected, dtype=torch.float32))
    # alpha * l below 1 clamps to lambda 0 rather than going negative.
    assert length_adaptive_lambda(t(MASK), alpha=0.1).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="length_adaptive_alpha"):
        length_adaptive_lambda(t(MASK), alpha=0.0)


@dataclasses.dataclass(frozen=True)
class Settings:
    gae_gamma: float = 1.0
    gae_lambda: float = 0.95
    gae_lambda_value: float | None = None
    gae_lambda_policy: float | None = None
    length_adaptive_alpha: float = 0.0
    normalize_advantages: bool = False


def _estimate(settings: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = terminal_token_rewards(torch.tensor(REWARDS_B, dtype=torch.float64), t(MASK))
    return gae_advantages_and_returns(rewards, t(VALUES), t(MASK), settings)


def _reference(gamma: float, lams: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = terminal_token_rewards(torch.tensor(REWARDS_B, dtype=torch.float64), t(MASK)).tolist()
    adv, ret = reference_gae(rewards, VALUES, MASK, gamma, lams)
    return t(adv), t(ret)


def test_decoupled_lambdas_give_policy_and_value_their_own() -> None:
    advantages, returns = _estimate(Settings(gae_lambda=0.5, gae_lambda_value=1.0, gae_lambda_policy=0.8))
    torch.testing.assert_close(advantages, _reference(1.0, [0.8] * 3)[0])
    torch.testing.assert_close(returns, _reference(1.0, [1.0] * 3)[1])


def test_unset_lambdas_fall_back_to_gae_lambda() -> None:
    advantages, returns = _estimate(Settings(gae_gamma=0.9, gae_lambda=0.7))
    expected_adv, expected_ret = _reference(0.9, [0.7] * 3)
    torch.testing.assert_close(advantages, expected_adv)
    torch.testing.assert_close(returns, expected_ret)


def test_length_adaptive_alpha_overrides_the_policy_lambda() -> None:
    settings = Settings(
        gae_lambda=0.5, gae_lambda_value=1.0, gae_lambda_policy=0.1, length_adaptive_alpha=0.5
    )
    advantages, returns = _estimate(settings)
    lams = [1 - 1 / max(0.5 * sum(row), 1.0) for row in MASK]
    torch.testing.assert_close(advantages, _reference(1.0, lams)[0])
    torch.testing.assert_close(returns, _reference(1.0, [1.0] * 3)[1])


def test_normalize_advantages_whitens_over_the_masked_in_tokens() -> None:
    advantages, _ = _estimate(Settings(normalize_advantages=True))
    raw, _ = _reference(1.0, [0.95] * 3)
    kept = [raw[b, i].item() for b in range(3) for i in range(7) if MASK[b][i]]
    mean = sum(kept) / len(kept)
    var = sum((x - mean) ** 2 for x in kept) / len(kept)
    expected = [
        [(raw[b, i].item() - mean) / math.sqrt(var + 1e-8) if MASK[b][i] else 0.0 for i in range(7)]
        for b in range(3)
    ]
    torch.testing.assert_close(advantages, t(expected))


def test_whiten_ignores_masked_entries_and_empty_masks() -> None:
    values = t([[1.0, 100.0, 3.0], [-50.0, 5.0, 7.0]])
    mask = t([[1, 0, 1], [0, 1, 1]])
    out = whiten(values, mask)
    kept = out[mask.bool()]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert (kept**2).mean().item() == pytest.approx(1.0, rel=1e-6)
    assert out[~mask.bool()].tolist() == [0.0, 0.0]
    assert whiten(values, torch.zeros_like(mask)).abs().sum().item() == 0.0


def test_gae_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one shape"):
        gae(t(VALUES), t(VALUES)[:, :-1], t(MASK), gamma=1.0, lam=1.0)


# --- clipped value loss ----------------------------------------------------------------------------------

V_NOW: Rows = [[0.0, 0.50, 0.95, -0.30], [0.0, 1.30, 0.10, 0.70]]
V_OLD: Rows = [[0.0, 0.40, 0.70, 0.10], [0.0, 1.00, 0.30, 0.50]]
RETURNS: Rows = [[0.0, 1.00, 0.00, -0.50], [0.0, 2.00, 0.40, 0.60]]
TOKEN_MASK: Rows = [[0, 1, 1, 1], [0, 1, 1, 0]]


def _masks(sample_mask: Sequence[float] = (1.0, 1.0)) -> Masks:
    token_mask, samples = t(TOKEN_MASK), t([list(sample_mask)])[0]
    tokens = (token_mask * samples[:, None]).sum()
    return Masks.of(token_mask, samples, samples.sum(), tokens)


def reference_value_loss(
    scale: float, cliprange: float | None, token_level: bool, sample_mask: Sequence[float] = (1.0, 1.0)
) -> tuple[float, float]:
    """(loss, clip fraction) written out token by token."""
    per_seq, all_tokens, clipped = [], [], 0
    for b in range(2):
        row = []
        for i in range(4):
            if not (TOKEN_MASK[b][i] and sample_mask[b]):
                continue
            v, old, r = V_NOW[b][i], V_OLD[b][i], RETURNS[b][i]
            err = (v - r) ** 2
            if cliprange:
                v_clip = min(max(v, old - cliprange), old + cliprange)
                clipped += (v_clip - r) ** 2 > err
                err = max(err, (v_clip - r) ** 2)
            row.append(err)
        all_tokens += row
        if row:
            per_seq.append(sum(row) / len(row))
    mean = sum(all_tokens) / len(all_tokens) if token_level else sum(per_seq) / len(per_seq)
    return 0.5 * scale * mean, clipped / len(all_tokens)


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize(
    ("scale", "cliprange"), [(0.4, 0.2), (1.0, 0.05), (1.0, None), (0.7, 0.0), (1.0, 10.0)]
)
def test_clipped_value_loss_matches_the_formula(
    scale: float, cliprange: float | None, token_level: bool
) -> None:
    terms = clipped_value_loss(
        t(V_NOW), t(V_OLD), t(RETURNS), _masks(), scale=scale, cliprange=cliprange, token_level=token_level
    )
    loss, clip_fraction = reference_value_loss(scale, cliprange, token_level)
    assert terms.loss.item() == pytest.approx(loss, rel=1e-7)
    metrics = value_metrics(t(V_NOW), t(RETURNS), terms, _masks())
    assert metrics["vf_clipfrac"] == pytest.approx(clip_fraction, rel=1e-6)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-7)


def test_value_loss_respects_the_sample_mask() -> None:
    terms = clipped_value_loss(
        t(V_NOW), t(V_OLD), t(RETURNS), _masks((0.0, 1.0)), scale=1.0, cliprange=0.2, token_level=True
    )
    assert terms.loss.item() == pytest.approx(reference_value_loss(1.0, 0.2, True, (0.0, 1.0))[0], rel=1e-7)


def test_clip_boundaries_and_gradient() -> None:
    """A prediction exactly on the clip edge is not clipped; one beyond the edge, away from its return, keeps
    its gradient (the unclipped error is the larger); one beyond the edge onto its return is clipped and gets
    no gradient (the clipped error, constant in the prediction, wins the max)."""
    old = t([[0.0, 0.0, 0.0]])
    returns = t([[1.0, -1.0, 0.5]])
    values = t([[0.2, 0.5, 0.5]]).requires_grad_(True)  # on the edge; beyond, away from -1; beyond, onto 0.5
    mask = t([[1, 1, 1]])
    masks = Masks.of(mask, t([[1.0]])[0], torch.tensor(1.0), torch.tensor(3.0))
    terms = clipped_value_loss(values, old, returns, masks, scale=1.0, cliprange=0.2, token_level=True)
    assert terms.clipped_BS.tolist() == [[False, False, True]]
    # 0.5 * mean of [(0.2 - 1)^2, max(1.5^2, 1.2^2), max(0, 0.3^2)]
    assert terms.loss.item() == pytest.approx(0.5 * (0.64 + 2.25 + 0.09) / 3)
    terms.loss.backward()
    assert values.grad is not None
    grad = values.grad[0].tolist()
    assert grad[0] == pytest.approx((0.2 - 1.0) / 3)
    assert grad[1] == pytest.approx((0.5 + 1.0) / 3)  # unclipped error larger: its gradient flows
    assert grad[2] == pytest.approx(0.0)  # the clipped branch (a constant) won the max


def test_value_metrics_and_explained_variance() -> None:
    terms = clipped_value_loss(
        t(V_NOW), t(V_OLD), t(RETURNS), _masks(), scale=1.0, cliprange=None, token_level=True
    )
    metrics = value_metrics(t(V_NOW), t(RETURNS), terms, _masks())
    pairs = [(V_NOW[b][i], RETURNS[b][i]) for b in range(2) for i in range(4) if TOKEN_MASK[b][i]]
    values = [v for v, _ in pairs]
    returns = [r for _, r in pairs]
    assert metrics["values_mean"] == pytest.approx(sum(values) / 5)
    assert metrics["returns_mean"] == pytest.approx(sum(returns) / 5)
    assert (metrics["values_min"], metrics["values_max"]) == (min(values), max(values))
    assert metrics["vf_clipfrac"] == 0.0
    mean_r = sum(returns) / 5
    var_r = sum((r - mean_r) ** 2 for r in returns) / 5
    residuals = [r - v for v, r in pairs]
    mean_e = sum(residuals) / 5
    var_e = sum((e - mean_e) ** 2 for e in residuals) / 5
    ev = explained_variance(
        metrics["returns_mean"],
        metrics["values_mean"],
        metrics["returns_sq_mean"],
        metrics["residual_sq_mean"],
    )
    assert ev == pytest.approx(1 - var_e / var_r, rel=1e-6)
    # A perfect critic explains everything.
    assert explained_variance(0.5, 0.5, 1.0, 0.0) == pytest.approx(1.0)


@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batch_shares_add_up_to_the_batch_loss(token_level: bool) -> None:
    """Each micro-batch returns its share of the global mean, so the shares of two halves sum to the whole."""
    whole = clipped_value_loss(
        t(V_NOW), t(V_OLD), t(RETURNS), _masks(), scale=0.4, cliprange=0.2, token_level=token_level
    ).loss
    token_mask = t(TOKEN_MASK)
    shares = []
    for b in range(2):
        rows = slice(b, b + 1)
        masks = Masks.of(token_mask[rows], t([[1.0]])[0], torch.tensor(2.0), token_mask.sum())
        shares.append(
            clipped_value_loss(
                t(V_NOW)[rows],
                t(V_OLD)[rows],
                t(RETURNS)[rows],
                masks,
                scale=0.4,
                cliprange=0.2,
                token_level=token_level,
            ).loss
        )
    assert (shares[0] + shares[1]).item() == pytest.approx(whole.item(), rel=1e-7)
