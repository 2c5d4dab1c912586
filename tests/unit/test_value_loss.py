"""ValueLossFn, the adapter that trains PPO's critic, against hand-computed numbers.

The model output is the value head at every position, ``head_BT``; the loss reads ``head_BT[:, :-1]``
against ``returns`` / ``old_values`` sliced ``[:, 1:]`` (both aligned with the tokens, as ``get_values``
returns them). Every expected number below is worked out per token in the comments.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nemo_rl.algorithms.loss_functions import PreferenceLoss, ValueLossFn
from nemo_rl.algorithms.losses import explained_variance
from nemo_rl.config.loss import ValueLossConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.worker_base import token_values

# Two rows of 4 positions. The head at position t - 1 is the value of token t; the last column (9.0) is the
# value after the whole sequence, which no token is scored against.
HEAD = [[0.5, 1.0, -0.3, 9.0], [0.2, 0.0, 0.7, 9.0]]
# Aligned with the tokens; position 0 (the first prompt token, never chosen by the policy) is never read.
RETURNS = [[7.0, 1.2, 0.0, 5.0], [7.0, -0.5, 0.1, 0.4]]
OLD_VALUES = [[7.0, 0.0, 0.3, 0.0], [7.0, 0.1, -0.4, 0.6]]
TOKEN_MASK = [[0, 1, 1, 0], [0, 1, 1, 1]]
SCALE, CLIP = 0.5, 0.2
# Per trained token (row, t): V = HEAD[row][t - 1], R = RETURNS[row][t], O = OLD_VALUES[row][t];
# clipped value = clamp(V, O - 0.2, O + 0.2); the token's term is max((V - R)^2, (clipped - R)^2).
#   (0, 1): V 0.5,  R 1.2,  O 0.0:  (-0.7)^2 = 0.49, clamp -> 0.2:  (-1.0)^2 = 1.00  -> 1.00, clipped
#   (0, 2): V 1.0,  R 0.0,  O 0.3:  1.0^2 = 1.00,    clamp -> 0.5:  0.5^2 = 0.25     -> 1.00
#   (1, 1): V 0.2,  R -0.5, O 0.1:  0.7^2 = 0.49,    clamp -> 0.2:  same             -> 0.49
#   (1, 2): V 0.0,  R 0.1,  O -0.4: (-0.1)^2 = 0.01, clamp -> -0.2: (-0.3)^2 = 0.09  -> 0.09, clipped
#   (1, 3): V 0.7,  R 0.4,  O 0.6:  0.3^2 = 0.09,    clamp -> 0.7:  same             -> 0.09
# (0, 3) is masked out: its V -0.3 against R 5.0 would dominate the loss.
TERMS = [1.00, 1.00, 0.49, 0.09, 0.09]
UNCLIPPED_TERMS = [0.49, 1.00, 0.49, 0.01, 0.09]
VALUES = [0.5, 1.0, 0.2, 0.0, 0.7]
TARGETS = [1.2, 0.0, -0.5, 0.1, 0.4]


def batch(sample_mask: tuple[float, float] = (1.0, 1.0), **keys: Any) -> BatchedDataDict[Any]:
    data: dict[str, Any] = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "input_lengths": torch.tensor([4, 4]),
        "token_mask": torch.tensor(TOKEN_MASK, dtype=torch.float32),
        "sample_mask": torch.tensor(sample_mask),
        "returns": torch.tensor(RETURNS),
        "old_values": torch.tensor(OLD_VALUES),
    }
    return BatchedDataDict(data | keys)


def value_loss(
    head: list[list[float]] | torch.Tensor,
    data: BatchedDataDict[Any],
    cliprange: float | None = CLIP,
    global_valid_toks: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of the whole batch (or a micro-batch's share of ``global_valid_toks`` tokens)."""
    head_BT = head if isinstance(head, torch.Tensor) else torch.tensor(head)
    mask_BS = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    toks = mask_BS.sum() if global_valid_toks is None else torch.tensor(global_valid_toks)
    loss_fn = ValueLossFn(ValueLossConfig(scale=SCALE, cliprange=cliprange))
    return loss_fn(head_BT, data, data["sample_mask"].sum(), toks)


