"""How the embedded engine picks each next token: the sampling settings of one batch and the sampler.

Log-probabilities follow the contract of :mod:`nemo_rl.models.generation.interfaces`: each sampled token's
log-prob under the distribution it was drawn from, ``log_softmax(filter_top_k_top_p(logits / temperature))``
(renormalised over the tokens top-k and top-p keep, as vLLM's ``processed_logprobs``). Without top-k/top-p
that is ``log_softmax(logits / temperature)``, what a policy scoring at the same temperature computes. In
greedy mode the temperature plays no role and the log-probs are those of the raw model (``log_softmax(logits)``).

Tensor legend: B = rows, V = vocabulary, C = candidate tokens kept by top-k/top-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.sampling import top_k_top_p_candidates


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch; build it from the policy config with :meth:`from_policy_config`."""

    temperature: float
    """Logits are divided by this before sampling (and before computing the returned log-probs)."""
    top_p: float
    """Nucleus filter: keep the smallest set of most likely tokens whose probability reaches it (1 = off)."""
    top_k: int | None
    """Keep only this many most likely tokens (``None`` = off)."""
    max_new_tokens: int
    """Most tokens sampled per sequence."""
    stop_token_ids: frozenset[int]
    """Tokens that end a sequence (kept in the output), EOS included."""
    stop_strings: tuple[str, ...]
    """Strings that end a sequence when the generated text contains them (the completing token is kept)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(
                f"temperature must be > 0, got {self.temperature}; ask for greedy decoding instead"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")

    @classmethod
    def from_policy_config(cls, cfg: PolicyConfig, eos_token_ids: Sequence[int]) -> SamplingParams:
        """Sampling settings of ``cfg.generation``; ``eos_token_ids`` (from the tokenizer) always stop."""
        gen = cfg.generation
        return cls(
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            max_new_tokens=cfg.max_new_tokens,
            stop_token_ids=frozenset([*eos_token_ids, *(gen.stop_token_ids or [])]),
            stop_strings=tuple(gen.stop_strings or ()),
        )


def sample_tokens(
    logits_BV: torch.Tensor,
    params: SamplingParams,
    *,
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of each row; return it ``[B]`` and its log-prob ``[B]`` (see the module docstring).

    Sampling draws from the top-k/top-p filtered distribution at the sampling temperature, renormalised; the
    returned log-prob is the sampled token's under that same distribution.
    """
    logits_BV = logits_BV.float()
    if greedy:
        tokens_B = logits_BV.argmax(dim=-1)
        return tokens_B, torch.log_softmax(logits_BV, dim=-1).gather(1, tokens_B[:, None]).squeeze(1)
    scaled_BV = logits_BV / params.temperature if params.temperature != 1.0 else logits_BV
    candidates = top_k_top_p_candidates(scaled_BV, params.top_k, params.top_p)
    if candidates is None:
        logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)
        tokens_B1 = _draw(logprobs_BV, generator)
        return tokens_B1.squeeze(1), logprobs_BV.gather(1, tokens_B1).squeeze(1)
    values_BC, tokens_BC = candidates
    logprobs_BC = torch.log_softmax(values_BC, dim=-1)
    picked_B1 = _draw(logprobs_BC, generator)
    return tokens_BC.gather(1, picked_B1).squeeze(1), logprobs_BC.gather(1, picked_B1).squeeze(1)


def _draw(logprobs_BV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row drawn from ``exp(logprobs_BV)``, ``[B, 1]``.

    The exponential race that ``torch.multinomial`` itself runs: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d.
    picks index ``i`` with probability ``p_i`` exactly. Here ``E = -log(U)`` from uniform draws, which on CPU
    cost a fifth of ``exponential_``'s (the largest cost of sampling a batch), and multinomial's input checks
    (two host syncs a step) are skipped: the probabilities come from a softmax. ``argmax(p / E)`` is taken as
    ``argmin(p / log(U))``; a draw of ``U = 0`` (probability ``2**-24``) only rules its index out for that step.
    """
    log_u_BV = torch.rand(
        logprobs_BV.shape, generator=generator, dtype=logprobs_BV.dtype, device=logprobs_BV.device
    ).log_()
    return torch.argmin(logprobs_BV.exp().div_(log_u_BV), dim=-1, keepdim=True)
