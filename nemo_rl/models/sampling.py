"""The sampling distribution, shared by the generation backends and the policy workers.

Generation draws each token from ``softmax(filter_top_k_top_p(logits / temperature))`` and reports its
log-prob under that renormalised distribution (the contract of :mod:`nemo_rl.models.generation.interfaces`).
The policy workers score sequences under the same distribution (:func:`sampling_logits`), so that GRPO's
importance ratios and ``gen_kl_error`` compare like with like when ``policy.generation.top_k`` / ``top_p``
are set.

Tensor legend: B = rows, T = tokens, V = vocabulary, C = candidate tokens.
"""

from __future__ import annotations

import torch


def top_k_top_p_candidates(
    logits_BV: torch.Tensor, top_k: int | None, top_p: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Tokens surviving top-k then top-p: ``(logits [B, C], token ids [B, C])`` in descending order, dropped
    ones at ``-inf``; ``None`` when neither filter is active.

    With top-k only the ``top_k`` best are ranked (a partial selection, cheap on large vocabularies).
    """
    use_top_k = top_k is not None and top_k < logits_BV.shape[-1]
    if not use_top_k and top_p >= 1.0:
        return None
    if use_top_k:
        values_BC, tokens_BC = torch.topk(logits_BV, top_k, dim=-1)  # type: ignore[arg-type]
    else:
        values_BC, tokens_BC = torch.sort(logits_BV, dim=-1, descending=True)
    if top_p < 1.0:
        probs_BC = torch.softmax(values_BC, dim=-1)
        mass_before_BC = torch.cumsum(probs_BC, dim=-1) - probs_BC
        drop_BC = mass_before_BC >= top_p
        drop_BC[:, 0] = False
        values_BC = values_BC.masked_fill(drop_BC, float("-inf"))
    return values_BC, tokens_BC


def filter_top_k_top_p(logits_BV: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Set the logits of tokens outside the top-k and then outside the top-p nucleus to ``-inf``.

    Top-k keeps the ``top_k`` largest logits (ties broken arbitrarily). Top-p then works on the distribution
    renormalised after top-k and keeps the smallest prefix of the descending order whose probability mass
    reaches ``top_p``; the most likely token is always kept.
    """
    candidates = top_k_top_p_candidates(logits_BV, top_k, top_p)
    if candidates is None:
        return logits_BV
    values_BC, tokens_BC = candidates
    return torch.full_like(logits_BV, float("-inf")).scatter_(-1, tokens_BC, values_BC)


def sampling_logits(
    logits_BTV: torch.Tensor,
    input_ids_BT: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float,
) -> torch.Tensor:
    """Next-token logits ``[B, T, V]`` of the distribution the sampler draws from, for scoring ``input_ids``.

    Divides by ``temperature``, then sets the tokens top-k / top-p drop to ``-inf`` (see
    :func:`filter_top_k_top_p`), so ``log_softmax`` of the result is the sampler's log-prob. Two differences
    from the sampler, both for training:

    - The token that actually follows each position (``input_ids[:, t + 1]`` for the logits at ``t``) is
      always kept. With the weights the sampler used it is inside the filter anyway (it was drawn from it),
      so the log-probs equal the sampler's; after the policy moved within a step it may fall outside, and
      keeping it gives a finite log-prob (a distribution renormalised over one more token) instead of
      ``-inf``, which would turn ratios and KL terms into NaN.
    - Which tokens are dropped is decided without gradient; gradients flow through the kept logits only.
    """
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    if (top_k is None or top_k >= logits_BTV.shape[-1]) and top_p >= 1.0:
        return logits_BTV
    with torch.no_grad():
        num_rows, seq_len, vocab = logits_BTV.shape
        flat_BV = logits_BTV.detach().reshape(num_rows * seq_len, vocab)
        keep_BTV = torch.isfinite(filter_top_k_top_p(flat_BV, top_k, top_p)).reshape(logits_BTV.shape)
        targets_BT1 = input_ids_BT[:, 1:].to(keep_BTV.device).unsqueeze(-1)
        keep_BTV[:, :-1].scatter_(-1, targets_BT1, True)
    return logits_BTV.masked_fill(~keep_BTV, float("-inf"))
