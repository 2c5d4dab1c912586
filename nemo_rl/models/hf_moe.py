"""Mixture-of-experts weights of a Hugging Face checkpoint, for nemo_rl's own decoder (the embedded engine);
the layers' layout, :class:`~nemo_rl.config.model_arch.MoeArch`, is part of the architecture record.

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
from typing import TypeVar

import torch

DtypeT = TypeVar("DtypeT")


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
