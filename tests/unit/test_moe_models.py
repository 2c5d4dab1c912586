"""Mixture-of-experts models in nemo_rl's own decoder against ``transformers``: the tiny Qwen3-MoE and
GLM-4-MoE (DeepSeek-V3 routing, shared expert) checkpoints, full forward and the cached path, and the
weight names a checkpoint (per expert) and a refit (3-D expert tensors) use."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.tiny_moe import MOE_FAMILIES, build_tiny_moe_model
from nemo_rl.models.generation.embedded.model import DecoderLM, KVCache
from nemo_rl.models.generation.embedded.moe import route
from nemo_rl.models.hf_decoder import decoder_arch

ASSETS = Path(__file__).resolve().parents[2] / "examples" / "assets"
TOLERANCE = 1e-5


def asset(family: str) -> Path:
    return ASSETS / f"tiny_{family}_init"


def hf_model(family: str, scale: float | None = None) -> PreTrainedModel:
    """The checked-in tiny model; with ``scale`` its weights redrawn large, so routing and next-token
    distributions are peaked (the fresh model routes almost uniformly)."""
    model = AutoModelForCausalLM.from_pretrained(asset(family), dtype=torch.float32)
    if scale is not None:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, scale)
    return model.eval()


def to_decoder(hf: PreTrainedModel) -> DecoderLM:
    model = DecoderLM(decoder_arch(hf.config), dtype=torch.float32)
    # The state dict holds the persistent buffers too (GLM-4-MoE's correction bias), as a refit sends them.
    assert model.load_weights(hf.state_dict().items()) == set(model.weights_manifest())
    return model


def logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("scale", [None, 0.25])
def test_forward_matches_transformers(family: str, scale: float | None) -> None:
    hf = hf_model(family, scale)
    model = to_decoder(hf)
    ids = torch.randint(3, 104, (4, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = logprobs(hf(ids).logits)
    assert (logprobs(model.forward(ids)) - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_routing_matches_transformers(family: str) -> None:
    """The experts and weights each token gets are transformers' own (the peaked model spreads tokens)."""
    hf = hf_model(family, 0.25)
    model = to_decoder(hf)
    layer = model.arch.num_layers - 1
    gate = hf.model.layers[layer].mlp.gate
    x = torch.randn(64, model.arch.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, hf_weights, hf_experts = gate(x)
    moe = model._layers[layer].moe
    assert moe is not None and model.arch.moe is not None
    weights, experts = route(x, moe, model.arch.moe)
    order_hf, order = hf_experts.argsort(dim=-1), experts.argsort(dim=-1)
    assert torch.equal(hf_experts.gather(1, order_hf), experts.gather(1, order))
    assert torch.allclose(hf_weights.gather(1, order_hf), weights.gather(1, order), atol=1e-6)
    assert len(torch.unique(experts)) >= 4


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_prefill_and_decode_match_transformers(family: str) -> None:
    hf = hf_model(family, 0.25)
    model = to_decoder(hf)
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([7, 3, 11])
    ids = torch.randint(3, 104, (3, 11), generator=gen) * (torch.arange(11)[None, :] < lengths[:, None])
    cache = KVCache(model.arch, num_rows=3, num_positions=20, dtype=torch.float32, device=torch.device("cpu"))
    last = model.prefill(ids, lengths, cache)
    seqs = [ids[b, :n].tolist() for b, n in enumerate(lengths.tolist())]
    with torch.no_grad():
        for b in range(3):
            ref = hf(torch.tensor([seqs[b]])).logits[0, -1]
            assert (logprobs(last[b]) - logprobs(ref)).abs().max() <= TOLERANCE
    positions = lengths.clone()
    for step in range(3):
        tokens = torch.tensor([(17 * step + 5 * b) % 100 + 3 for b in range(3)])
        out = model.decode(tokens, positions, cache, int(positions.max()) + 1)
        for b in range(3):
            seqs[b].append(int(tokens[b]))
            with torch.no_grad():
                ref = hf(torch.tensor([seqs[b]])).logits[0, -1]
            assert (logprobs(out[b]) - logprobs(ref)).abs().max() <= TOLERANCE
        positions += 1


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_checkpoint_and_refit_names(family: str) -> None:
    """The manifest lists a MoE layer's experts one by one under their checkpoint names (what a refit sends,
    so an expert-parallel sender can send only its own); they load into rows of the 3-D expert tensors
    transformers 5 keeps in memory, and a 3-D tensor loaded whole counts as all of its experts."""
    model = DecoderLM.from_pretrained(asset(family), dtype=torch.float32)
    manifest = model.weights_manifest()
    last = model.arch.num_layers - 1
    prefix = f"model.layers.{last}.mlp."
    assert manifest[prefix + "experts.7.gate_proj.weight"][0] == (64, 128)
    assert manifest[prefix + "experts.7.down_proj.weight"][0] == (128, 64)
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in manifest)
    hf = hf_model(family)
    weights = dict(model.named_weights())
    state = hf.state_dict()
    for name, tensor in state.items():
        if name in weights:
            assert torch.equal(weights[name], tensor), name
    loaded = model.load_weights([(prefix + "experts.down_proj", state[prefix + "experts.down_proj"])])
    assert loaded == {f"{prefix}experts.{e}.down_proj.weight" for e in range(8)}
    if family == "glm4_moe":
        bias = weights[prefix + "gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.abs().sum() > 0
        assert "model.layers.0.mlp.gate_proj.weight" in manifest  # the dense first layer
        assert prefix + "shared_experts.gate_proj.weight" in manifest


def test_builder_reproduces_the_checked_in_assets(tmp_path: Path) -> None:
    from nemo_rl.data.tiny import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path / "tokenizer")
    for family in MOE_FAMILIES:
        built = build_tiny_moe_model(family, tmp_path / family, tmp_path / "tokenizer", seed=0)
        checked_in = hf_model(family)
        assert sum(p.numel() for p in built.parameters()) < 600_000
        for (name, a), (_, b) in zip(
            built.state_dict().items(), checked_in.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), name


