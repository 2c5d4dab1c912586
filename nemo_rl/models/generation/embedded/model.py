"""A pure-torch decoder-only transformer for inference, for the Llama, Qwen2 and Qwen3 families, the
Qwen3-MoE and GLM-4-MoE mixture-of-experts families (their MoE block in :mod:`.moe`) and the language models
of Qwen2-VL and Qwen2.5-VL (:mod:`.vision` adds their vision tower).

The model is built from a Hugging Face config and holds its weights under their exact Hugging Face names
(``model.layers.3.self_attn.q_proj.weight``...), so checkpoints and refit streams load by name with no
conversion. For speed the projections that read the same input are stored fused: ``q_proj``/``k_proj``/
``v_proj`` are row slices of one ``[q + k + v, hidden]`` buffer and ``gate_proj``/``up_proj`` of one
``[2 * intermediate, hidden]`` buffer. The Hugging Face-named tensors are *views* into those buffers, so
loading a named weight writes straight into the fused storage and nothing has to be re-fused after a refit.

The model knows nothing about batching policy or sampling (that is the engine's job); it offers a prefill
over right-padded prompts that fills a KV cache (only the real tokens run through the layers, and the rows
are left-aligned in the cache, see :class:`~.kv_cache.KVCache`), and a one-token decode step over rows of
that cache. All three forward passes (``forward``, ``prefill``, ``decode``) share one layer body over token rows
``[M, H]`` and differ only in how attention reads keys and values.

Tensor legend: B = rows (sequences), T = tokens, H = hidden size, V = vocabulary, N = attention heads,
K = key/value heads, G = N // K query heads per key/value head, D = head dim, L = layers, S = cache slots,
R = B * K (a row's key/value head), M = token rows (B * T, or the packed real tokens of a prefill).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nemo_rl.config.model_arch import ModelArch
from nemo_rl.models.generation.embedded.kv_cache import KVCache, prefill_attention_mask
from nemo_rl.models.generation.embedded.layer_ops import (
    Attend,
    LayerWeights,
    linear,
    residual_linear,
    rms_norm,
    rotate,
    transposed,
)
from nemo_rl.models.generation.embedded.moe import bind_moe_weights, moe_mlp, plan_moe_storage
from nemo_rl.models.generation.embedded.mrope import ImagePrefill
from nemo_rl.models.hf_decoder import decoder_arch, iter_safetensors, rope_inv_freq
from nemo_rl.models.hf_moe import expert_weight_names, per_expert_manifest

__all__ = ["DecoderLM", "KVCache", "iter_safetensors"]

# Names some checkpoints carry that are derived buffers, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

WeightManifest = dict[str, tuple[tuple[int, ...], torch.dtype]]
"""Hugging Face parameter name -> (shape, dtype) of every weight a receiver expects."""


@dataclass(frozen=True)
class _Slot:
    """Where a Hugging Face-named weight lives: rows ``[start, end)`` of a storage buffer."""

    buffer: str
    start: int
    end: int


class DecoderLM:
    """A Llama/Qwen2/Qwen3 causal LM for inference whose weights carry Hugging Face names.

    Build it with :meth:`from_pretrained` (a Hugging Face checkpoint folder) or with the constructor plus
    :meth:`load_weights` (any stream of ``(name, tensor)``). Weights are uninitialised until loaded.
    """

    def __init__(
        self,
        arch: ModelArch,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        prefix: str = "model.",
    ):
        self.arch = arch
        self.prefix = prefix
        """Name prefix of the decoder's weights: ``model.``, or ``model.language_model.`` inside a
        vision-language model (:mod:`.vision`)."""
        self.dtype = dtype
        self.device = torch.device(device)
        self._layout: dict[str, tuple[int, ...]] = {}  # storage buffer -> shape
        self._slots: dict[str, _Slot] = {}  # HF name -> slot
        self._float32: set[str] = set()  # buffers kept in float32 whatever the model's dtype
        # A checkpoint's per-expert names -> (3-D weight, expert, gate/up half or None); a refit sends the 3-D ones.
        self._expert_names: dict[str, tuple[str, int, int | None]] = {}
        self._pieces: dict[str, list[str]] = {}
        """The per-expert checkpoint names of each 3-D expert weight."""
        self._plan_storage()
        self._buffers: dict[str, torch.Tensor] = {
            name: torch.empty(
                shape, dtype=torch.float32 if name in self._float32 else dtype, device=self.device
            )
            for name, shape in self._layout.items()
        }
        self._bind_views()
        self._rope_cos = torch.empty(0)
        self._rope_sin = torch.empty(0)
        self._build_rope_table(1024)
        self.routing_sink: list[torch.Tensor] | None = None
        """When a list, every MoE layer of the next forward passes appends the experts ``[M, K]`` it chose."""

    # ----------------------------------------------------------------------------------------------------
    # Weight storage: fused buffers, Hugging Face-named views.

    def _add(
        self,
        buffer: str,
        shape: tuple[int, ...],
        names_rows: list[tuple[str, int]] | None = None,
        float32: bool = False,
    ) -> None:
        """Declare a storage buffer; ``names_rows`` splits its dim 0 among HF names, else it is one HF name;
        ``float32`` keeps it in float32 (as ``transformers`` keeps the MoE router's correction bias)."""
        self._layout[buffer] = shape
        if float32:
            self._float32.add(buffer)
        if names_rows is None:
            self._slots[buffer] = _Slot(buffer, 0, shape[0])
            return
        start = 0
        for name, rows in names_rows:
            self._slots[name] = _Slot(buffer, start, start + rows)
            start += rows
        assert start == shape[0], (buffer, start, shape)

    def _plan_storage(self) -> None:
        a = self.arch
        h, q, kv, i = a.hidden_size, a.q_size, a.kv_size, a.intermediate_size
        self._add(self.prefix + "embed_tokens.weight", (a.vocab_size, h))
        for layer in range(a.num_layers):
            p = f"{self.prefix}layers.{layer}."
            attn, mlp = p + "self_attn.", p + "mlp."
            self._add(p + "input_layernorm.weight", (h,))
            self._add(p + "post_attention_layernorm.weight", (h,))
            qkv_names = [
                (attn + "q_proj.weight", q),
                (attn + "k_proj.weight", kv),
                (attn + "v_proj.weight", kv),
            ]
            self._add(attn + "qkv_proj.weight", (q + 2 * kv, h), qkv_names)
            if a.qkv_bias:
                bias_names = [(n.replace(".weight", ".bias"), r) for n, r in qkv_names]
                self._add(attn + "qkv_proj.bias", (q + 2 * kv,), bias_names)
            self._add(attn + "o_proj.weight", (h, q))
            if a.o_bias:
                self._add(attn + "o_proj.bias", (h,))
            if a.qk_norm:
                self._add(attn + "q_norm.weight", (a.head_dim,))
                self._add(attn + "k_norm.weight", (a.head_dim,))
            if a.moe is not None and a.moe.sparse_layers[layer]:
                plan_moe_storage(self._add, mlp, h, a.moe)
                names = expert_weight_names(mlp + "experts.", a.moe.num_experts)
                self._expert_names.update(names)
                for piece, (weight, _, _) in names.items():
                    self._pieces.setdefault(weight, []).append(piece)
                continue
            self._add(
                mlp + "gate_up_proj.weight",
                (2 * i, h),
                [(mlp + "gate_proj.weight", i), (mlp + "up_proj.weight", i)],
            )
            self._add(mlp + "down_proj.weight", (h, i))
            if a.mlp_bias:
                self._add(
                    mlp + "gate_up_proj.bias",
                    (2 * i,),
                    [(mlp + "gate_proj.bias", i), (mlp + "up_proj.bias", i)],
                )
                self._add(mlp + "down_proj.bias", (h,))
        self._add(self.prefix + "norm.weight", (h,))
        if not a.tie_word_embeddings:
            self._add("lm_head.weight", (a.vocab_size, h))

    def _bind_views(self) -> None:
        """(Re)create the HF-named views and the per-layer references the forward pass reads."""
        self._named: dict[str, torch.Tensor] = {
            name: self._buffers[slot.buffer][slot.start : slot.end] for name, slot in self._slots.items()
        }
        b = self._buffers
        a = self.arch
        self._layers: list[LayerWeights] = []
        for layer in range(a.num_layers):
            p = f"{self.prefix}layers.{layer}."
            attn, mlp = p + "self_attn.", p + "mlp."
            self._layers.append(
                LayerWeights(
                    ln1=b[p + "input_layernorm.weight"],
                    ln2=b[p + "post_attention_layernorm.weight"],
                    qkv_t=b[attn + "qkv_proj.weight"].t(),
                    qkv_b=b.get(attn + "qkv_proj.bias"),
                    o_t=b[attn + "o_proj.weight"].t(),
                    o_b=b.get(attn + "o_proj.bias"),
                    q_norm=b.get(attn + "q_norm.weight"),
                    k_norm=b.get(attn + "k_norm.weight"),
                    gate_up_t=transposed(b.get(mlp + "gate_up_proj.weight")),
                    gate_up_b=b.get(mlp + "gate_up_proj.bias"),
                    down_t=transposed(b.get(mlp + "down_proj.weight")),
                    down_b=b.get(mlp + "down_proj.bias"),
                    moe=bind_moe_weights(b, mlp) if mlp + "experts.down_proj" in b else None,
                )
            )
        self._embed = b[self.prefix + "embed_tokens.weight"]
        self._final_norm = b[self.prefix + "norm.weight"]
        self._lm_head_t = (self._embed if a.tie_word_embeddings else b["lm_head.weight"]).t()

    def to(self, device: torch.device | str) -> DecoderLM:
        """Move the weights to ``device`` in place (e.g. offload to host between colocated generations)."""
        device = torch.device(device)
        if device == self.device:
            return self
        pin = device.type == "cpu" and torch.cuda.is_available()
        moved = {}
        for name, t in self._buffers.items():
            moved[name] = t.to(device).pin_memory() if pin else t.to(device)
        self._buffers = moved
        self.device = device
        self._bind_views()
        self._rope_cos = self._rope_cos.to(device)
        self._rope_sin = self._rope_sin.to(device)
        return self

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight under its Hugging Face name (views into the fused storage)."""
        yield from self._named.items()

    def weights_manifest(self) -> WeightManifest:
        """Name -> (shape, dtype) of every weight this model must receive (tied ``lm_head.weight`` excluded), in
        the model's dtype: a refit casts every weight to it, and a weight kept in float32 is cast back on load.
        A MoE layer's experts are listed one by one under their checkpoint names (what a refit sends,
        :func:`~nemo_rl.models.hf_moe.per_expert_manifest`)."""
        return per_expert_manifest({name: (tuple(t.shape), self.dtype) for name, t in self._named.items()})

    @property
    def num_weight_bytes(self) -> int:
        """Bytes held by the weights."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def load_weight(self, name: str, tensor: torch.Tensor) -> int:
        """Copy one Hugging Face-named tensor into the model (casting to its dtype); return the bytes read.

        A tied model ignores ``lm_head.weight`` (it is the embedding), and derived buffers such as
        ``rotary_emb.inv_freq`` are ignored, as are the multi-token-prediction layers some MoE checkpoints
        (GLM-4.5) keep after the last decoder layer, which the causal LM does not run (transformers skips them
        too); all return 0. Any other unknown name or a shape mismatch raises.
        """
        target = self._named.get(name)
        if target is None:
            target = self._expert_view(name)
        if target is None:
            if (
                (name == "lm_head.weight" and self.arch.tie_word_embeddings)
                or name.endswith(_IGNORED_SUFFIXES)
                or self._is_extra_layer(name)
            ):
                return 0
            raise KeyError(
                f"weight {name!r} is not part of this {self.arch.model_type} model "
                f"(expected names like {next(iter(self._named))!r}); check the model the weights come from"
            )
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        return tensor.numel() * tensor.element_size()

    def _is_extra_layer(self, name: str) -> bool:
        """Whether ``name`` belongs to one of the checkpoint's multi-token-prediction layers after the last."""
        parts = name.split(".")
        if (
            self.arch.moe is None
            or len(parts) < 3
            or parts[:2] != ["model", "layers"]
            or not parts[2].isdigit()
        ):
            return False
        return 0 <= int(parts[2]) - self.arch.num_layers < self.arch.moe.num_extra_layers

    def _expert_view(self, name: str) -> torch.Tensor | None:
        """The rows of a 3-D expert weight that a checkpoint's per-expert ``name`` holds (None if not one)."""
        found = self._expert_names.get(name)
        if found is None:
            return None
        weight, expert, half = found
        view = self._named[weight][expert]
        if half is None:
            return view
        rows = view.shape[0] // 2
        return view[half * rows : (half + 1) * rows]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a stream of ``(hf_name, tensor)``; return the names that were written (see :meth:`load_weight`)."""
        loaded: set[str] = set()
        for name, tensor in named_tensors:
            if self.load_weight(name, tensor):
                # A 3-D expert weight is reported as the per-expert weights it holds (the manifest's names).
                loaded.update(self._pieces.get(name, (name,)))
        return loaded

    @classmethod
    def from_config(cls, config: Any, *, dtype: torch.dtype, device: torch.device | str = "cpu") -> DecoderLM:
        """The model of a ``transformers`` config, its weights uninitialised until loaded."""
        return cls(decoder_arch(config), dtype=dtype, device=device)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        config_overrides: Mapping[str, Any] | None = None,
    ) -> DecoderLM:
        """Build the model from a local Hugging Face checkpoint folder (``config.json`` + safetensors), its
        config attributes replaced by ``config_overrides`` (``policy.hf_config_overrides``)."""
        from nemo_rl.models.hf_config import load_hf_config

        folder = Path(path)
        config = load_hf_config(folder, overrides=config_overrides)
        model = cls.from_config(config, dtype=dtype, device=device)
        loaded = model.load_weights(iter_safetensors(folder))
        missing = sorted(set(model.weights_manifest()) - loaded)
        if missing:
            raise ValueError(f"checkpoint {folder} lacks {len(missing)} weights, e.g. {missing[:5]}")
        return model

    # ----------------------------------------------------------------------------------------------------
    # Forward passes.

    def _build_rope_table(self, num_positions: int) -> None:
        """Tables ``[P, 1, D]`` for positions ``0..P-1``: ``[cos, cos]`` and ``[-sin, sin]`` (see
        :func:`~.layer_ops.rotate`), computed in fp32 as Hugging Face does, then cast. The unit dim broadcasts
        over heads, so indexing by positions gives the ``[B, 1, D]`` a decode step needs in one op."""
        inv_freq, scaling = rope_inv_freq(self.arch)
        inv_freq = inv_freq.to(self.device)
        freqs = torch.arange(num_positions, device=self.device).float()[:, None] * inv_freq[None, :]
        cos, sin = (freqs.cos() * scaling).to(self.dtype), (freqs.sin() * scaling).to(self.dtype)
        self._rope_cos = torch.cat((cos, cos), dim=-1)[:, None, :]
        self._rope_sin = torch.cat((-sin, sin), dim=-1)[:, None, :]

    def ensure_positions(self, num_positions: int) -> None:
        """Make the rotary table cover positions ``0..num_positions-1``."""
        if self._rope_cos.shape[0] < num_positions:
            self._build_rope_table(max(num_positions, 2 * self._rope_cos.shape[0]))

    def _layer(
        self, layer: int, x_MH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Decoder layer ``layer`` over token rows ``x [M, H]``; ``attend(layer, q [M, N, D], k, v [M, K, D])``
        returns the attention output ``[M, N * D]`` (the three forward passes differ only there)."""
        a, w = self.arch, self._layers[layer]
        h = rms_norm(x_MH, w.ln1, a.rms_norm_eps)
        heads = linear(h, w.qkv_t, w.qkv_b).view(-1, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
        n, k = a.num_heads, a.num_kv_heads
        if a.qk_norm:
            assert w.q_norm is not None and w.k_norm is not None
            q = rotate(rms_norm(heads[:, :n], w.q_norm, a.rms_norm_eps), cos, sin)
            key = rotate(rms_norm(heads[:, n : n + k], w.k_norm, a.rms_norm_eps), cos, sin)
        else:
            qk = rotate(heads[:, : n + k], cos, sin)
            q, key = qk[:, :n], qk[:, n:]
        x_MH = residual_linear(x_MH, attend(layer, q, key, heads[:, n + k :]), w.o_t, w.o_b)
        if w.moe is not None:
            assert a.moe is not None
            return x_MH + moe_mlp(rms_norm(x_MH, w.ln2, a.rms_norm_eps), w.moe, a.moe, self.routing_sink)
        assert w.gate_up_t is not None and w.down_t is not None
        gate_up = linear(rms_norm(x_MH, w.ln2, a.rms_norm_eps), w.gate_up_t, w.gate_up_b)
        i = a.intermediate_size
        act = F.silu(gate_up[:, :i], inplace=True).mul_(gate_up[:, i:])
        return residual_linear(x_MH, act, w.down_t, w.down_b)

    def _logits(self, x_MH: torch.Tensor) -> torch.Tensor:
        return torch.mm(rms_norm(x_MH, self._final_norm, self.arch.rms_norm_eps), self._lm_head_t)

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of a right-padded batch (no cache); for tests and scoring."""
        a = self.arch
        num_rows, num_tokens = input_ids_BT.shape
        self.ensure_positions(num_tokens)
        cos = self._rope_cos[:num_tokens].repeat(num_rows, 1, 1)  # [B * T, 1, D]
        sin = self._rope_sin[:num_tokens].repeat(num_rows, 1, 1)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # Right padding: a real query at position t only sees keys 0..t, all real, so a causal mask is
            # exact; queries at pad positions produce values nobody reads.
            q, k, v = (t.reshape(num_rows, num_tokens, -1, a.head_dim).transpose(1, 2) for t in (q, k, v))
            attn = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=a.head_dim**-0.5, enable_gqa=a.num_kv_heads != a.num_heads
            )
            return attn.transpose(1, 2).reshape(num_rows * num_tokens, a.q_size)

        x = F.embedding(input_ids_BT.reshape(-1), self._embed)
        for layer in range(a.num_layers):
            x = self._layer(layer, x, cos, sin, attend)
        return self._logits(x).view(num_rows, num_tokens, -1)

    def prefill(
        self,
        input_ids_BT: torch.Tensor,
        input_lengths_B: torch.Tensor,
        cache: KVCache,
        images: ImagePrefill | None = None,
    ) -> torch.Tensor:
        """Run right-padded prompts, store their keys/values in cache rows ``0..B-1``, return last logits ``[B, V]``.

        ``images`` (prompts of a vision-language model) replaces the image placeholders' embeddings with the
        image features and the 1-D rotary positions with the multimodal ones (:mod:`.mrope`).

        The rows are left-aligned in the cache so that every prompt's last token sits in slot ``T - 1``
        (``T`` = the input width, at most the cache's slots); the next :meth:`decode` writes slot ``T``.
        Only the real tokens go through the layers (packed into ``M = sum(lengths)`` rows); attention reads
        them back from the cache, causal over slots and blind to the slots before each row's start.
        """
        a = self.arch
        num_rows, width = input_ids_BT.shape
        self.ensure_positions(width)
        start_B = width - input_lengths_B
        cache.set_starts(start_B)
        rows_M, positions_M = (
            (torch.arange(width, device=input_ids_BT.device)[None, :] < input_lengths_B[:, None])
            .nonzero()
            .unbind(1)
        )
        slots_M = start_B[rows_M] + positions_M
        allowed_B1TT = prefill_attention_mask(start_B, width)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.keys[layer], cache.values[layer]
            keys[rows_M, :, slots_M] = k
            values[rows_M, :, slots_M] = v
            q_BTND = q.new_zeros((num_rows, width, a.num_heads, a.head_dim))
            q_BTND[rows_M, slots_M] = q
            attn = F.scaled_dot_product_attention(
                q_BTND.transpose(1, 2),
                keys[:num_rows, :, :width],
                values[:num_rows, :, :width],
                attn_mask=allowed_B1TT,
                scale=a.head_dim**-0.5,
                enable_gqa=a.num_kv_heads != a.num_heads,
            )
            return attn.transpose(1, 2)[rows_M, slots_M].reshape(-1, a.q_size)

        ids_M = input_ids_BT[rows_M, positions_M]
        x = F.embedding(ids_M, self._embed)
        if images is None:
            cos, sin = self._rope_cos[positions_M], self._rope_sin[positions_M]
        else:
            x = images.write_features(x, ids_M)
            cos, sin = images.rope_tables(self._rope_cos, self._rope_sin, rows_M, positions_M)
        for layer in range(a.num_layers):
            x = self._layer(layer, x, cos, sin, attend)
        last_B = torch.cumsum(input_lengths_B, 0) - 1
        return self._logits(x[last_B])

    def decode(
        self, tokens_B: torch.Tensor, positions_B: torch.Tensor, cache: KVCache, num_slots: int
    ) -> torch.Tensor:
        """One step for cache rows ``0..B-1``: token ``tokens_B[b]`` sits at ``positions_B[b]``; return logits ``[B, V]``.

        Rows advance in lockstep: every row's new keys and values go to slot ``num_slots - 1`` (so
        ``start_B[b] + positions_B[b] == num_slots - 1``), and the step attends over slots ``0..num_slots-1``.
        """
        a = self.arch
        num_rows = tokens_B.shape[0]
        slot = num_slots - 1
        mask_R1S = cache.mask_BK1S[:num_rows, :, :, :num_slots].flatten(0, 1)  # R = B * K (row, kv head)
        scale = a.head_dim**-0.5
        group = a.num_heads // a.num_kv_heads

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.keys[layer], cache.values[layer]
            keys[:num_rows, :, slot] = k
            values[:num_rows, :, slot] = v
            # Grouped-query attention without repeating keys: the G query heads of a key/value head are the
            # rows of one small matmul, and scale and mask come with it. Plain batched matmuls beat the fused
            # CPU kernels at one query position, where reading the cache is the whole cost.
            q_RGD = q.reshape(num_rows * a.num_kv_heads, group, a.head_dim)
            keys_RSD = keys[:num_rows, :, :num_slots].flatten(0, 1)
            scores_RGS = torch.baddbmm(mask_R1S, q_RGD, keys_RSD.transpose(1, 2), alpha=scale)
            values_RSD = values[:num_rows, :, :num_slots].flatten(0, 1)
            return torch.bmm(torch.softmax(scores_RGS, dim=-1), values_RSD).view(num_rows, a.q_size)

        x = F.embedding(tokens_B, self._embed)
        cos, sin = self._rope_cos[positions_B], self._rope_sin[positions_B]  # [B, 1, D]
        for layer in range(a.num_layers):
            x = self._layer(layer, x, cos, sin, attend)
        return self._logits(x)
