"""The embedded engine's sampler: log-prob parity with ``transformers``, greedy equality with HF ``generate``,
seeding, stop tokens and strings, top-k/top-p filtering, compaction and the output contract."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from nemo_rl.algorithms.utils import next_token_logprobs, token_entropy
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.tiny import build_tiny_tokenizer
from nemo_rl.models.generation.embedded.engine import (
    EmbeddedEngine,
    EngineOutput,
    SamplingParams,
    sample_tokens,
)
from nemo_rl.models.generation.embedded.model import DecoderLM
from nemo_rl.models.hf_decoder import decoder_arch
from nemo_rl.models.policy.utils import token_logprobs
from nemo_rl.models.sampling import filter_top_k_top_p, sampling_logits

VOCAB = 104  # the tiny character-level tokenizer's size
PAD = 0


@pytest.fixture(scope="module")
def hf_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.25)
    return model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def make_engine(
    hf: Qwen2ForCausalLM, *, max_sequence_length: int = 128, tokenizer: PreTrainedTokenizerBase | None = None
) -> EmbeddedEngine:
    model = DecoderLM(decoder_arch(hf.config), dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    decode_fn = (
        None if tokenizer is None else (lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)))
    )
    return EmbeddedEngine(
        model, pad_token_id=PAD, max_sequence_length=max_sequence_length, decode_fn=decode_fn
    )


def params(**overrides: Any) -> SamplingParams:
    values: dict[str, Any] = dict(
        temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=12, stop_token_ids=frozenset(), stop_strings=()
    )
    values.update(overrides)
    return SamplingParams(**values)


def prompts(lengths: list[int], seed: int = 1, low: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random prompts (tokens drawn from ``[low, VOCAB)``) and their lengths."""
    gen = torch.Generator().manual_seed(seed)
    lengths_B = torch.tensor(lengths)
    ids = torch.randint(low, VOCAB, (len(lengths), max(lengths)), generator=gen)
    ids[torch.arange(ids.shape[1])[None, :] >= lengths_B[:, None]] = PAD
    return ids, lengths_B