def _policy(**dtensor: object) -> dict[str, object]:
    return {
        "model_name": str(asset("qwen3_moe")),
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
        "dtensor_cfg": dtensor,
    }


def test_dtensor_refuses_expert_parallelism_and_moe_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match=r"expert_parallel_size.*Megatron"):
        PolicyConfig.model_validate(_policy(expert_parallel_size=2))
    with pytest.raises(ValueError, match="TP plan does not cover the experts of this qwen3_moe"):
        PolicyConfig.model_validate(_policy(tensor_parallel_size=2))
    PolicyConfig.model_validate(_policy())


def test_layers_past_the_last_are_ignored_like_transformers_does() -> None:
    """GLM-4.5 checkpoints keep a multi-token-prediction layer after the decoder's last; the LM never runs it."""
    model = DecoderLM.from_pretrained(asset("glm4_moe"), dtype=torch.float32)
    extra = f"model.layers.{model.arch.num_layers}.mlp.experts.0.gate_proj.weight"
    assert model.load_weight(extra, torch.zeros(64, 128)) == 0
    with pytest.raises(KeyError, match="not part of this glm4_moe model"):
        model.load_weight("model.layers.0.mlp.unknown.weight", torch.zeros(1))


def test_bfloat16_engine_keeps_the_correction_bias_in_float32_and_takes_it_in_bfloat16() -> None:
    """A refit casts every weight to the engine's dtype; the float32 bias is cast back when it loads."""
    model = DecoderLM.from_pretrained(asset("glm4_moe"), dtype=torch.bfloat16)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert model.weights_manifest()[name] == ((8,), torch.bfloat16)
    model.load_weight(name, torch.full((8,), 0.5, dtype=torch.bfloat16))
    assert dict(model.named_weights())[name].dtype == torch.float32
    ids = torch.randint(3, 104, (2, 12), generator=torch.Generator().manual_seed(4))
    assert torch.isfinite(model.forward(ids)).all()
