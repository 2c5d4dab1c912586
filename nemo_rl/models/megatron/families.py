"""Per model family: the Megatron-core ``GPTModel`` settings and the weight rules of a Hugging Face decoder.

A :class:`DecoderFamily` knows, for one Hugging Face ``model_type``, which ``TransformerConfig`` /
``GPTModel`` options reproduce its architecture (:meth:`~DecoderFamily.model_options`) and which Megatron
parameter is built from which Hugging Face tensors on a pipeline stage (:meth:`~DecoderFamily.stage_rules`);
:mod:`nemo_rl.models.megatron.convert` does the tensor work. The families share one decoder layout (RMSNorm,
SwiGLU, grouped-query attention with rotary embeddings) and differ in their biases and query/key norms:

- ``llama``: ``attention_bias`` adds q/k/v/o biases, ``mlp_bias`` MLP biases;
- ``qwen2``: q/k/v biases always, no o_proj or MLP bias;
- ``qwen3``: RMSNorm on each query and key head (``q_norm`` / ``k_norm``) before rotary embeddings;
- ``qwen3_moe`` / ``glm4_moe``: megatron-core's MoE layer (:class:`MoeDecoderFamily`): the router
  (``mlp.gate`` -> ``mlp.router``, GLM's ``e_score_correction_bias`` -> its ``expert_bias`` buffer), GLM's
  shared experts (``mlp.shared_experts``) and, per expert held by this expert-parallel rank, one gated MLP
  (``mlp.experts.{e}.gate_proj`` / ``up_proj`` -> ``mlp.experts.local_experts.{j}.linear_fc1``,
  ``down_proj`` -> ``linear_fc2``; ``e = ep_rank * E / EP + j``).

Megatron names are relative to the unwrapped ``GPTModel``; its decoder layers are numbered per stage (the
local index), Hugging Face's globally. Transformer Engine's layer spec fuses the pre-attention and pre-MLP
norms into ``linear_qkv`` / ``linear_fc1`` (``te_norms``), the local spec keeps them as modules.

With LoRA (:mod:`nemo_rl.models.megatron.lora`) an adapted Megatron linear layer carries the adapters of the
Hugging Face layers it fuses (:data:`ADAPTED_LINEARS`); their rules follow the layer's own, so a weight stream
brings each layer's adapters right after its weights.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_rl.config.model_arch import ModelArch
from nemo_rl.models.megatron.convert import AttentionShape, Kind, WeightRule


@dataclass(frozen=True)
class AdaptedLinear:
    """A linear layer of a Megatron decoder layer and the Hugging Face layers it computes (fused)."""

    megatron: str
    """Module path under the decoder layer, e.g. ``self_attention.linear_qkv``."""

    hf: tuple[str, ...]
    """Module paths under the Hugging Face decoder layer, in the order of the fused output."""

    column_parallel: bool
    """Output split over tensor-parallel ranks (``linear_qkv``, ``linear_fc1``); else the input is."""

    def adapter_name(self, local: int, hf: str, matrix: str) -> str:
        """Megatron name of the ``matrix`` (``lora_A`` / ``lora_B``) of Hugging Face layer ``hf``'s adapter."""
        return f"decoder.layers.{local}.{self.megatron}.lora.{hf.rsplit('.', 1)[-1]}.{matrix}"


ADAPTED_LINEARS: dict[str, AdaptedLinear] = {
    "linear_qkv": AdaptedLinear(
        "self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), True
    ),
    "linear_proj": AdaptedLinear("self_attention.linear_proj", ("self_attn.o_proj",), False),
    "linear_fc1": AdaptedLinear("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj"), True),
    "linear_fc2": AdaptedLinear("mlp.linear_fc2", ("mlp.down_proj",), False),
}
"""The adaptable linear layers by their ``policy.megatron_cfg.peft`` name."""


