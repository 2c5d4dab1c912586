"""DPOLossFn and PreferenceLoss against hand-computed values."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.interfaces import LossType
from nemo_rl.algorithms.loss_functions import DPOLossFn, PreferenceLoss
from nemo_rl.config.loss import DPOLossConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

# Two pairs (chosen, rejected, chosen, rejected), 4 positions, position 0 is the prompt.
CURR = [[0.0, -0.5, -1.0, -0.2], [0.0, -2.0, -0.1, -0.7], [0.0, -0.3, -0.3, -0.9], [0.0, -0.4, -1.2, -0.6]]
REF = [[0.0, -0.7, -1.5, -0.1], [0.0, -1.0, -0.2, -0.9], [0.0, -0.2, -0.8, -0.9], [0.0, -0.5, -0.5, -0.5]]
TOKEN_MASK = [[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]]


def make_batch(sample_mask: list[float]) -> tuple[torch.Tensor, BatchedDataDict[Any]]:
    """Two-symbol vocabulary, target symbol 0 everywhere, logits giving log p = CURR."""
    logits = torch.zeros(4, 4, 2, dtype=torch.float64)
    for b in range(4):
        for t in range(1, 4):
            p = math.exp(CURR[b][t])
            logits[b, t - 1, 0] = math.log(p)
            logits[b, t - 1, 1] = math.log(1 - p)
    data = BatchedDataDict(
        {
            "input_ids": torch.zeros(4, 4, dtype=torch.long),
            "token_mask": torch.tensor(TOKEN_MASK, dtype=torch.float32),
            "sample_mask": torch.tensor(sample_mask),
            "reference_policy_logprobs": torch.tensor(REF),
        }
    )
    return logits.requires_grad_(True), data


def tokens(b: int) -> list[int]:
    return [t for t in range(1, 4) if TOKEN_MASK[b][t]]


def reward(b: int, average: bool) -> float:
    total = sum(CURR[b][t] - REF[b][t] for t in tokens(b))
    return total / len(tokens(b)) if average else total


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize("average", [False, True])
def test_dpo_preference_term(average: bool) -> None:
    beta = 0.1
    loss_fn = DPOLossFn(DPOLossConfig(reference_policy_kl_penalty=beta, preference_average_log_probs=average))
    assert loss_fn.loss_type == LossType.SEQUENCE_LEVEL
    logits, data = make_batch([1.0, 1.0, 1.0, 1.0])
    loss, metrics = loss_fn(logits, data, torch.tensor(4.0), torch.tensor(10.0))
    margins = [reward(0, average) - reward(1, average), reward(2, average) - reward(3, average)]
    expected = sum(-log_sigmoid(beta * m) for m in margins) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["preference_loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(sum(m > 0 for m in margins) / 2)
    assert metrics["rewards_chosen_mean"] == pytest.approx(
        (reward(0, average) + reward(2, average)) / 2, rel=1e-6
    )
    assert metrics["rewards_rejected_mean"] == pytest.approx(
        (reward(1, average) + reward(3, average)) / 2, rel=1e-6
    )
    assert metrics["sft_loss"] == pytest.approx(
        -sum(CURR[0][t] for t in tokens(0)) / 2 - sum(CURR[2][t] for t in tokens(2)) / 2, rel=1e-6
    )
    assert metrics["num_valid_samples"] == 2


def test_dpo_sft_term_and_invalid_pairs() -> None:
    cfg = DPOLossConfig(
        reference_policy_kl_penalty=0.5,
        preference_loss_weight=2.0,
        sft_loss_weight=0.3,
        sft_average_log_probs=True,
    )
    # The second pair is masked out (its chosen row's sample_mask is 0); the global batch has 3 pairs.
    logits, data = make_batch([1.0, 1.0, 0.0, 0.0])
    loss, metrics = DPOLossFn(cfg)(logits, data, torch.tensor(6.0), torch.tensor(10.0))
    pref = -log_sigmoid(0.5 * (reward(0, False) - reward(1, False))) / 3
    sft = -sum(CURR[0][t] for t in tokens(0)) / len(tokens(0)) / 3
    assert metrics["preference_loss"] == pytest.approx(pref, rel=1e-6)
    assert metrics["sft_loss"] == pytest.approx(sft, rel=1e-6)
    assert loss.item() == pytest.approx(2.0 * pref + 0.3 * sft, rel=1e-6)
    loss.backward()
    assert logits.grad is not None
    assert logits.grad[2:].abs().sum() == 0  # nothing flows into the masked pair


def test_dpo_rejects_odd_batches() -> None:
    logits, data = make_batch([1.0, 1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="even"):
        DPOLossFn(DPOLossConfig())(logits[:3], data.slice(0, 3), torch.tensor(3.0), torch.tensor(6.0))


def test_preference_loss_on_rewards() -> None:
    rewards = torch.tensor([[1.5], [0.5], [-0.2], [0.3]], requires_grad=True)
    data = BatchedDataDict({"sample_mask": torch.ones(4)})
    loss, metrics = PreferenceLoss()(rewards, data, torch.tensor(4.0), torch.tensor(0.0))
    expected = (-log_sigmoid(1.0) - log_sigmoid(-0.5)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(0.5)
    assert metrics["rewards_chosen_mean"] == pytest.approx((1.5 - 0.2) / 2, rel=1e-6)
    assert metrics["rewards_rejected_mean"] == pytest.approx((0.5 + 0.3) / 2, rel=1e-6)


@pytest.mark.parametrize("average", [False, True])
def test_dpo_gradients_match_hand_derivation(average: bool) -> None:
    # d loss / d logit of the target symbol at a trained position t of row b is coef_bt * (1 - p_bt), and
    # -coef_bt * (1 - p_bt) for the other symbol, where coef_bt = d loss / d log p_bt:
    #   preference: -+ w_p * beta * sigmoid(-beta * margin) / pairs   (chosen -, rejected +), / n_b if averaged
    #   sft:        -w_s / pairs on chosen rows, / n_b if averaged.
    beta, w_p, w_s = 0.3, 1.5, 0.4
    cfg = DPOLossConfig(
        reference_policy_kl_penalty=beta,
        preference_loss_weight=w_p,
        sft_loss_weight=w_s,
        preference_average_log_probs=average,
        sft_average_log_probs=average,
    )
    logits, data = make_batch([1.0, 1.0, 1.0, 1.0])
    pairs = 2.0
    loss, _ = DPOLossFn(cfg)(logits, data, torch.tensor(2 * pairs), torch.tensor(10.0))
    loss.backward()
    assert logits.grad is not None
    expected = torch.zeros_like(logits)
    for pair in range(2):
        chosen, rejected = 2 * pair, 2 * pair + 1
        margin = reward(chosen, average) - reward(rejected, average)
        pref = w_p * beta * (1 / (1 + math.exp(beta * margin))) / pairs
        for b, sign in ((chosen, -1.0), (rejected, 1.0)):
            scale = 1 / len(tokens(b)) if average else 1.0
            for t in tokens(b):
                coef = sign * pref * scale + (-w_s / pairs * scale if b == chosen else 0.0)
                p = math.exp(CURR[b][t])
                expected[b, t - 1, 0] = coef * (1 - p)
                expected[b, t - 1, 1] = -coef * (1 - p)
    torch.testing.assert_close(logits.grad, expected, rtol=1e-6, atol=1e-9)