def test_clipped_loss_and_metrics_by_hand() -> None:
    loss, metrics = value_loss(HEAD, batch())
    expected_loss = 0.5 * SCALE * sum(TERMS) / 5  # 0.25 * 2.67 / 5
    assert loss.item() == pytest.approx(0.1335, rel=1e-6) == expected_loss
    assert metrics["loss"] == pytest.approx(0.1335, rel=1e-6)
    assert metrics["vf_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["values_mean"] == pytest.approx(sum(VALUES) / 5)  # 0.48
    assert metrics["returns_mean"] == pytest.approx(sum(TARGETS) / 5)  # 0.24
    assert (metrics["values_min"], metrics["values_max"]) == pytest.approx((0.0, 1.0))
    assert metrics["returns_sq_mean"] == pytest.approx(sum(r * r for r in TARGETS) / 5)  # 0.372
    assert metrics["residual_sq_mean"] == pytest.approx(sum(UNCLIPPED_TERMS) / 5)  # 0.416
    assert metrics["num_valid_samples"] == 2
    # 1 - (0.416 - (0.24 - 0.48)^2) / (0.372 - 0.24^2) = 1 - 0.3584 / 0.3144
    shares = (metrics[k] for k in ("returns_mean", "values_mean", "returns_sq_mean", "residual_sq_mean"))
    assert explained_variance(*shares) == pytest.approx(1 - 0.3584 / 0.3144, rel=1e-5)


@pytest.mark.parametrize("cliprange", [None, 0.0])
def test_without_a_cliprange_the_loss_is_half_the_squared_error(cliprange: float | None) -> None:
    loss, metrics = value_loss(HEAD, batch(), cliprange=cliprange)
    assert loss.item() == pytest.approx(0.5 * SCALE * sum(UNCLIPPED_TERMS) / 5, rel=1e-6)  # 0.104
    assert metrics["vf_clipfrac"] == 0.0


def test_gradient_flows_only_through_unclipped_trained_tokens() -> None:
    head = torch.tensor(HEAD, requires_grad=True)
    value_loss(head, batch())[0].backward()
    # d/dV of 0.25 * (V - R)^2 / 5 is 0.1 * (V - R) at the unclipped tokens (0, 2), (1, 1) and (1, 3),
    # whose values sit at head positions (0, 1), (1, 0) and (1, 2); clipped and masked tokens give none,
    # nor does the last column.
    expected = torch.zeros(2, 4)
    expected[0, 1], expected[1, 0], expected[1, 2] = 0.1 * 1.0, 0.1 * 0.7, 0.1 * 0.3
    assert head.grad is not None
    torch.testing.assert_close(head.grad, expected, rtol=1e-6, atol=1e-7)


def test_alignment_reads_head_before_each_token() -> None:
    base, _ = value_loss(HEAD, batch())
    # Unread inputs change nothing: the head after the last token, and targets at position 0.
    moved_head = [[*row[:-1], -100.0] for row in HEAD]
    returns, old_values = torch.tensor(RETURNS), torch.tensor(OLD_VALUES)
    returns[:, 0], old_values[:, 0] = -3.0, 40.0
    assert value_loss(moved_head, batch(returns=returns, old_values=old_values))[0].item() == base.item()
    # Values as get_values returns them (aligned with the tokens) are the rollout's values of a critic that
    # has not moved since: nothing is clipped, the loss is the plain half squared error.
    rollout_values = token_values(torch.tensor(HEAD), torch.tensor([4, 4]))
    loss, metrics = value_loss(HEAD, batch(old_values=rollout_values))
    assert metrics["vf_clipfrac"] == 0.0
    assert loss.item() == pytest.approx(0.5 * SCALE * sum(UNCLIPPED_TERMS) / 5, rel=1e-6)


def test_masked_rows_and_tokens_are_left_out() -> None:
    # Row 1 dropped by its sample mask: row 0's two trained tokens (1.00 and 1.00) remain.
    loss, metrics = value_loss(HEAD, batch(sample_mask=(1.0, 0.0)))
    assert loss.item() == pytest.approx(0.5 * SCALE * 2.0 / 2)
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 2) and metrics["num_valid_samples"] == 1
    # A masked token's value and target can be anything.
    wild = [row[:] for row in HEAD]
    wild[0][2] = 1e6
    assert value_loss(wild, batch())[0].item() == value_loss(HEAD, batch())[0].item()


def test_micro_batch_shares_sum_to_the_whole_batch() -> None:
    whole, whole_metrics = value_loss(HEAD, batch())
    shares = [value_loss([HEAD[row]], batch().slice(row, row + 1), global_valid_toks=5.0) for row in (0, 1)]
    assert sum(loss.item() for loss, _ in shares) == pytest.approx(whole.item(), rel=1e-6)
    for key in ("vf_clipfrac", "values_mean", "returns_mean", "residual_sq_mean"):
        assert sum(m[key] for _, m in shares) == pytest.approx(whole_metrics[key], rel=1e-6)


def test_scalar_heads_of_the_other_kind_are_refused_in_one_line() -> None:
    # A Bradley-Terry reward model's [B] / [B, 1] rewards given to the value loss, and a value model's
    # per-token head given to the reward model's preference loss.
    for rewards in (torch.zeros(2), torch.zeros(2, 1)):
        with pytest.raises(ValueError, match="reward_model_type=regression") as error:
            value_loss(rewards, batch())
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="reward_model_type=bradley_terry") as error:
        PreferenceLoss()(torch.tensor(HEAD), batch(), torch.tensor(2.0), torch.tensor(5.0))
    assert "\n" not in str(error.value)