@dataclass(frozen=True)
class DecoderFamily:
    """How one Hugging Face decoder family maps onto megatron-core's ``GPTModel``."""

    model_type: str
    """Hugging Face ``config.model_type``."""

    architecture: str
    """Hugging Face causal-LM class of the family (``config.architectures[0]`` of its checkpoints)."""

    def check(self, arch: ModelArch) -> None:
        """Raise ``ValueError`` for an architecture variant ``GPTModel`` cannot reproduce."""
        if arch.o_bias != arch.mlp_bias:
            raise ValueError(
                f"this {self.model_type} config has o_proj bias={arch.o_bias} but MLP bias={arch.mlp_bias}; "
                "Megatron-core biases every linear layer or none (add_bias_linear): use the DTensor backend"
            )
        if arch.o_bias and not arch.qkv_bias:
            raise ValueError(
                f"this {self.model_type} config has an o_proj bias without q/k/v biases, which Megatron-core "
                "cannot express: use the DTensor backend"
            )

    def model_options(self, arch: ModelArch) -> dict[str, Any]:
        """``TransformerConfig`` fields that reproduce the architecture (sizes, norms, biases, activation)."""
        return {
            "num_layers": arch.num_layers,
            "hidden_size": arch.hidden_size,
            "ffn_hidden_size": arch.intermediate_size,
            "num_attention_heads": arch.num_heads,
            "num_query_groups": arch.num_kv_heads,
            "kv_channels": arch.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": arch.rms_norm_eps,
            "gated_linear_unit": True,
            "add_qkv_bias": arch.qkv_bias,
            "add_bias_linear": arch.o_bias,
            "qk_layernorm": arch.qk_norm,
        }

    def attention_shape(self, arch: ModelArch) -> AttentionShape:
        """The sizes the fused QKV layout depends on."""
        return AttentionShape(arch.num_heads, arch.num_kv_heads, arch.head_dim)

    def layer_rules(
        self,
        arch: ModelArch,
        local: int,
        layer: int,
        te_norms: bool,
        adapted: Collection[str] = (),
        experts: Sequence[int] = (),
    ) -> list[WeightRule]:
        """Rules of decoder layer ``layer`` (global index), held as local layer ``local`` of its stage, with the
        LoRA adapters of its ``adapted`` linear layers (:data:`ADAPTED_LINEARS` names) and, in a MoE layer,
        the routed ``experts`` (global indices) this rank holds."""
        m = f"decoder.layers.{local}."
        h = f"model.layers.{layer}."
        attn_norm = "self_attention.linear_qkv.layer_norm_weight" if te_norms else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te_norms else "pre_mlp_layernorm.weight"
        qkv = tuple(f"{h}self_attn.{p}_proj" for p in "qkv")
        rules = [
            WeightRule(m + attn_norm, (h + "input_layernorm.weight",), Kind.REPLICATED),
            WeightRule(m + "self_attention.linear_qkv.weight", tuple(n + ".weight" for n in qkv), Kind.QKV),
            WeightRule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), Kind.ROW),
            WeightRule(m + mlp_norm, (h + "post_attention_layernorm.weight",), Kind.REPLICATED),
            *self.mlp_rules(arch, m, h, layer, experts),
        ]
        if arch.qkv_bias:
            rules.append(
                WeightRule(m + "self_attention.linear_qkv.bias", tuple(n + ".bias" for n in qkv), Kind.QKV)
            )
        if arch.o_bias:  # with MLP biases too (checked): row-parallel biases are not split
            rules += [
                WeightRule(
                    m + "self_attention.linear_proj.bias", (h + "self_attn.o_proj.bias",), Kind.REPLICATED
                ),
                *_mlp_rules(m, h, "bias", down_kind=Kind.REPLICATED),
            ]
        if arch.qk_norm:
            rules += [
                WeightRule(
                    m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), Kind.REPLICATED
                ),
                WeightRule(
                    m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), Kind.REPLICATED
                ),
            ]
        return rules + _adapter_rules(local, h, adapted)

    def mlp_rules(
        self, arch: ModelArch, m: str, h: str, layer: int, experts: Sequence[int]
    ) -> list[WeightRule]:
        """The MLP weights of decoder layer ``layer`` (Megatron prefix ``m``, Hugging Face prefix ``h``)."""
        return _mlp_rules(m, h, "weight", down_kind=Kind.ROW)

    def stage_rules(
        self,
        arch: ModelArch,
        layers: Sequence[int],
        *,
        first_stage: bool,
        last_stage: bool,
        te_norms: bool,
        adapted: Mapping[int, Collection[str]] | None = None,
        experts: Sequence[int] = (),
        value_head: bool = False,
    ) -> list[WeightRule]:
        """Rules of one pipeline stage holding global decoder layers ``layers`` (in local order); ``adapted``
        names each global layer's LoRA-adapted linear layers, ``experts`` the routed experts this rank holds
        (global indices; MoE families). ``value_head``: the last stage ends in a value model's scalar head
        (``score.weight``, on every TP rank) instead of the LM head."""
        rules: list[WeightRule] = []
        if first_stage:
            rules.append(
                WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Kind.VOCAB)
            )
        for local, layer in enumerate(layers):
            rules += self.layer_rules(arch, local, layer, te_norms, (adapted or {}).get(layer, ()), experts)
        if last_stage:
            rules.append(
                WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",), Kind.REPLICATED)
            )
            if value_head:
                rules.append(WeightRule("output_layer.weight", ("score.weight",), Kind.REPLICATED))
            elif not arch.tie_word_embeddings:
                rules.append(WeightRule("output_layer.weight", ("lm_head.weight",), Kind.VOCAB))
            elif not first_stage:
                # With pipeline stages the last one keeps its own copy of the tied embedding (Megatron keeps the
                # two in step by all-reducing their gradients); Hugging Face stores it once.
                rules.append(
                    WeightRule(
                        "output_layer.weight", ("model.embed_tokens.weight",), Kind.VOCAB, exported=False
                    )
                )
        return rules


