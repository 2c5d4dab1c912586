"""Hugging Face <-> Megatron weight conversion, without megatron-core: every family, TP=2 x PP=2, bit-exact.

The distributed test (tests/distributed/test_megatron_worker.py) checks that the Megatron layouts produced
here are the ones megatron-core's ``GPTModel`` computes with (its logits match transformers').
"""

from __future__ import annotations

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

from nemo_rl.config.model_arch import ModelArch
from nemo_rl.models.hf_decoder import decoder_arch
from nemo_rl.models.megatron.convert import Kind, WeightRule, pad_vocab, to_hugging_face, to_megatron
from nemo_rl.models.megatron.families import DecoderFamily, family_for

COMMON: dict[str, Any] = dict(
    vocab_size=101,  # odd: TP=2 pads the vocabulary to 102
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TP, PP = 2, 2
STAGE_LAYERS = [[0, 1], [2, 3]]


def make_hf(kind: str, tie: bool, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(0)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=tie, **COMMON, **overrides))
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=tie, head_dim=12, **COMMON, **overrides))
    return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=tie, **COMMON, **overrides))


def shard_everything(
    hf: PreTrainedModel, family: DecoderFamily, arch: ModelArch
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """Megatron state of every (pp, tp) rank, built from the HF state dict as the workers do."""
    state = hf.state_dict()
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for pp, layers in enumerate(STAGE_LAYERS):
        rules = family.stage_rules(arch, layers, first_stage=pp == 0, last_stage=pp == PP - 1, te_norms=False)
        for tp in range(TP):
            shards[pp, tp] = {
                rule.megatron: to_megatron(
                    rule,
                    [state[name] for name in rule.hf],
                    tp_rank=tp,
                    tp_size=TP,
                    attention=family.attention_shape(arch),
                    padded_vocab=pad_vocab(arch.vocab_size, TP),
                ).clone()
                for rule in rules
            }
    return shards


def gather_back(
    shards: dict[tuple[int, int], dict[str, torch.Tensor]], family: DecoderFamily, arch: ModelArch
) -> dict[str, torch.Tensor]:
    """The HF tensors every stage exports, rebuilt from its TP shards."""
    out: dict[str, torch.Tensor] = {}
    for pp, layers in enumerate(STAGE_LAYERS):
        rules = family.stage_rules(arch, layers, first_stage=pp == 0, last_stage=pp == PP - 1, te_norms=False)
        for rule in rules:
            if not rule.exported:
                continue
            pieces = [shards[pp, tp][rule.megatron] for tp in range(TP)]
            tensors = to_hugging_face(
                rule, pieces, attention=family.attention_shape(arch), vocab_size=arch.vocab_size
            )
            for name, tensor in zip(rule.hf, tensors, strict=True):
                assert name not in out, f"{name} exported twice"
                out[name] = tensor
    return out


@pytest.mark.parametrize(
    ("kind", "tie", "overrides"),
    [
        ("qwen2", True, {}),
        ("qwen2", False, {}),
        ("qwen3", False, {}),
        ("qwen3", True, {}),
        ("llama", False, {}),
        ("llama", True, {"attention_bias": True, "mlp_bias": True}),
    ],
)
def test_round_trip_through_tp2_pp2_is_bit_exact(kind: str, tie: bool, overrides: dict[str, Any]) -> None:
    hf = make_hf(kind, tie, **overrides)
    arch = decoder_arch(hf.config)
    family = family_for(arch)
    back = gather_back(shard_everything(hf, family, arch), family, arch)
    # Exactly the parameters a HF checkpoint stores (a tied LM head once, as the embedding).
    assert set(back) == {name for name, _ in hf.named_parameters()}
    state = hf.state_dict()
    for name, tensor in back.items():
        assert torch.equal(tensor, state[name]), name


def test_shards_have_megatron_layouts() -> None:
    hf = make_hf("qwen2", tie=True)
    arch = decoder_arch(hf.config)
    family = family_for(arch)
    shards = shard_everything(hf, family, arch)
    state = hf.state_dict()
    d, g = arch.head_dim, arch.num_heads // arch.num_kv_heads
    # TP rank 1 holds query group 1 (KV head 1): its G query heads, then its key head, then its value head.
    qkv = shards[0, 1]["decoder.layers.0.self_attention.linear_qkv.weight"]
    prefix = "model.layers.0.self_attn."
    assert torch.equal(qkv[: g * d], state[prefix + "q_proj.weight"][g * d : 2 * g * d])
    assert torch.equal(qkv[g * d : (g + 1) * d], state[prefix + "k_proj.weight"][d : 2 * d])
    assert torch.equal(qkv[(g + 1) * d :], state[prefix + "v_proj.weight"][d : 2 * d])
    # SwiGLU: each rank stacks its slice of gate_proj, then of up_proj.
    fc1 = shards[1, 0]["decoder.layers.1.mlp.linear_fc1.weight"]
    half = arch.intermediate_size // TP
    assert torch.equal(fc1[:half], state["model.layers.3.mlp.gate_proj.weight"][:half])
    assert torch.equal(fc1[half:], state["model.layers.3.mlp.up_proj.weight"][:half])
    # Row-parallel projections are split along their input dim.
    proj = shards[0, 1]["decoder.layers.1.self_attention.linear_proj.weight"]
    assert torch.equal(proj, state["model.layers.1.self_attn.o_proj.weight"][:, arch.num_heads * d // TP :])
    # The vocabulary is padded with zero rows to a multiple of TP; the tied head's copy lives on the last stage.
    embedding = shards[0, 1]["embedding.word_embeddings.weight"]
    assert embedding.shape[0] == pad_vocab(arch.vocab_size, TP) // TP == 51
    assert torch.equal(embedding[-1], torch.zeros(arch.hidden_size))
    assert torch.equal(shards[1, 0]["output_layer.weight"], state["model.embed_tokens.weight"][:51])
    assert "embedding.word_embeddings.weight" not in shards[1, 0]


def test_transformer_engine_names_fuse_the_norms() -> None:
    arch = decoder_arch(make_hf("qwen3", tie=False).config)
    rules = family_for(arch).layer_rules(arch, local=0, layer=5, te_norms=True)
    by_hf = {rule.hf: rule for rule in rules}
    assert by_hf[("model.layers.5.input_layernorm.weight",)].megatron == (
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    )
    assert by_hf[("model.layers.5.post_attention_layernorm.weight",)].megatron == (
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    )
    assert by_hf[("model.layers.5.self_attn.q_norm.weight",)].kind is Kind.REPLICATED


def test_model_options_follow_the_config() -> None:
    arch = decoder_arch(make_hf("qwen3", tie=False).config)
    options = family_for(arch).model_options(arch)
    assert options["kv_channels"] == 12  # Qwen3's head_dim differs from hidden_size / heads
    assert options["qk_layernorm"] and not options["add_qkv_bias"]
    assert family_for(decoder_arch(make_hf("qwen2", tie=False).config)).model_options(
        decoder_arch(make_hf("qwen2", tie=False).config)
    )["add_qkv_bias"]


def test_unexpressible_variants_fail_clearly() -> None:
    arch = decoder_arch(make_hf("llama", tie=False, attention_bias=True).config)
    with pytest.raises(ValueError, match="add_bias_linear"):
        family_for(arch)


def test_wrong_tensor_count_is_an_error() -> None:
    rule = WeightRule("x", ("a", "b"), Kind.GATE_UP)
    arch = decoder_arch(make_hf("qwen2", tie=False).config)
    with pytest.raises(ValueError, match="made of 2 tensors"):
        to_megatron(
            rule,
            [torch.zeros(2)],
            tp_rank=0,
            tp_size=1,
            attention=family_for(arch).attention_shape(arch),
            padded_vocab=arch.vocab_size,
        )


def test_moe_rules_split_experts_over_expert_parallel_ranks_bit_exactly() -> None:
    """Qwen3-MoE with EP=2: each rank holds the router and 4 of the 8 experts of every layer (per-expert
    checkpoint weights fused into its local experts' fc1 / fc2); the union of the ranks' exports is the
    checkpoint, bit for bit, and only the experts differ between ranks."""
    from pathlib import Path

    from safetensors.torch import load_file

    from nemo_rl.models.hf_config import load_hf_config

    path = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_qwen3_moe_init"
    arch = decoder_arch(load_hf_config(str(path)))
    family = family_for(arch)
    assert arch.moe is not None and family.model_options(arch)["num_moe_experts"] == 8
    state = load_file(path / "model.safetensors")
    layers = list(range(arch.num_layers))
    exported: list[dict[str, torch.Tensor]] = []
    for ep_rank in range(2):
        experts = range(4 * ep_rank, 4 * ep_rank + 4)
        rules = family.stage_rules(
            arch, layers, first_stage=True, last_stage=True, te_norms=False, experts=experts
        )
        local = {
            rule.megatron: to_megatron(
                rule,
                [state[name] for name in rule.hf],
                tp_rank=0,
                tp_size=1,
                attention=family.attention_shape(arch),
                padded_vocab=arch.vocab_size,
            )
            for rule in rules
        }
        fc1 = local["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
        expert = 4 * ep_rank + 2
        assert torch.equal(fc1[:64], state[f"model.layers.1.mlp.experts.{expert}.gate_proj.weight"])
        assert torch.equal(
            local["decoder.layers.0.mlp.router.weight"], state["model.layers.0.mlp.gate.weight"]
        )
        out = {}
        for rule in rules:
            if rule.exported and (ep_rank == 0 or rule.expert):
                tensors = to_hugging_face(
                    rule,
                    [local[rule.megatron]],
                    attention=family.attention_shape(arch),
                    vocab_size=arch.vocab_size,
                )
                out |= dict(zip(rule.hf, tensors, strict=True))
        exported.append(out)
    assert not set(exported[0]) & set(exported[1])
    assert set(exported[0]) | set(exported[1]) == set(state)
    for name, tensor in (exported[0] | exported[1]).items():
        assert torch.equal(tensor, state[name]), name
