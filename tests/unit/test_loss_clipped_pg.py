"""ClippedPGLossFn and NLLLoss against hand-computed values, one option at a time.

Batches are built so that the current policy's log-prob of every target token is a chosen number: the
vocabulary has two symbols, every target is symbol 0, and the logits row predicting position t is
``[log p_t, log(1 - p_t)]``. Expected values are written out per token with ``math`` in plain Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from nemo_rl.algorithms.interfaces import LossFunction, LossType
from nemo_rl.algorithms.loss_functions import ClippedPGLossFn, DPOLossFn, NLLLoss
from nemo_rl.algorithms.utils import next_token_logprobs
from nemo_rl.config.loss import ClippedPGLossConfig, DPOLossConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

Rows = Sequence[Sequence[float]]

# Two sequences of 4 positions: position 0 is the prompt (never trained on), positions 1..3 are responses.
CURR: Rows = [[0.0, -0.5, -1.0, -0.2], [0.0, -2.0, -0.1, -0.7]]
PREV: Rows = [[0.0, -0.9, -0.8, -0.2], [0.0, -1.0, -0.4, -0.3]]
GEN: Rows = [[0.0, -1.0, -0.6, -0.3], [0.0, -1.2, -0.5, -0.3]]
REF: Rows = [[0.0, -0.7, -1.5, -0.1], [0.0, -0.3, -0.2, -1.9]]
ADV: Rows = [[0.0, 1.0, 1.0, 1.0], [0.0, -2.0, -2.0, -2.0]]
TOKEN_MASK: Rows = [[0, 1, 1, 0], [0, 1, 1, 1]]
SAMPLE_MASK = [1.0, 1.0]


def make_batch(
    curr: Rows = CURR,
    prev: Rows = PREV,
    gen: Rows = GEN,
    ref: Rows = REF,
    adv: Rows = ADV,
    token_mask: Rows = TOKEN_MASK,
    sample_mask: Sequence[float] = SAMPLE_MASK,
) -> tuple[torch.Tensor, BatchedDataDict[Any]]:
    """Logits giving log p(target at t) = curr[b][t] for t >= 1, and the matching batch."""
    num_seqs, seq_len = len(curr), len(curr[0])
    logits = torch.zeros(num_seqs, seq_len, 2, dtype=torch.float64)
    for b in range(num_seqs):
        for t in range(1, seq_len):
            p = math.exp(curr[b][t])
            # p == 1 would need log(0); nudge it, the tests never train on such a token.
            logits[b, t - 1, 0] = math.log(p)
            logits[b, t - 1, 1] = math.log(max(1.0 - p, 1e-12))
    data = BatchedDataDict(
        {
            "input_ids": torch.zeros(num_seqs, seq_len, dtype=torch.long),
            "input_lengths": torch.full((num_seqs,), seq_len, dtype=torch.long),
            "token_mask": torch.tensor(token_mask, dtype=torch.float32),
            "sample_mask": torch.tensor(sample_mask, dtype=torch.float32),
            "advantages": torch.tensor(adv, dtype=torch.float32),
            "prev_logprobs": torch.tensor(prev, dtype=torch.float32),
            "generation_logprobs": torch.tensor(gen, dtype=torch.float32),
            "reference_policy_logprobs": torch.tensor(ref, dtype=torch.float32),
        }
    )
    return logits.float().requires_grad_(True), data


def valid_positions(
    token_mask: Rows = TOKEN_MASK, sample_mask: Sequence[float] = SAMPLE_MASK
) -> list[tuple[int, int]]:
    return [
        (b, t)
        for b in range(len(token_mask))
        for t in range(1, len(token_mask[0]))
        if token_mask[b][t] and sample_mask[b]
    ]


def ppo_token(a: float, r: float, lo: float, hi: float, c: float | None = None) -> float:
    """max(-A r, -A clip(r)), then the dual clip for negative advantages."""
    clipped = min(max(r, 1 - lo), 1 + hi)
    value = max(-a * r, -a * clipped)
    if c is not None and a < 0:
        value = min(value, -a * c)
    return value


def k3(logp: float, logp_ref: float) -> float:
    log_r = logp_ref - logp
    return math.exp(log_r) - 1 - log_r


def run(
    cfg: ClippedPGLossConfig, *, seqs: float = 2.0, toks: float | None = None, **batch: Any
) -> tuple[float, dict[str, float]]:
    logits, data = make_batch(**batch)
    if toks is None:
        toks = float(
            sum(data["token_mask"][b, 1:].sum().item() * data["sample_mask"][b].item() for b in range(2))
        )
    loss, metrics = ClippedPGLossFn(cfg)(logits, data, torch.tensor(seqs), torch.tensor(toks))
    return loss.item(), metrics


def cfg(**kwargs: Any) -> ClippedPGLossConfig:
    # The KL term is off unless a test turns it on, so each test isolates one option.
    return ClippedPGLossConfig(**{"reference_policy_kl_penalty": 0.0, **kwargs})


def test_losses_satisfy_the_protocol() -> None:
    # Checked by mypy as well: these assignments only type-check if the classes match LossFunction.
    losses: list[LossFunction] = [
        ClippedPGLossFn(ClippedPGLossConfig()),
        NLLLoss(),
        DPOLossFn(DPOLossConfig()),
    ]
    assert all(callable(fn) and isinstance(fn.loss_type, LossType) for fn in losses)


def test_defaults_match_nemo_rl() -> None:
    c = ClippedPGLossConfig()
    assert c.reference_policy_kl_penalty == 0.01
    assert c.ratio_clip_min == c.ratio_clip_max == 0.2
    assert c.ratio_clip_c is None
    assert c.reference_policy_kl_type == "k3"
    assert (c.kl_input_clamp_value, c.kl_output_clamp_value) == (20.0, 10.0)
    assert c.token_level_loss is True
    assert not (
        c.use_on_policy_kl_approximation
        or c.use_importance_sampling_correction
        or c.sequence_level_importance_ratios
        or c.disable_ppo_ratio
    )
    assert ClippedPGLossFn(c).loss_type == LossType.TOKEN_LEVEL
    assert ClippedPGLossFn(ClippedPGLossConfig(token_level_loss=False)).loss_type == LossType.SEQUENCE_LEVEL


def test_symmetric_clip_token_level() -> None:
    loss, metrics = run(cfg())
    positions = valid_positions()
    expected = sum(
        ppo_token(ADV[b][t], math.exp(CURR[b][t] - PREV[b][t]), 0.2, 0.2) for b, t in positions
    ) / len(positions)
    assert loss == pytest.approx(expected, rel=1e-5)
    # Clipped: r = e^0.4 > 1.2 with A > 0, and r = e^-1, e^-0.4 < 0.8 with A < 0. Not clipped:
    # r = e^-0.2 (inside), and r = e^0.3 > 1.2 with A < 0 (the unclipped branch is the pessimistic one).
    assert metrics["clipped_fraction"] == pytest.approx(3 / 5)
    ratios = [math.exp(CURR[b][t] - PREV[b][t]) for b, t in positions]
    assert metrics["probs_ratio"] == pytest.approx(sum(ratios) / 5, rel=1e-5)
    assert metrics["probs_ratio_min"] == pytest.approx(min(ratios), rel=1e-5)
    assert metrics["probs_ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    clamped = [min(max(r, 0.8), 1.2) for r in ratios]
    assert metrics["probs_ratio_clamped"] == pytest.approx(sum(clamped) / 5, rel=1e-5)
    assert metrics["probs_ratio_clamped_max"] == pytest.approx(1.2, rel=1e-5)
    assert metrics["num_valid_samples"] == 2
    assert metrics["num_valid_tokens"] == 5
    assert metrics["kl_penalty"] == 0.0


def test_asymmetric_clip() -> None:
    loss, _ = run(cfg(ratio_clip_min=0.1, ratio_clip_max=0.5))
    positions = valid_positions()
    expected = sum(
        ppo_token(ADV[b][t], math.exp(CURR[b][t] - PREV[b][t]), 0.1, 0.5) for b, t in positions
    ) / len(positions)
    assert loss == pytest.approx(expected, rel=1e-5)
    # Same data, wider upper clip: a different value, so the two bounds really are separate.
    assert loss != pytest.approx(run(cfg())[0], rel=1e-3)


def test_dual_clip_caps_negative_advantage_tokens() -> None:
    # Ratios e^2 = 7.4 and e^1 = 2.7 with negative advantages: dual clip c = 3 caps the first only.
    curr = [[0.0, -0.5, -1.0, -0.2], [0.0, -0.1, -0.1, -0.7]]
    prev = [[0.0, -0.9, -0.8, -0.2], [0.0, -2.1, -1.1, -0.3]]
    loss, metrics = run(cfg(ratio_clip_c=3.0), curr=curr, prev=prev)
    positions = valid_positions()
    expected = sum(
        ppo_token(ADV[b][t], math.exp(curr[b][t] - prev[b][t]), 0.2, 0.2, 3.0) for b, t in positions
    )
    assert loss == pytest.approx(expected / 5, rel=1e-5)
    without = sum(ppo_token(ADV[b][t], math.exp(curr[b][t] - prev[b][t]), 0.2, 0.2) for b, t in positions)
    assert expected < without  # the cap bites on this data
    assert metrics["dual_clipped_fraction"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_kl_penalty_types(kl_type: str) -> None:
    beta = 0.5
    loss, metrics = run(cfg(reference_policy_kl_penalty=beta, reference_policy_kl_type=kl_type))
    pg_only, _ = run(cfg())
    positions = valid_positions()

    def kl(b: int, t: int) -> float:
        log_r = REF[b][t] - CURR[b][t]
        return {"k1": -log_r, "k2": log_r**2 / 2, "k3": math.exp(log_r) - 1 - log_r}[kl_type]

    expected_kl = sum(kl(b, t) for b, t in positions) / len(positions)
    assert metrics["kl_penalty"] == pytest.approx(expected_kl, rel=1e-5)
    assert loss == pytest.approx(pg_only + beta * expected_kl, rel=1e-5)


def test_kl_clamps() -> None:
    # log r = ref - curr is -0.2, -0.5, 1.7, -0.1, -1.2 on the valid tokens: clamping at 0.5 bites twice.
    _, metrics = run(
        cfg(reference_policy_kl_penalty=1.0, kl_input_clamp_value=0.5, kl_output_clamp_value=None)
    )
    positions = valid_positions()

    def k3_in_clamped(b: int, t: int) -> float:
        log_r = min(max(REF[b][t] - CURR[b][t], -0.5), 0.5)
        return math.exp(log_r) - 1 - log_r

    assert metrics["kl_penalty"] == pytest.approx(
        sum(k3_in_clamped(b, t) for b, t in positions) / 5, rel=1e-5
    )

    _, metrics = run(
        cfg(reference_policy_kl_penalty=1.0, kl_input_clamp_value=None, kl_output_clamp_value=0.1)
    )
    expected = sum(min(k3(CURR[b][t], REF[b][t]), 0.1) for b, t in positions) / 5
    assert metrics["kl_penalty"] == pytest.approx(expected, rel=1e-5)


def test_on_policy_kl_approximation() -> None:
    _, metrics = run(cfg(reference_policy_kl_penalty=1.0, use_on_policy_kl_approximation=True))
    positions = valid_positions()
    expected = sum(math.exp(CURR[b][t] - GEN[b][t]) * k3(CURR[b][t], REF[b][t]) for b, t in positions) / 5
    assert metrics["kl_penalty"] == pytest.approx(expected, rel=1e-5)


def test_importance_sampling_correction() -> None:
    loss, metrics = run(cfg(use_importance_sampling_correction=True))
    positions = valid_positions()
    weights = {(b, t): math.exp(PREV[b][t] - GEN[b][t]) for b, t in positions}
    expected = sum(
        weights[b, t] * ppo_token(ADV[b][t], math.exp(CURR[b][t] - PREV[b][t]), 0.2, 0.2)
        for b, t in positions
    )
    assert loss == pytest.approx(expected / 5, rel=1e-5)
    assert metrics["sampling_importance_ratio"] == pytest.approx(sum(weights.values()) / 5, rel=1e-5)


def test_truncated_importance_sampling() -> None:
    positions = valid_positions()
    weights = {(b, t): math.exp(PREV[b][t] - GEN[b][t]) for b, t in positions}
    pg = {(b, t): ppo_token(ADV[b][t], math.exp(CURR[b][t] - PREV[b][t]), 0.2, 0.2) for b, t in positions}

    loss, _ = run(cfg(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=1.05))
    assert loss == pytest.approx(sum(min(weights[p], 1.05) * pg[p] for p in positions) / 5, rel=1e-5)

    loss, metrics = run(
        cfg(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_ratio=1.15,
            truncated_importance_sampling_ratio_min=0.9,
            truncated_importance_sampling_type="icepop",
        )
    )
    kept = [p for p in positions if 0.9 <= weights[p] <= 1.15]
    assert 0 < len(kept) < len(positions)  # the filter bites on this data
    assert loss == pytest.approx(sum(weights[p] * pg[p] for p in kept) / 5, rel=1e-5)
    assert metrics["is_oob_ratio"] == pytest.approx(1 - len(kept) / 5)

    # Sequence 0's geometric-mean weight is e^((0.1 - 0.2) / 2) = 0.95, sequence 1's is e^(0.3 / 3) = 1.105.
    loss, metrics = run(
        cfg(
            use_importance_sampling_correction=True,
            truncated_importance_sampling_ratio=1.1,
            truncated_importance_sampling_ratio_min=0.9,
            truncated_importance_sampling_type="seq-mask-tis",
        )
    )
    assert loss == pytest.approx(sum(weights[p] * pg[p] for p in positions if p[0] == 0) / 5, rel=1e-5)
    assert metrics["is_oob_ratio"] == pytest.approx(0.5)


def test_sequence_level_loss_averages_per_sequence_first() -> None:
    loss, _ = run(cfg(token_level_loss=False))
    per_seq = []
    for b in range(2):
        tokens = [t for bb, t in valid_positions() if bb == b]
        per_seq.append(
            sum(ppo_token(ADV[b][t], math.exp(CURR[b][t] - PREV[b][t]), 0.2, 0.2) for t in tokens)
            / len(tokens)
        )
    assert loss == pytest.approx(sum(per_seq) / 2, rel=1e-5)


def test_gspo_sequence_level_ratios() -> None:
    loss, metrics = run(cfg(token_level_loss=False, sequence_level_importance_ratios=True))
    per_seq = []
    seq_ratios = []
    for b in range(2):
        tokens = [t for bb, t in valid_positions() if bb == b]
        ratio = math.exp(sum(CURR[b][t] - PREV[b][t] for t in tokens) / len(tokens))
        seq_ratios.append(ratio)
        per_seq.append(sum(ppo_token(ADV[b][t], ratio, 0.2, 0.2) for t in tokens) / len(tokens))
    assert loss == pytest.approx(sum(per_seq) / 2, rel=1e-5)
    assert metrics["probs_ratio_max"] == pytest.approx(max(seq_ratios), rel=1e-5)

    # With the importance-sampling correction each sequence is weighted by exp(sum(prev - gen)).
    loss, _ = run(
        cfg(
            token_level_loss=False,
            sequence_level_importance_ratios=True,
            use_importance_sampling_correction=True,
        )
    )
    weights = [
        math.exp(sum(PREV[b][t] - GEN[b][t] for bb, t in valid_positions() if bb == b)) for b in range(2)
    ]
    assert loss == pytest.approx(sum(w * s for w, s in zip(weights, per_seq, strict=True)) / 2, rel=1e-5)


def test_disable_ppo_ratio_is_reinforce() -> None:
    loss, _ = run(cfg(disable_ppo_ratio=True))
    expected = sum(-ADV[b][t] * CURR[b][t] for b, t in valid_positions()) / 5
    assert loss == pytest.approx(expected, rel=1e-5)


def test_force_on_policy_ratio_has_ratio_one_and_reinforce_gradient() -> None:
    logits, data = make_batch()
    loss, metrics = ClippedPGLossFn(cfg(force_on_policy_ratio=True))(
        logits, data, torch.tensor(2.0), torch.tensor(5.0)
    )
    assert loss.item() == pytest.approx(sum(-ADV[b][t] for b, t in valid_positions()) / 5, rel=1e-6)
    assert metrics["probs_ratio_min"] == metrics["probs_ratio_max"] == pytest.approx(1.0)
    loss.backward()
    assert logits.grad is not None
    forced_grad = logits.grad.clone()

    logits2, data2 = make_batch()
    reinforce, _ = ClippedPGLossFn(cfg(disable_ppo_ratio=True))(
        logits2, data2, torch.tensor(2.0), torch.tensor(5.0)
    )
    reinforce.backward()
    assert logits2.grad is not None
    torch.testing.assert_close(forced_grad, logits2.grad)


def test_off_policy_metrics() -> None:
    _, metrics = run(cfg())
    positions = valid_positions()
    assert metrics["token_mult_prob_error"] == pytest.approx(
        sum(math.exp(abs(PREV[b][t] - GEN[b][t])) for b, t in positions) / 5, rel=1e-5
    )
    # KL(gen || prev) with k3 on tokens sampled from gen: log r = prev - gen.
    assert metrics["gen_kl_error"] == pytest.approx(
        sum(k3(GEN[b][t], PREV[b][t]) for b, t in positions) / 5, rel=1e-5
    )
    assert metrics["policy_kl_error"] == pytest.approx(
        sum(k3(PREV[b][t], GEN[b][t]) for b, t in positions) / 5, rel=1e-5
    )

    def js(a: float, b: float) -> float:
        # JS(p, q) per sampled token from the mixture m = (p + q) / 2, k3 estimator of each KL to m.
        log_m = math.log((math.exp(a) + math.exp(b)) / 2)
        return 0.5 * (k3(log_m, a) + k3(log_m, b))

    assert metrics["js_divergence_error"] == pytest.approx(
        sum(js(PREV[b][t], GEN[b][t]) for b, t in positions) / 5, rel=1e-5
    )
    assert metrics["approx_entropy"] == pytest.approx(
        sum(-math.exp(CURR[b][t] - GEN[b][t]) * CURR[b][t] for b, t in positions) / 5, rel=1e-5
    )

    def binary_entropy(logp: float) -> float:
        p = math.exp(logp)
        return -(p * math.log(p) + (1 - p) * math.log(1 - p))

    assert metrics["entropy"] == pytest.approx(
        sum(binary_entropy(CURR[b][t]) for b, t in positions) / 5, rel=1e-4
    )


def test_masked_tokens_and_samples_do_not_matter() -> None:
    base, base_metrics = run(cfg(reference_policy_kl_penalty=0.1))
    # Garbage (huge values, NaN) at masked positions and in a masked-out third sample changes nothing.
    garbage_adv = [list(ADV[0]), list(ADV[1]), [0.0, 5.0, 5.0, 5.0]]
    garbage_adv[0][3] = float("nan")
    garbage_prev = [list(PREV[0]), list(PREV[1]), [0.0, -50.0, 50.0, 0.0]]
    garbage_prev[0][3] = 40.0
    loss, metrics = run(
        cfg(reference_policy_kl_penalty=0.1),
        curr=[*CURR, [0.0, -0.3, -0.3, -0.3]],
        prev=garbage_prev,
        gen=[*GEN, [0.0, 0.0, 0.0, 0.0]],
        ref=[*REF, [0.0, -9.0, -9.0, -9.0]],
        adv=garbage_adv,
        token_mask=[*TOKEN_MASK, [0, 1, 1, 1]],
        sample_mask=[1.0, 1.0, 0.0],
    )
    assert loss == pytest.approx(base, rel=1e-6)
    for name in ("probs_ratio", "probs_ratio_min", "probs_ratio_max", "kl_penalty", "gen_kl_error"):
        assert metrics[name] == pytest.approx(base_metrics[name], rel=1e-6), name


def test_loss_is_the_share_of_the_global_normalisation() -> None:
    local, _ = run(cfg())
    share, _ = run(cfg(), toks=20.0)
    assert share == pytest.approx(local * 5 / 20, rel=1e-6)


def test_missing_keys_raise_a_clear_error() -> None:
    logits, data = make_batch()
    del data["reference_policy_logprobs"]
    with pytest.raises(KeyError, match="reference_policy_logprobs"):
        ClippedPGLossFn(ClippedPGLossConfig())(logits, data, torch.tensor(2.0), torch.tensor(5.0))
    # Without a KL penalty the reference log-probs are not needed.
    ClippedPGLossFn(cfg())(logits, data, torch.tensor(2.0), torch.tensor(5.0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sequence_level_importance_ratios": True}, "token_level_loss"),
        ({"disable_ppo_ratio": True, "ratio_clip_c": 3.0}, "ratio_clip_c"),
        ({"truncated_importance_sampling_ratio": 2.0}, "use_importance_sampling_correction"),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_type": "icepop",
            },
            "ratio_min",
        ),
        ({"ratio_clip_c": 0.5}, "greater than 1"),
        ({"reference_policy_kl_type": "k4"}, "k3"),
        ({"ratio_clip_mni": 0.1}, "ratio_clip_mni"),
    ],
)
def test_config_rejects_bad_combinations(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ClippedPGLossConfig(**kwargs)


def test_nll_loss() -> None:
    logits, data = make_batch()
    loss, metrics = NLLLoss()(logits, data, torch.tensor(2.0), torch.tensor(10.0))
    expected = -sum(CURR[b][t] for b, t in valid_positions()) / 10
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["num_valid_tokens"] == 5
    assert metrics["num_valid_samples"] == 2
    assert NLLLoss.loss_type == LossType.TOKEN_LEVEL
    loss.backward()
    assert logits.grad is not None
    # No gradient reaches the logits of masked positions (row t-1 predicts token t).
    assert logits.grad[0, 2].abs().sum() == 0  # token (0, 3) is masked
    assert logits.grad[1, 3].abs().sum() == 0  # the last row predicts nothing
    assert logits.grad[1, 0].abs().sum() > 0


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"reference_policy_kl_penalty": 0.1, "use_on_policy_kl_approximation": True},
        {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 1.5},
        {"ratio_clip_c": 3.0},
        {"token_level_loss": False, "sequence_level_importance_ratios": True},
    ],
)
def test_prev_logprobs_from_forward_equals_the_separate_scoring_pass(options: dict[str, Any]) -> None:
    # The separate pass scores the same weights, so its prev_logprobs are the current log-probs: the loss,
    # its gradient and every metric must come out bitwise the same when they are taken from the forward.
    logits, data = make_batch()
    data["prev_logprobs"][:, 1:] = next_token_logprobs(logits.detach(), data["input_ids"])
    separate, separate_metrics = ClippedPGLossFn(cfg(**options))(
        logits, data, torch.tensor(2.0), torch.tensor(5.0)
    )
    separate.backward()
    logits_fwd, data_fwd = make_batch()
    del data_fwd["prev_logprobs"]
    from_forward, forward_metrics = ClippedPGLossFn(cfg(**options), prev_logprobs_from_forward=True)(
        logits_fwd, data_fwd, torch.tensor(2.0), torch.tensor(5.0)
    )
    from_forward.backward()
    assert from_forward.item() == separate.item()
    assert logits.grad is not None and logits_fwd.grad is not None
    torch.testing.assert_close(logits_fwd.grad, logits.grad, rtol=0, atol=0)
    assert forward_metrics == separate_metrics