@dataclass(frozen=True)
class MoeDecoderFamily(DecoderFamily):
    """A decoder whose MLPs are (some or all) megatron-core MoE layers: Qwen3-MoE's softmax top-k router, or
    GLM-4-MoE's (DeepSeek-V3's) sigmoid router with a score-correction bias, expert groups, a routing scale
    and shared experts."""

    def check(self, arch: ModelArch) -> None:
        """Also refuse routing megatron-core's router computes differently from ``transformers``."""
        super().check(arch)
        moe = arch.moe
        assert moe is not None
        if moe.router == "softmax" and moe.shared_intermediate_size:
            raise ValueError(
                f"a softmax-routed {self.model_type} with shared experts is not built: use DTensor"
            )
        if moe.router == "sigmoid" and not moe.norm_topk_prob and moe.top_k > 1:
            raise ValueError(
                f"this {self.model_type} config has norm_topk_prob=false, but megatron-core renormalises a "
                "sigmoid router's top-k weights: use the DTensor backend"
            )
        # transformers ranks a group by its two best experts; megatron-core by its best top_k / topk_group.
        if moe.num_groups > 1 and moe.top_k // moe.topk_groups != 2:
            raise ValueError(
                f"this {self.model_type} config ranks expert groups by their top {moe.top_k // moe.topk_groups} "
                "experts in megatron-core but their top 2 in transformers: use the DTensor backend"
            )

    def model_options(self, arch: ModelArch) -> dict[str, Any]:
        """The dense options plus the MoE layer's: experts, their width, top-k and the router (softmax: top-k
        of the logits then a softmax over them, which is ``transformers``' renormalised top-k probabilities;
        sigmoid: with the correction bias as megatron-core's expert bias, groups and scale)."""
        moe = arch.moe
        assert moe is not None
        options = super().model_options(arch) | {
            "num_moe_experts": moe.num_experts,
            "moe_ffn_hidden_size": moe.expert_intermediate_size,
            "moe_router_topk": moe.top_k,
            "moe_layer_freq": [int(sparse) for sparse in moe.sparse_layers],
        }
        if moe.router == "softmax":
            return options | {
                "moe_router_score_function": "softmax",
                "moe_router_pre_softmax": not moe.norm_topk_prob,
            }
        return options | {
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_topk_scaling_factor": moe.routed_scaling_factor,
            "moe_router_num_groups": moe.num_groups if moe.num_groups > 1 else None,
            "moe_router_group_topk": moe.topk_groups if moe.num_groups > 1 else None,
            "moe_shared_expert_intermediate_size": moe.shared_intermediate_size or None,
        }

    def mlp_rules(
        self, arch: ModelArch, m: str, h: str, layer: int, experts: Sequence[int]
    ) -> list[WeightRule]:
        """A MoE layer's router (with its correction bias) and shared experts, on every rank, and the gated
        MLPs of this rank's ``experts``."""
        moe = arch.moe
        assert moe is not None
        if not moe.sparse_layers[layer]:
            return super().mlp_rules(arch, m, h, layer, experts)
        rules = [WeightRule(m + "mlp.router.weight", (h + "mlp.gate.weight",), Kind.REPLICATED)]
        if moe.router == "sigmoid":
            rules.append(
                WeightRule(
                    m + "mlp.router.expert_bias", (h + "mlp.gate.e_score_correction_bias",), Kind.REPLICATED
                )
            )
        if moe.shared_intermediate_size:
            rules += _mlp_rules(m, h, "weight", down_kind=Kind.ROW, module="mlp.shared_experts.")
        for local, expert in enumerate(experts):
            me, he = f"{m}mlp.experts.local_experts.{local}.", f"{h}mlp.experts.{expert}."
            rules += [
                WeightRule(
                    me + "linear_fc1.weight",
                    (he + "gate_proj.weight", he + "up_proj.weight"),
                    Kind.GATE_UP,
                    expert=True,
                ),
                WeightRule(me + "linear_fc2.weight", (he + "down_proj.weight",), Kind.ROW, expert=True),
            ]
        return rules