def hf_token_logprobs(
    hf: Qwen2ForCausalLM,
    out: EngineOutput,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> torch.Tensor:
    """``log_softmax(filter_top_k_top_p(logits / temperature))`` of each output token under a plain HF
    forward (the log-probability contract), [B, T']."""
    ref = torch.zeros_like(out.logprobs)
    for b in range(out.output_ids.shape[0]):
        n = int(out.unpadded_sequence_lengths[b])
        ids = out.output_ids[b : b + 1, :n]
        with torch.no_grad():
            scaled = hf(ids).logits[0].float() / temperature
            logprobs = torch.log_softmax(filter_top_k_top_p(scaled, top_k, top_p), dim=-1)
        ref[b, 1:n] = logprobs[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    return ref


def generated_mask(out: EngineOutput, input_lengths: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(out.output_ids.shape[1])[None, :]
    return (cols >= input_lengths[:, None]) & (cols < out.unpadded_sequence_lengths[:, None])


def test_sampled_logprobs_match_a_plain_hf_forward(hf_model: Qwen2ForCausalLM) -> None:
    engine = make_engine(hf_model)
    ids, lengths = prompts([5, 12, 3, 9, 1, 7])
    # Repeated prompts (as GRPO's groups) are prefilled once and their cache rows copied to the repeats.
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 1, 1, 4, 1])
    ids, lengths = ids[rows], lengths[rows]
    # Stop tokens make rows finish at different steps (exercising compaction); the log-probs are those of
    # the top-k/top-p filtered distribution the tokens were drawn from.
    p = params(max_new_tokens=16, top_k=40, top_p=0.95, stop_token_ids=frozenset(range(7, 12)))
    out = engine.generate(ids, lengths, p, greedy=False, seed=3)
    repeats = out.output_ids[[1, 6, 7, 9]]
    assert not all(torch.equal(r, repeats[0]) for r in repeats), "repeats should be sampled independently"
    mask = generated_mask(out, lengths)
    assert int(mask.sum()) == int(out.generation_lengths.sum()) > 0
    ref = hf_token_logprobs(hf_model, out, top_k=40, top_p=0.95)
    assert (out.logprobs - hf_token_logprobs(hf_model, out))[mask].max().item() > 1e-3  # renormalised
    assert (out.logprobs - ref)[mask].abs().max().item() <= 1e-4
    assert torch.all(out.logprobs[~mask] == 0)


def test_logprobs_are_taken_at_the_sampling_temperature(hf_model: Qwen2ForCausalLM) -> None:
    engine = make_engine(hf_model)
    ids, lengths = prompts([6, 10])
    out = engine.generate(ids, lengths, params(temperature=0.6, top_p=0.8), greedy=False, seed=0)
    mask = generated_mask(out, lengths)
    at_temperature = hf_token_logprobs(hf_model, out, temperature=0.6, top_p=0.8)
    assert (out.logprobs - at_temperature)[mask].abs().max() <= 1e-4
    at_one = hf_token_logprobs(hf_model, out, temperature=1.0, top_p=0.8)
    assert (out.logprobs - at_one)[mask].abs().max() > 1e-2


def test_greedy_matches_hf_generate_and_is_deterministic(hf_model: Qwen2ForCausalLM) -> None:
    engine = make_engine(hf_model)
    ids, lengths = prompts([4, 11, 2, 8])
    stops = [7, 8, 9]
    p = params(max_new_tokens=20, stop_token_ids=frozenset(stops))
    first = engine.generate(ids, lengths, p, greedy=True, seed=0)
    second = engine.generate(ids, lengths, p, greedy=True, seed=123)
    for key, value in vars(first).items():
        if value is None:  # routed_experts: the engine does not record routing by default
            assert getattr(second, key) is None, key
            continue
        assert torch.equal(value, getattr(second, key)), key
    generate: Any = getattr(hf_model, "generate")  # noqa: B009 (its self-typed signature confuses mypy)
    for b, n in enumerate(lengths.tolist()):
        with torch.no_grad():
            expected = generate(
                ids[b : b + 1, :n], max_new_tokens=20, do_sample=False, eos_token_id=stops, pad_token_id=PAD
            )[0]
        got = first.output_ids[b, : int(first.unpadded_sequence_lengths[b])]
        assert got.tolist() == expected.tolist()
    mask = generated_mask(first, lengths)
    assert (first.logprobs - hf_token_logprobs(hf_model, first))[mask].abs().max() <= 1e-4


def test_seeded_sampling_replays(hf_model: Qwen2ForCausalLM) -> None:
    engine = make_engine(hf_model)
    ids, lengths = prompts([5, 5, 9, 3])
    p = params(max_new_tokens=10, temperature=1.5)
    a = engine.generate(ids, lengths, p, greedy=False, seed=7)
    b = engine.generate(ids, lengths, p, greedy=False, seed=7)
    c = engine.generate(ids, lengths, p, greedy=False, seed=8)
    assert torch.equal(a.output_ids, b.output_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.output_ids, c.output_ids)


def test_rows_finishing_early_do_not_change_other_rows(hf_model: Qwen2ForCausalLM) -> None:
    """A batch (with compaction as rows stop) gives each row what it gets when generated alone."""
    # The length budget min(16, 20 - prompt length) makes rows finish at different steps.
    engine = make_engine(hf_model, max_sequence_length=20)
    ids, lengths = prompts([3, 8, 5, 12, 2, 6, 9, 4], seed=5)
    p = params(max_new_tokens=16)
    batch = engine.generate(ids, lengths, p, greedy=True, seed=0)
    assert len(set(batch.generation_lengths.tolist())) > 2, "rows should finish at different steps"
    for b, n in enumerate(lengths.tolist()):
        alone = engine.generate(ids[b : b + 1, :n], lengths[b : b + 1], p, greedy=True, seed=0)
        width = int(alone.unpadded_sequence_lengths[0])
        assert int(batch.unpadded_sequence_lengths[b]) == width
        assert torch.equal(batch.output_ids[b, :width], alone.output_ids[0, :width])
        assert torch.allclose(batch.logprobs[b, :width], alone.logprobs[0, :width], atol=1e-5)
        assert bool(batch.truncated[b]) == bool(alone.truncated[0])


def test_stop_tokens_end_rows_and_are_kept(hf_model: Qwen2ForCausalLM) -> None:
    engine = make_engine(hf_model)
    ids, lengths = prompts([4, 7, 5])
    free = engine.generate(ids, lengths, params(max_new_tokens=12), greedy=True, seed=0)
    assert free.truncated.all() and (free.generation_lengths == 12).all()
    # Stop on row 0's third generated token: the row ends right there, with that token kept.
    stop = int(free.output_ids[0, int(lengths[0]) + 2])
    out = engine.generate(
        ids, lengths, params(max_new_tokens=12, stop_token_ids=frozenset([stop])), greedy=True, seed=0
    )
    n0 = int(out.generation_lengths[0])
    first_stop = free.output_ids[0, int(lengths[0]) :].tolist().index(stop)
    assert n0 == first_stop + 1
    assert int(out.output_ids[0, int(lengths[0]) + n0 - 1]) == stop
    assert not bool(out.truncated[0])
    assert out.logprobs[0, int(lengths[0]) + n0 - 1] != 0


def test_stop_strings_global_and_per_sample(
    hf_model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase
) -> None:
    engine = make_engine(hf_model, tokenizer=tokenizer)
    ids, lengths = prompts([6, 6], seed=2)
    free = engine.generate(ids, lengths, params(max_new_tokens=16), greedy=True, seed=0)
    texts = [
        str(tokenizer.decode(free.output_ids[b, int(lengths[b]) : int(free.unpadded_sequence_lengths[b])]))
        for b in range(2)
    ]
    # A two-character stop string taken from the middle of row 0's response.
    stop = texts[0][5:7]
    cut = texts[0].index(stop) + len(stop)
    per_sample = engine.generate(
        ids, lengths, params(max_new_tokens=16), greedy=True, seed=0, stop_strings=[[stop], None]
    )
    got0 = tokenizer.decode(
        per_sample.output_ids[0, int(lengths[0]) : int(per_sample.unpadded_sequence_lengths[0])]
    )
    assert got0 == texts[0][:cut]
    assert not bool(per_sample.truncated[0])
    if stop not in texts[1]:
        assert int(per_sample.generation_lengths[1]) == 16 and bool(per_sample.truncated[1])
    both = engine.generate(ids, lengths, params(max_new_tokens=16, stop_strings=(stop,)), greedy=True, seed=0)
    n0 = int(per_sample.unpadded_sequence_lengths[0])
    assert int(both.unpadded_sequence_lengths[0]) == n0
    assert torch.equal(both.output_ids[0, :n0], per_sample.output_ids[0, :n0])


def test_stop_strings_need_a_decoder(hf_model: Qwen2ForCausalLM) -> None:
    engine = make_engine(hf_model)
    ids, lengths = prompts([3])
    with pytest.raises(ValueError, match="decode_fn"):
        engine.generate(ids, lengths, params(stop_strings=("ab",)), greedy=True, seed=0)


def test_output_contract_shapes_padding_and_lengths(hf_model: Qwen2ForCausalLM) -> None:
    engine = make_engine(hf_model, max_sequence_length=14)
    ids, lengths = prompts([10, 3, 14, 6])
    out = engine.generate(ids, lengths, params(max_new_tokens=6), greedy=False, seed=1)
    # Budgets: min(6, 14 - length) -> 4, 6, 0, 6; no stop tokens, so every row uses its budget.
    assert out.generation_lengths.tolist() == [4, 6, 0, 6]
    assert out.truncated.tolist() == [True, True, True, True]
    assert out.unpadded_sequence_lengths.tolist() == [14, 9, 14, 12]
    assert out.output_ids.shape == out.logprobs.shape == (4, 14 + 6)
    assert out.output_ids.dtype == torch.long and out.logprobs.dtype == torch.float32
    for b, n in enumerate(lengths.tolist()):
        end = int(out.unpadded_sequence_lengths[b])
        assert torch.equal(out.output_ids[b, :n], ids[b, :n])
        assert (out.output_ids[b, end:] == PAD).all()
        assert (out.logprobs[b, :n] == 0).all() and (out.logprobs[b, end:] == 0).all()
        assert (out.logprobs[b, n:end] < 0).all()


def test_bad_inputs_fail_with_clear_messages(hf_model: Qwen2ForCausalLM) -> None:
    engine = make_engine(hf_model)
    ids, lengths = prompts([3, 4])
    with pytest.raises(ValueError, match="input_lengths must be in"):
        engine.generate(ids, torch.tensor([0, 4]), params(), greedy=True, seed=0)
    with pytest.raises(ValueError, match="one per row"):
        engine.generate(ids, torch.tensor([3]), params(), greedy=True, seed=0)
    with pytest.raises(ValueError, match="entries for 2 sequences"):
        engine.generate(ids, lengths, params(), greedy=True, seed=0, stop_strings=[None])
    with pytest.raises(ValueError, match="greedy"):
        params(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        params(top_p=0.0)
    # Non-finite weights: sampled and greedy calls both refuse instead of returning NaN log-probs.
    with torch.no_grad():
        for _, weight in engine.model.named_weights():
            weight.fill_(float("nan"))
    for greedy in (False, True):
        with pytest.raises(FloatingPointError, match="non-finite logits"):
            engine.generate(ids, lengths, params(), greedy=greedy, seed=0)


def probs_to_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().squeeze(1).tolist()


def test_top_k_top_p_filter_on_a_crafted_distribution() -> None:
    # Tokens in shuffled order so the filter must sort: probabilities 0.05, 0.5, 0.1, 0.2, 0.15.
    logits = probs_to_logits([0.05, 0.5, 0.1, 0.2, 0.15])
    assert kept(filter_top_k_top_p(logits, None, 1.0)) == [0, 1, 2, 3, 4]
    assert kept(filter_top_k_top_p(logits, 2, 1.0)) == [1, 3]
    assert kept(filter_top_k_top_p(logits, 3, 1.0)) == [1, 3, 4]
    assert kept(filter_top_k_top_p(logits, None, 0.5)) == [1]  # 0.5 alone reaches 0.5
    assert kept(filter_top_k_top_p(logits, None, 0.69)) == [1, 3]  # 0.5 + 0.2 reaches 0.69
    assert kept(filter_top_k_top_p(logits, None, 0.71)) == [1, 3, 4]
    assert kept(filter_top_k_top_p(logits, None, 0.01)) == [1]  # the top token is always kept
    # Top-p works on the top-k renormalised distribution: {0.5, 0.2} -> {0.714, 0.286}.
    assert kept(filter_top_k_top_p(logits, 2, 0.7)) == [1]
    assert kept(filter_top_k_top_p(logits, 2, 0.72)) == [1, 3]
    # Kept logits are unchanged.
    filtered = filter_top_k_top_p(logits, 3, 1.0)
    assert torch.equal(filtered[0, [1, 3, 4]], logits[0, [1, 3, 4]])


def test_sampling_draws_from_the_filtered_renormalised_distribution() -> None:
    probs = [0.05, 0.5, 0.1, 0.2, 0.15]
    logits = probs_to_logits(probs).expand(20000, -1).contiguous()
    p = params(top_k=3, top_p=0.9)  # top-3 = {0.5, 0.2, 0.15} renormalised: 0.588, 0.235, 0.176; all kept
    tokens, logprobs = sample_tokens(logits, p, greedy=False, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    assert counts[0] == 0 and counts[2] == 0
    assert torch.allclose(counts[[1, 3, 4]], torch.tensor([0.5, 0.2, 0.15]) / 0.85, atol=0.015)
    # Reported log-probs are those of the distribution sampled from: renormalised over the kept tokens.
    assert torch.allclose(logprobs, torch.log(torch.tensor(probs) / 0.85)[tokens], atol=1e-6)
    # Without a filter they are the plain log-softmax at the sampling temperature.
    tokens, logprobs = sample_tokens(
        logits[:50], params(temperature=0.5), greedy=False, generator=torch.Generator().manual_seed(0)
    )
    assert torch.allclose(logprobs, torch.log_softmax(logits[0] / 0.5, dim=-1)[tokens], atol=1e-6)
    tokens, _ = sample_tokens(
        logits, params(top_p=0.6), greedy=False, generator=torch.Generator().manual_seed(0)
    )
    assert set(tokens.tolist()) == {1, 3}
    greedy, greedy_lp = sample_tokens(logits[:2], params(temperature=0.3), greedy=True, generator=None)
    assert greedy.tolist() == [1, 1]
    assert torch.allclose(greedy_lp, torch.tensor([math.log(0.5)] * 2), atol=1e-6)


def test_sampling_params_from_policy_config() -> None:
    cfg = PolicyConfig.model_validate(
        {
            "model_name": "unused",
            "max_total_sequence_length": 300,
            "generation": {"temperature": 0.7, "top_k": 20, "stop_token_ids": [5], "stop_strings": ["</a>"]},
        }
    )
    p = SamplingParams.from_policy_config(cfg, eos_token_ids=[2])
    assert p == SamplingParams(
        temperature=0.7,
        top_p=1.0,
        top_k=20,
        max_new_tokens=300,
        stop_token_ids=frozenset({2, 5}),
        stop_strings=("</a>",),
    )


def test_cache_is_reused_and_released(hf_model: Qwen2ForCausalLM, tmp_path: Path) -> None:
    engine = make_engine(hf_model)
    ids, lengths = prompts([5, 9])
    engine.generate(ids, lengths, params(max_new_tokens=4), greedy=True, seed=0)
    cache = engine._cache
    assert cache is not None
    engine.generate(ids[:1, :5], lengths[:1], params(max_new_tokens=3), greedy=True, seed=0)
    assert engine._cache is cache  # smaller call: the same buffer
    engine.release_cache()
    assert engine._cache is None


def test_policy_scores_sampled_tokens_under_the_sampling_distribution() -> None:
    """``sampling_logits`` (what the policy workers score with) gives each sampled token exactly the log-prob
    the sampler reported, under temperature, top-k and top-p; a token outside the filter stays finite."""
    torch.manual_seed(0)
    num_rows, seq_len = 3, 6
    logits_BTV = torch.randn(num_rows, seq_len, VOCAB) * 3
    p = params(temperature=0.7, top_k=7, top_p=0.8)
    generator = torch.Generator().manual_seed(1)
    ids_BT = torch.zeros(num_rows, seq_len, dtype=torch.long)
    sampled_BT = torch.zeros(num_rows, seq_len)
    for t in range(seq_len - 1):
        tokens_B, logprobs_B = sample_tokens(logits_BTV[:, t], p, greedy=False, generator=generator)
        ids_BT[:, t + 1], sampled_BT[:, t + 1] = tokens_B, logprobs_B
    lengths_B = torch.full((num_rows,), seq_len)

    policy_BTV = sampling_logits(logits_BTV, ids_BT, p.temperature, p.top_k, p.top_p)
    assert torch.allclose(token_logprobs(policy_BTV, ids_BT, lengths_B), sampled_BT, atol=1e-5)
    assert torch.allclose(next_token_logprobs(policy_BTV, ids_BT), sampled_BT[:, 1:], atol=1e-5)
    # Off by default: only the temperature applies.
    plain_BTV = sampling_logits(logits_BTV, ids_BT, 0.7, None, 1.0)
    assert torch.equal(plain_BTV, logits_BTV / 0.7)

    # A target the filter drops (the least likely token) keeps a finite log-prob and gradient.
    leaf_BTV = logits_BTV.clone().requires_grad_(True)
    ids_BT[:, 1:] = logits_BTV[:, :-1].argmin(dim=-1)
    lp_BT = next_token_logprobs(sampling_logits(leaf_BTV, ids_BT, 1.0, 2, 0.5), ids_BT)
    lp_BT.sum().backward()
    assert torch.isfinite(lp_BT).all() and torch.isfinite(leaf_BTV.grad).all()  # type: ignore[arg-type]
    assert torch.isfinite(token_entropy(sampling_logits(logits_BTV, ids_BT, 1.0, 2, 0.5))).all()


def _new_weights(hf: Qwen2ForCausalLM) -> tuple[Qwen2ForCausalLM, list[tuple[str, torch.Tensor]]]:
    """A copy of ``hf`` with every weight perturbed, and its state dict as a refit would send it."""
    new = Qwen2ForCausalLM(hf.config).eval()
    new.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return new, list(new.state_dict().items())


@pytest.mark.parametrize("recompute", [True, False])
def test_in_flight_weights_apply_between_two_decode_steps(
    hf_model: Qwen2ForCausalLM, recompute: bool
) -> None:
    """Weights a refit delivers while the engine decodes are staged and applied before the next decode step
    (asynchronous GRPO's in-flight updates); with the cache recomputed, every later token's log-prob is the
    new model's on the whole sequence, otherwise the prompt's keys and values still come from the old one."""
    new_hf, new_weights = _new_weights(hf_model)
    engine = make_engine(hf_model)
    engine.recompute_kv_cache = recompute
    decode = engine.model.decode
    calls = {"n": 0}

    def decode_and_refit_at_step_2(*args: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:  # the refit's thread would call this while the engine decodes
            engine.load_weights(new_weights)
        return decode(*args)

    engine.model.decode = decode_and_refit_at_step_2  # type: ignore[method-assign]
    ids, lengths = prompts([6, 6], seed=4)
    out = engine.generate(ids, lengths, params(max_new_tokens=10), greedy=True, seed=0)
    assert engine.in_flight.updates_between_steps == 1
    assert int(out.generation_lengths.min()) == 10
    # Decode call 3 (step 2) still ran on the old weights and gave token 3's logits; tokens 4.. come after.
    new_logprobs = hf_token_logprobs(new_hf, out)
    old_logprobs = hf_token_logprobs(hf_model, out)
    first_new = 6 + 4
    assert (out.logprobs - old_logprobs)[:, 6:first_new].abs().max().item() <= 1e-4
    error = (out.logprobs - new_logprobs)[:, first_new:16].abs().max().item()
    assert (error <= 1e-4) is recompute
    # The weights stay updated after the call.
    assert torch.equal(
        dict(engine.model.named_weights())["model.embed_tokens.weight"], new_hf.model.embed_tokens.weight
    )


def test_weights_loaded_between_calls_apply_at_once(hf_model: Qwen2ForCausalLM) -> None:
    new_hf, new_weights = _new_weights(hf_model)
    engine = make_engine(hf_model)
    engine.load_weights(new_weights)
    assert engine.in_flight.updates_between_steps == 0
    ids, lengths = prompts([5], seed=2)
    out = engine.generate(ids, lengths, params(max_new_tokens=6), greedy=True, seed=0)
    mask = generated_mask(out, lengths)
    assert (out.logprobs - hf_token_logprobs(new_hf, out))[mask].abs().max().item() <= 1e-4
