"""The embedded engine's pure-torch decoder against ``transformers`` (Llama, Qwen2, Qwen3; tied and untied)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from nemo_rl.models.generation.embedded.engine import EmbeddedEngine, SamplingParams
from nemo_rl.models.generation.embedded.model import DecoderLM, KVCache
from nemo_rl.models.hf_decoder import decoder_arch

VOCAB = 96
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def make_hf(kind: str, tie: bool, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A random tiny HF model whose weights are large enough to give peaked next-token distributions."""
    torch.manual_seed(seed)
    if kind == "qwen2":
        model: PreTrainedModel = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=tie, **COMMON, **overrides))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tie, **COMMON, **overrides))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=tie, head_dim=24, **COMMON, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.25)
    return model.eval()


def to_decoder(hf: PreTrainedModel, dtype: torch.dtype = torch.float32) -> DecoderLM:
    model = DecoderLM(decoder_arch(hf.config), dtype=dtype)
    loaded = model.load_weights(hf.state_dict().items())
    assert loaded == set(model.weights_manifest())
    return model


def right_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths_B = torch.tensor(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), max(lengths)), generator=gen)
    ids[torch.arange(ids.shape[1])[None, :] >= lengths_B[:, None]] = 0
    return ids, lengths_B


CASES = [
    ("qwen2", True, {}),
    ("qwen2", False, {}),
    ("llama", True, {}),
    ("llama", False, {"attention_bias": True, "mlp_bias": True}),
    ("llama", False, {"rope_parameters": LLAMA3_ROPE}),
    ("llama", True, {"rope_parameters": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 4.0}}),
    ("qwen3", False, {}),
    ("qwen3", True, {}),
]


@pytest.mark.parametrize(("kind", "tie", "overrides"), CASES)
def test_forward_matches_transformers(kind: str, tie: bool, overrides: dict[str, Any]) -> None:
    hf = make_hf(kind, tie, **overrides)
    model = to_decoder(hf)
    ids, _ = right_padded([40, 40, 40])
    with torch.no_grad():
        expected = torch.log_softmax(hf(ids).logits, dim=-1)
    got = torch.log_softmax(model.forward(ids), dim=-1)
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("kind", "tie", "overrides"), [CASES[0], CASES[4], CASES[6]])
def test_prefill_and_decode_match_full_forward(kind: str, tie: bool, overrides: dict[str, Any]) -> None:
    """The cached path (prefill of ragged prompts, then one token per step) equals full forwards."""
    hf = make_hf(kind, tie, **overrides)
    model = to_decoder(hf)
    ids, lengths = right_padded([7, 3, 11])
    cache = KVCache(model.arch, num_rows=3, num_positions=20, dtype=torch.float32, device=torch.device("cpu"))
    last = model.prefill(ids, lengths, cache)
    with torch.no_grad():
        for b, n in enumerate(lengths.tolist()):
            ref = hf(ids[b : b + 1, :n]).logits[0, -1]
            assert (torch.log_softmax(last[b], -1) - torch.log_softmax(ref, -1)).abs().max() <= 1e-5
    seqs = [ids[b, :n].tolist() for b, n in enumerate(lengths.tolist())]
    positions = lengths.clone()
    for step in range(4):
        tokens = torch.tensor([(17 * step + 5 * b) % VOCAB for b in range(3)])
        logits = model.decode(tokens, positions, cache, int(positions.max()) + 1)
        for b in range(3):
            seqs[b].append(int(tokens[b]))
            with torch.no_grad():
                ref = hf(torch.tensor([seqs[b]])).logits[0, -1]
            assert (torch.log_softmax(logits[b], -1) - torch.log_softmax(ref, -1)).abs().max() <= 1e-5
        positions += 1


