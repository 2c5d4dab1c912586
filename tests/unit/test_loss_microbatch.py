"""Summing the shares a loss returns over micro-batches gives the whole-batch loss, metrics and gradients."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nemo_rl.algorithms.loss_functions import ClippedPGLossFn, DistillationLossFn, DPOLossFn, NLLLoss
from nemo_rl.config.loss import ClippedPGLossConfig, DistillationLossConfig, DPOLossConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

NUM_SEQS, SEQ_LEN, VOCAB = 6, 7, 5


def random_batch(seed: int) -> tuple[torch.Tensor, BatchedDataDict[Any]]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(NUM_SEQS, SEQ_LEN, VOCAB, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([7, 5, 6, 3, 7, 4])
    positions = torch.arange(SEQ_LEN)
    # Prompt of two tokens, response up to the sequence's length.
    token_mask = ((positions >= 2) & (positions < lengths[:, None])).float()
    sample_mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])

    def logprob_like() -> torch.Tensor:
        return -torch.rand(NUM_SEQS, SEQ_LEN, generator=gen, dtype=torch.float64) * 2

    data = BatchedDataDict(
        {
            "input_ids": torch.randint(0, VOCAB, (NUM_SEQS, SEQ_LEN), generator=gen),
            "input_lengths": lengths,
            "token_mask": token_mask,
            "sample_mask": sample_mask,
            "advantages": torch.randn(NUM_SEQS, 1, generator=gen, dtype=torch.float64)
            .expand(-1, SEQ_LEN)
            .clone(),
            "prev_logprobs": logprob_like(),
            "generation_logprobs": logprob_like(),
            "reference_policy_logprobs": logprob_like(),
        }
    )
    return logits.requires_grad_(True), data


def global_counts(data: BatchedDataDict[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = data["sample_mask"].sum()
    toks = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    return seqs, toks


def run_in_microbatches(
    loss_fn: Any, logits: torch.Tensor, data: BatchedDataDict[Any], microbatch_size: int
) -> tuple[float, dict[str, float]]:
    seqs, toks = global_counts(data)
    total_loss = 0.0
    reduced: dict[str, float] = {}
    start = 0
    for micro in data.make_microbatch_iterator(microbatch_size):
        end = start + micro.size
        loss, metrics = loss_fn(logits[start:end], micro, seqs, toks)
        loss.backward()
        total_loss += loss.item()
        for name, value in metrics.items():
            if name.endswith("_min"):
                reduced[name] = min(reduced.get(name, math.inf), value)
            elif name.endswith("_max"):
                reduced[name] = max(reduced.get(name, -math.inf), value)
            else:
                reduced[name] = reduced.get(name, 0.0) + value
        start = end
    return total_loss, reduced


PG_CONFIGS = {
    "grpo": ClippedPGLossConfig(),
    "sequence_level": ClippedPGLossConfig(token_level_loss=False, reference_policy_kl_type="k2"),
    "gspo": ClippedPGLossConfig(
        token_level_loss=False, sequence_level_importance_ratios=True, use_importance_sampling_correction=True
    ),
    "dual_clip_is_onpolicy_kl": ClippedPGLossConfig(
        ratio_clip_c=3.0,
        ratio_clip_max=0.28,
        use_importance_sampling_correction=True,
        use_on_policy_kl_approximation=True,
        truncated_importance_sampling_ratio=1.5,
        truncated_importance_sampling_ratio_min=0.5,
        truncated_importance_sampling_type="icepop",
    ),
    "reinforce": ClippedPGLossConfig(disable_ppo_ratio=True),
}


@pytest.mark.parametrize("name", list(PG_CONFIGS))
@pytest.mark.parametrize("microbatch_size", [1, 2, 4])
def test_clipped_pg_shares_add_up(name: str, microbatch_size: int) -> None:
    loss_fn = ClippedPGLossFn(PG_CONFIGS[name])
    logits, data = random_batch(seed=3)
    seqs, toks = global_counts(data)
    whole, whole_metrics = loss_fn(logits, data, seqs, toks)
    whole.backward()
    assert logits.grad is not None
    whole_grad = logits.grad.clone()
    logits.grad = None

    summed, summed_metrics = run_in_microbatches(loss_fn, logits, data, microbatch_size)
    assert summed == pytest.approx(whole.item(), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(logits.grad, whole_grad)
    assert set(summed_metrics) == set(whole_metrics)
    for metric, value in whole_metrics.items():
        assert summed_metrics[metric] == pytest.approx(value, rel=1e-6, abs=1e-9), metric
    assert whole_grad.abs().sum() > 0


def test_nll_shares_add_up() -> None:
    logits, data = random_batch(seed=5)
    seqs, toks = global_counts(data)
    whole, metrics = NLLLoss()(logits, data, seqs, toks)
    summed, summed_metrics = run_in_microbatches(NLLLoss(), logits, data, 4)
    assert summed == pytest.approx(whole.item(), rel=1e-9)
    assert summed_metrics["num_valid_tokens"] == metrics["num_valid_tokens"] == toks.item()


def test_dpo_shares_add_up() -> None:
    loss_fn = DPOLossFn(DPOLossConfig(sft_loss_weight=0.5, preference_average_log_probs=True))
    logits, data = random_batch(seed=7)
    seqs, toks = global_counts(data)
    whole, whole_metrics = loss_fn(logits, data, seqs, toks)
    summed, summed_metrics = run_in_microbatches(loss_fn, logits, data, 2)
    assert summed == pytest.approx(whole.item(), rel=1e-9)
    for metric, value in whole_metrics.items():
        assert summed_metrics[metric] == pytest.approx(value, rel=1e-6, abs=1e-9), metric


@pytest.mark.parametrize("zero_outside_topk", [False, True])
def test_distillation_shares_add_up(zero_outside_topk: bool) -> None:
    loss_fn = DistillationLossFn(DistillationLossConfig(zero_outside_topk=zero_outside_topk))
    logits, data = random_batch(seed=11)
    gen = torch.Generator().manual_seed(12)
    data["teacher_topk_logits"] = torch.randn(NUM_SEQS, SEQ_LEN, 3, generator=gen, dtype=torch.float64)
    data["teacher_topk_indices"] = torch.stack(
        [torch.randperm(VOCAB, generator=gen)[:3] for _ in range(NUM_SEQS * SEQ_LEN)]
    ).reshape(NUM_SEQS, SEQ_LEN, 3)
    seqs, toks = global_counts(data)
    whole, whole_metrics = loss_fn(logits, data, seqs, toks)
    summed, summed_metrics = run_in_microbatches(loss_fn, logits, data, 4)
    assert summed == pytest.approx(whole.item(), rel=1e-9)
    for metric, value in whole_metrics.items():
        assert summed_metrics[metric] == pytest.approx(value, rel=1e-6, abs=1e-9), metric
