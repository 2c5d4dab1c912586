"""DistillationLossFn against per-token KLs written out by hand."""

from __future__ import annotations

import math
from typing import Any, Literal

import pytest
import torch

from nemo_rl.algorithms.loss_functions import DistillationLossFn
from nemo_rl.config.loss import DistillationLossConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

# One sequence of 3 positions over a vocabulary of 4; the teacher gives its top-2 per position.
STUDENT = [[0.5, -1.0, 2.0, 0.0], [1.0, 1.0, -0.5, 0.3], [0.0, 0.0, 0.0, 0.0]]
TEACHER_TOPK = [[3.0, 1.0], [0.2, -0.4], [0.0, 0.0]]
TEACHER_IDX = [[2, 0], [3, 1], [0, 1]]
TOKEN_MASK = [0, 1, 1]  # both next-token predictions (rows 0 and 1) are trained on


def make() -> tuple[torch.Tensor, BatchedDataDict[Any]]:
    logits = torch.tensor([STUDENT], dtype=torch.float64, requires_grad=True)
    data = BatchedDataDict(
        {
            "input_ids": torch.zeros(1, 3, dtype=torch.long),
            "token_mask": torch.tensor([TOKEN_MASK], dtype=torch.float32),
            "sample_mask": torch.ones(1),
            "teacher_topk_logits": torch.tensor([TEACHER_TOPK], dtype=torch.float64),
            "teacher_topk_indices": torch.tensor([TEACHER_IDX]),
        }
    )
    return logits, data


def log_softmax(xs: list[float]) -> list[float]:
    norm = math.log(sum(math.exp(x) for x in xs))
    return [x - norm for x in xs]


def per_position(row: int, kl_type: str, weight: float, zero_outside: bool) -> float:
    p = log_softmax(TEACHER_TOPK[row])
    full_q = log_softmax(STUDENT[row])
    idx = TEACHER_IDX[row]
    q = [full_q[i] for i in idx] if zero_outside else log_softmax([STUDENT[row][i] for i in idx])
    forward = sum(math.exp(pk) * (pk - qk) for pk, qk in zip(p, q, strict=True))
    reverse = sum(math.exp(qk) * (qk - pk) for pk, qk in zip(p, q, strict=True))
    if zero_outside:
        # The teacher's log-prob outside its top-k is -100.
        reverse += sum(math.exp(full_q[v]) * (full_q[v] + 100.0) for v in range(4) if v not in idx)
    return {"forward": forward, "reverse": reverse, "mixed": weight * forward + (1 - weight) * reverse}[
        kl_type
    ]


@pytest.mark.parametrize("zero_outside", [False, True])
@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_distillation_kl(kl_type: Literal["forward", "reverse", "mixed"], zero_outside: bool) -> None:
    cfg = DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=0.3, zero_outside_topk=zero_outside)
    logits, data = make()
    loss, metrics = DistillationLossFn(cfg)(logits, data, torch.tensor(1.0), torch.tensor(4.0))
    expected = sum(per_position(r, kl_type, 0.3, zero_outside) for r in (0, 1)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-7)
    assert metrics["num_valid_tokens"] == 2
    loss.backward()
    assert logits.grad is not None
    assert logits.grad[0, 2].abs().sum() == 0  # the last row predicts nothing
    if not zero_outside:
        # Renormalised over the top-k, tokens outside it get no gradient.
        assert logits.grad[0, 0, [1, 3]].abs().sum() == 0


def test_defaults_and_identical_distributions() -> None:
    cfg = DistillationLossConfig()
    assert (cfg.kl_type, cfg.mixed_kl_weight, cfg.zero_outside_topk) == ("mixed", 0.5, False)
    logits, data = make()
    # A teacher equal to the student on its top-k gives zero KL.
    data["teacher_topk_logits"] = logits.detach().gather(-1, data["teacher_topk_indices"]).float()
    loss, _ = DistillationLossFn(cfg)(logits, data, torch.tensor(1.0), torch.tensor(2.0))
    assert loss.item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("zero_outside", [False, True])
@pytest.mark.parametrize("kl_type", ["forward", "reverse", "mixed"])
def test_full_vocabulary_top_k_is_the_exact_kl(
    kl_type: Literal["forward", "reverse", "mixed"], zero_outside: bool
) -> None:
    # With k = vocabulary size the top-k support is everything: the loss must be the exact KL between the two
    # full next-token distributions, averaged over the trained tokens of the global batch.
    torch.manual_seed(0)
    B, T, V = 3, 5, 11
    student_BTV = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    teacher_BTV = 2.0 * torch.randn(B, T, V, dtype=torch.float64)
    teacher_vals_BTV, teacher_idx_BTV = teacher_BTV.topk(V, dim=-1)  # every token, in the teacher's order
    token_mask_BT = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.float64)
    sample_mask_B = torch.tensor([1.0, 0.0, 1.0])
    data = BatchedDataDict(
        {
            "input_ids": torch.zeros(B, T, dtype=torch.long),
            "token_mask": token_mask_BT,
            "sample_mask": sample_mask_B,
            "teacher_topk_logits": teacher_vals_BTV,
            "teacher_topk_indices": teacher_idx_BTV,
        }
    )
    cfg = DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=0.7, zero_outside_topk=zero_outside)
    global_valid_toks = torch.tensor(9.0)  # as if other micro-batches held more tokens
    loss, metrics = DistillationLossFn(cfg)(student_BTV, data, torch.tensor(3.0), global_valid_toks)

    p_BSV = torch.log_softmax(teacher_BTV[:, :-1], dim=-1)
    q_BSV = torch.log_softmax(student_BTV[:, :-1], dim=-1)
    forward_BS = torch.nn.functional.kl_div(q_BSV, p_BSV, log_target=True, reduction="none").sum(-1)
    reverse_BS = torch.nn.functional.kl_div(p_BSV, q_BSV, log_target=True, reduction="none").sum(-1)
    kl_BS = {"forward": forward_BS, "reverse": reverse_BS, "mixed": 0.7 * forward_BS + 0.3 * reverse_BS}[
        kl_type
    ]
    mask_BS = token_mask_BT[:, 1:] * sample_mask_B[:, None]
    expected = (kl_BS * mask_BS).sum() / global_valid_toks
    assert loss.item() == pytest.approx(expected.item(), rel=1e-7)
    assert metrics["forward_kl"] == pytest.approx(((forward_BS * mask_BS).sum() / 9.0).item(), rel=1e-7)
    assert metrics["reverse_kl"] == pytest.approx(((reverse_BS * mask_BS).sum() / 9.0).item(), rel=1e-7)
    # And so are its gradients.
    (grad,) = torch.autograd.grad(loss, student_BTV)
    (expected_grad,) = torch.autograd.grad(expected, student_BTV)
    # (torch.testing.assert_close would import torch.distributed.tensor: seconds on a busy machine.)
    assert float((grad - expected_grad).abs().max()) < 1e-9
