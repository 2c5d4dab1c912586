"""The mixture-of-experts facts of a Hugging Face config, for nemo_rl's own decoder (the embedded engine).

Two routers are supported, each exactly as ``transformers`` computes it:

- ``softmax`` (``qwen3_moe``): softmax over the router logits, the top-k experts, their probabilities
  renormalised to sum to 1 when ``norm_topk_prob``; no shared expert.
- ``sigmoid`` (``glm4_moe``, the DeepSeek-V3 MoE layer on ordinary attention): sigmoid scores, the top-k
  chosen on ``score + e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` expert groups,
  weights the unbiased scores (renormalised when ``norm_topk_prob``) times ``routed_scaling_factor``; a
  shared expert MLP is added to every token; the first ``first_k_dense_replace`` layers are dense.

In ``transformers`` 5 a layer's experts are two 3-D parameters, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``
(gate rows first) and ``mlp.experts.down_proj`` ``[E, H, I]``; checkpoints on disk keep one linear per
expert (``mlp.experts.{e}.gate_proj.weight``...), which :func:`expert_weight_names` maps to rows of those (and
:func:`per_expert_weights` makes from them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

DECODER_MOE_MODEL_TYPES = ("qwen3_moe", "glm4_moe")
"""Hugging Face ``model_type`` of the mixture-of-experts families nemo_rl's own decoder runs."""

RouterKind = Literal["softmax", "sigmoid"]
DtypeT = TypeVar("DtypeT")


@dataclass(frozen=True)
class MoeArch:
    """A decoder's mixture-of-experts layers, read (and checked) from its Hugging Face config."""

    router: RouterKind
    """How the router scores experts (see the module docstring)."""
    num_experts: int
    """Routed experts per MoE layer (E)."""
    top_k: int
    """Experts each token is routed to."""
    expert_intermediate_size: int
    """Width of one expert's gated MLP (I)."""
    norm_topk_prob: bool
    """Renormalise the chosen experts' weights to sum to 1."""
    shared_intermediate_size: int
    """Width of the shared-expert MLP added to every token; 0 without one."""
    num_groups: int
    """Expert groups of the sigmoid router (1: no group limit)."""
    topk_groups: int
    """Groups the sigmoid router keeps before choosing experts."""
    routed_scaling_factor: float
    """Factor on the sigmoid router's weights."""
    sparse_layers: tuple[bool, ...]
    """Per decoder layer: whether its MLP is a MoE block (else a dense MLP of ``intermediate_size``)."""
    num_extra_layers: int = 0
    """Multi-token-prediction layers a checkpoint may hold after the last decoder layer (GLM-4.5's
    ``num_nextn_predict_layers``); the causal LM never runs them."""

    @classmethod
    def from_hf_config(cls, config: Any) -> MoeArch:
        """Read a ``qwen3_moe`` or ``glm4_moe`` ``PretrainedConfig``."""
        model_type = config.model_type
        num_layers = config.num_hidden_layers
        if model_type == "qwen3_moe":
            skip = set(getattr(config, "mlp_only_layers", None) or [])
            step = config.decoder_sparse_step
            return cls(
                router="softmax",
                num_experts=config.num_experts,
                top_k=config.num_experts_per_tok,
                expert_intermediate_size=config.moe_intermediate_size,
                norm_topk_prob=bool(config.norm_topk_prob),
                shared_intermediate_size=0,
                num_groups=1,
                topk_groups=1,
                routed_scaling_factor=1.0,
                sparse_layers=tuple(
                    i not in skip and config.num_experts > 0 and (i + 1) % step == 0
                    for i in range(num_layers)
                ),
            )
        if model_type == "glm4_moe":
            num_experts = config.n_routed_experts
            if num_experts % config.n_group != 0:
                raise ValueError(
                    f"n_routed_experts ({num_experts}) must be a multiple of n_group ({config.n_group})"
                )
            return cls(
                router="sigmoid",
                num_experts=num_experts,
                top_k=config.num_experts_per_tok,
                expert_intermediate_size=config.moe_intermediate_size,
                norm_topk_prob=bool(config.norm_topk_prob),
                shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                num_groups=config.n_group,
                topk_groups=config.topk_group,
                routed_scaling_factor=float(config.routed_scaling_factor),
                sparse_layers=tuple(i >= config.first_k_dense_replace for i in range(num_layers)),
                num_extra_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0),
            )
        raise ValueError(
            f"no mixture-of-experts layout for model type {model_type!r} (known: {DECODER_MOE_MODEL_TYPES})"
        )


def expert_weight_names(prefix: str, num_experts: int) -> dict[str, tuple[str, int, int | None]]:
    """Per-expert checkpoint names of one MoE layer -> ``(3-D weight name, expert, half)``.

    ``prefix`` is the layer's ``...mlp.experts.``; ``half`` is 0 for the gate rows and 1 for the up rows of
    ``gate_up_proj``, ``None`` for the whole expert of ``down_proj``.
    """
    names: dict[str, tuple[str, int, int | None]] = {}
    for e in range(num_experts):
        names[f"{prefix}{e}.gate_proj.weight"] = (prefix + "gate_up_proj", e, 0)
        names[f"{prefix}{e}.up_proj.weight"] = (prefix + "gate_up_proj", e, 1)
        names[f"{prefix}{e}.down_proj.weight"] = (prefix + "down_proj", e, None)
    return names


def per_expert_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with each 3-D expert tensor (``transformers`` 5's in-memory layout, what a refit sends) split
    into the per-expert checkpoint weights that loaders written for checkpoints (vLLM's) expect; other weights
    pass unchanged. The pieces are views of the 3-D tensor."""
    for name, tensor in named_tensors:
        prefix, _, last = name.rpartition(".")
        if (
            not prefix.endswith("mlp.experts")
            or tensor.ndim != 3
            or last not in ("gate_up_proj", "down_proj")
        ):
            yield name, tensor
            continue
        for expert, weight in enumerate(tensor.unbind(0)):
            if last == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", weight
            else:
                gate, up = weight.chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up


def per_expert_manifest(
    manifest: Mapping[str, tuple[tuple[int, ...], DtypeT]],
) -> dict[str, tuple[tuple[int, ...], DtypeT]]:
    """``manifest`` (``{name: (shape, dtype)}``) with each 3-D expert weight replaced by its per-expert
    checkpoint weights, as :func:`per_expert_weights` splits the stream: a refit of a MoE model moves one
    tensor per expert, so an expert-parallel sender can send only the experts it holds."""
    expanded: dict[str, tuple[tuple[int, ...], DtypeT]] = {}
    for name, (shape, dtype) in manifest.items():
        prefix, _, last = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or len(shape) != 3 or last not in ("gate_up_proj", "down_proj"):
            expanded[name] = (shape, dtype)
            continue
        num_experts, rows, cols = shape
        for expert in range(num_experts):
            if last == "down_proj":
                expanded[f"{prefix}.{expert}.down_proj.weight"] = ((rows, cols), dtype)
            else:
                expanded[f"{prefix}.{expert}.gate_proj.weight"] = ((rows // 2, cols), dtype)
                expanded[f"{prefix}.{expert}.up_proj.weight"] = ((rows // 2, cols), dtype)
    return expanded