FAMILIES: dict[str, DecoderFamily] = {
    family.model_type: family
    for family in (
        DecoderFamily("llama", "LlamaForCausalLM"),
        DecoderFamily("qwen2", "Qwen2ForCausalLM"),
        DecoderFamily("qwen3", "Qwen3ForCausalLM"),
        MoeDecoderFamily("qwen3_moe", "Qwen3MoeForCausalLM"),
        MoeDecoderFamily("glm4_moe", "Glm4MoeForCausalLM"),
    )
}
"""The families the Megatron backend converts, by Hugging Face ``model_type``."""


def family_for(arch: ModelArch) -> DecoderFamily:
    """The family of ``arch`` (checked: raises ``ValueError`` naming what Megatron-core cannot express)."""
    family = FAMILIES.get(arch.model_type)
    if family is None:
        raise ValueError(
            f"the Megatron backend converts model types {sorted(FAMILIES)}, got {arch.model_type!r}; "
            "use the DTensor backend (policy.dtensor_cfg.enabled=true) for this model"
        )
    family.check(arch)
    return family


def _mlp_rules(m: str, h: str, suffix: str, *, down_kind: Kind, module: str = "mlp.") -> list[WeightRule]:
    """The gated MLP ``module`` (the layer's MLP, or a MoE layer's shared experts): its fused gate/up
    projection and its down projection, for their ``suffix`` (weight or bias); Megatron prefix ``m``,
    Hugging Face prefix ``h``."""
    return [
        WeightRule(
            m + f"{module}linear_fc1.{suffix}",
            (h + f"{module}gate_proj.{suffix}", h + f"{module}up_proj.{suffix}"),
            Kind.GATE_UP,
        ),
        WeightRule(m + f"{module}linear_fc2.{suffix}", (h + f"{module}down_proj.{suffix}",), down_kind),
    ]


def _adapter_rules(local: int, h: str, adapted: Collection[str]) -> list[WeightRule]:
    """The LoRA matrices of local layer ``local`` (Hugging Face prefix ``h``): per adapted Hugging Face layer,
    ``A`` replicated and ``B`` split by rows on a column-parallel layer, ``A`` split by columns and ``B``
    replicated on a row-parallel one."""
    rules = []
    for key, linear in ADAPTED_LINEARS.items():
        if key not in adapted:
            continue
        kind_A, kind_B = (
            (Kind.REPLICATED, Kind.COLUMN) if linear.column_parallel else (Kind.ROW, Kind.REPLICATED)
        )
        for hf in linear.hf:
            rules += [
                WeightRule(linear.adapter_name(local, hf, "lora_A"), (f"{h}{hf}.lora_A",), kind_A),
                WeightRule(linear.adapter_name(local, hf, "lora_B"), (f"{h}{hf}.lora_B",), kind_B),
            ]
    return rules