def test_weights_keep_hf_names_and_fused_storage(tmp_path: Path) -> None:
    hf = make_hf("qwen2", tie=False)
    model = to_decoder(hf)
    names = dict(model.named_weights())
    assert set(names) == set(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(names[name], tensor), name
    # q/k/v are views of one buffer: writing through the HF name changes what the forward reads.
    q = names["model.layers.0.self_attn.q_proj.weight"]
    k = names["model.layers.0.self_attn.k_proj.weight"]
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    ids, _ = right_padded([9])
    before = model.forward(ids)
    model.load_weight("model.layers.0.self_attn.k_proj.weight", torch.zeros_like(k))
    assert not torch.allclose(before, model.forward(ids))


def test_tied_manifest_omits_lm_head_and_accepts_it() -> None:
    hf = make_hf("qwen2", tie=True)
    model = DecoderLM(decoder_arch(hf.config), dtype=torch.bfloat16)
    manifest = model.weights_manifest()
    assert "lm_head.weight" not in manifest
    assert manifest["model.embed_tokens.weight"] == ((VOCAB, 64), torch.bfloat16)
    assert set(manifest) == {name for name, _ in hf.named_parameters()}
    assert model.load_weight("lm_head.weight", torch.zeros(VOCAB, 64)) == 0


def test_load_weight_rejects_unknown_names_and_shapes() -> None:
    model = to_decoder(make_hf("llama", tie=False))
    with pytest.raises(KeyError, match="not part of this llama model"):
        model.load_weight("model.layers.9.mlp.up_proj.weight", torch.zeros(96, 64))
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        model.load_weight("model.norm.weight", torch.zeros(3, 3))


def test_from_pretrained_reads_a_saved_checkpoint(tmp_path: Path) -> None:
    hf = make_hf("llama", tie=False, rope_parameters=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path)
    model = DecoderLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids, _ = right_padded([12, 12])
    with torch.no_grad():
        expected = hf(ids).logits
    assert torch.allclose(model.forward(ids), expected, atol=1e-5, rtol=0)


def test_from_pretrained_without_safetensors_says_what_to_do(tmp_path: Path) -> None:
    make_hf("qwen2", tie=True).config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safe_serialization"):
        DecoderLM.from_pretrained(tmp_path, dtype=torch.float32)


def test_unsupported_configs_fail_clearly() -> None:
    config = Qwen2Config(**COMMON)
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope types"):
        decoder_arch(config)
    sliding = Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        decoder_arch(sliding)
    gelu = LlamaConfig(**COMMON, hidden_act="gelu")
    with pytest.raises(ValueError, match="SiLU"):
        decoder_arch(gelu)

    class Other:
        model_type = "gpt2"

    with pytest.raises(ValueError, match="backend=vllm"):
        decoder_arch(Other())


@pytest.mark.cuda
def test_offload_round_trip_keeps_weights_and_views() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hf = make_hf("qwen3", tie=False)
    model = to_decoder(hf).to("cuda")
    ids, _ = right_padded([10])
    before = model.forward(ids.cuda()).cpu()
    model.to("cpu")
    assert all(t.device.type == "cpu" for _, t in model.named_weights())
    model.to("cuda")
    assert torch.equal(model.forward(ids.cuda()).cpu(), before)
    q = dict(model.named_weights())["model.layers.1.self_attn.q_proj.weight"]
    assert q.data_ptr() == model._buffers["model.layers.1.self_attn.qkv_proj.weight"].data_ptr()


def test_bfloat16_model_generates_close_to_float32() -> None:
    hf = make_hf("qwen2", tie=True)
    ids, lengths = right_padded([6, 9])
    params = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=4, stop_token_ids=frozenset(), stop_strings=()
    )
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = EmbeddedEngine(to_decoder(hf, dtype), pad_token_id=0, max_sequence_length=64, decode_fn=None)
        out[dtype] = engine.generate(ids, lengths, params, greedy=True, seed=0)
    assert out[torch.bfloat16].logprobs.dtype == torch.float32
    mask = out[torch.float32].logprobs != 0
    diff = (out[torch.bfloat16].logprobs - out[torch.float32].logprobs)[mask].abs()
    assert diff[:2].max() < 0.1  # first tokens agree closely; later ones may diverge with the tokens
