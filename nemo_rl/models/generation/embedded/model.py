"""A pure-torch decoder-only transformer for inference, for the Llama, Qwen2 and Qwen3 families.

The model is built from a Hugging Face config and holds its weights under their exact Hugging Face names
(``model.layers.3.self_attn.q_proj.weight``...), so checkpoints and refit streams load by name with no
conversion. For speed the projections that read the same input are stored fused: ``q_proj``/``k_proj``/
``v_proj`` are row slices of one ``[q + k + v, hidden]`` buffer and ``gate_proj``/``up_proj`` of one
``[2 * intermediate, hidden]`` buffer. The Hugging Face-named tensors are *views* into those buffers, so
loading a named weight writes straight into the fused storage and nothing has to be re-fused after a refit.

The model knows nothing about batching policy or sampling (that is the engine's job); it offers a prefill
over right-padded prompts that fills a KV cache, and a one-token decode step over rows of that cache.

Tensor legend: B = rows (sequences), T = tokens, H = hidden size, V = vocabulary, N = attention heads,
K = key/value heads, G = N // K query heads per key/value head, D = head dim, L = layers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nemo_rl.models.hf_decoder import DecoderArch, iter_safetensors

__all__ = ["DecoderArch", "DecoderLM", "KVCache", "iter_safetensors"]

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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout, with full-width tables ``cos = [c, c]``, ``sin = [-s, s]``.

    Equal, bit for bit, to Hugging Face's ``x * cos + rotate_half(x) * sin`` (negation is exact), in four ops.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


class KVCache:
    """Preallocated keys and values, ``[L, 2, B, K, T, D]``; row ``b`` holds sequence ``b``'s tokens by position."""

    def __init__(
        self, arch: DecoderArch, num_rows: int, num_positions: int, dtype: torch.dtype, device: torch.device
    ):
        # Zeros, not empty: masked positions are still read, and garbage NaN/inf there would poison the
        # attention output (0 * NaN = NaN) even with a zero attention weight.
        self.data = torch.zeros(
            (arch.num_layers, 2, num_rows, arch.num_kv_heads, num_positions, arch.head_dim),
            dtype=dtype,
            device=device,
        )

    @property
    def num_rows(self) -> int:
        """Rows (sequences) the cache can hold."""
        return self.data.shape[2]

    @property
    def num_positions(self) -> int:
        """Positions (tokens) per row the cache can hold."""
        return self.data.shape[4]

    def compact(self, keep_rows: torch.Tensor, num_positions: int) -> None:
        """Move rows ``keep_rows`` (ascending) to the front, keeping their first ``num_positions`` positions."""
        n = keep_rows.numel()
        kept = self.data[:, :, keep_rows, :, :num_positions]
        self.data[:, :, :n, :, :num_positions] = kept


class DecoderLM:
    """A Llama/Qwen2/Qwen3 causal LM for inference whose weights carry Hugging Face names.

    Build it with :meth:`from_pretrained` (a Hugging Face checkpoint folder) or with the constructor plus
    :meth:`load_weights` (any stream of ``(name, tensor)``). Weights are uninitialised until loaded.
    """

    def __init__(self, arch: DecoderArch, *, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        self._layout: dict[str, tuple[int, ...]] = {}  # storage buffer -> shape
        self._slots: dict[str, _Slot] = {}  # HF name -> slot
        self._plan_storage()
        self._buffers: dict[str, torch.Tensor] = {
            name: torch.empty(shape, dtype=dtype, device=self.device) for name, shape in self._layout.items()
        }
        self._bind_views()
        self._rope_cos = torch.empty(0)
        self._rope_sin = torch.empty(0)
        self._build_rope_table(1024)

    # ----------------------------------------------------------------------------------------------------
    # Weight storage: fused buffers, Hugging Face-named views.

    def _add(
        self, buffer: str, shape: tuple[int, ...], names_rows: list[tuple[str, int]] | None = None
    ) -> None:
        """Declare a storage buffer; ``names_rows`` splits its dim 0 among HF names, else it is one HF name."""
        self._layout[buffer] = shape
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
        self._add("model.embed_tokens.weight", (a.vocab_size, h))
        for layer in range(a.num_layers):
            p = f"model.layers.{layer}."
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
        self._add("model.norm.weight", (h,))
        if not a.tie_word_embeddings:
            self._add("lm_head.weight", (a.vocab_size, h))

    def _bind_views(self) -> None:
        """(Re)create the HF-named views and the per-layer references the forward pass reads."""
        self._named: dict[str, torch.Tensor] = {
            name: self._buffers[slot.buffer][slot.start : slot.end] for name, slot in self._slots.items()
        }
        b = self._buffers
        a = self.arch
        self._layers: list[dict[str, torch.Tensor | None]] = []
        for layer in range(a.num_layers):
            attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
            self._layers.append(
                {
                    "ln1": b[f"model.layers.{layer}.input_layernorm.weight"],
                    "ln2": b[f"model.layers.{layer}.post_attention_layernorm.weight"],
                    "qkv_w": b[attn + "qkv_proj.weight"],
                    "qkv_b": b.get(attn + "qkv_proj.bias"),
                    "o_w": b[attn + "o_proj.weight"],
                    "o_b": b.get(attn + "o_proj.bias"),
                    "q_norm": b.get(attn + "q_norm.weight"),
                    "k_norm": b.get(attn + "k_norm.weight"),
                    "gu_w": b[mlp + "gate_up_proj.weight"],
                    "gu_b": b.get(mlp + "gate_up_proj.bias"),
                    "down_w": b[mlp + "down_proj.weight"],
                    "down_b": b.get(mlp + "down_proj.bias"),
                }
            )
        self._embed = b["model.embed_tokens.weight"]
        self._final_norm = b["model.norm.weight"]
        self._lm_head = b["model.embed_tokens.weight"] if a.tie_word_embeddings else b["lm_head.weight"]

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
        """Name -> (shape, dtype) of every weight this model must receive (tied ``lm_head.weight`` excluded)."""
        return {name: (tuple(t.shape), t.dtype) for name, t in self._named.items()}

    @property
    def num_weight_bytes(self) -> int:
        """Bytes held by the weights."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def load_weight(self, name: str, tensor: torch.Tensor) -> int:
        """Copy one Hugging Face-named tensor into the model (casting to its dtype); return the bytes read.

        A tied model ignores ``lm_head.weight`` (it is the embedding), and derived buffers such as
        ``rotary_emb.inv_freq`` are ignored; both return 0. Any other unknown name or a shape mismatch raises.
        """
        target = self._named.get(name)
        if target is None:
            if (name == "lm_head.weight" and self.arch.tie_word_embeddings) or name.endswith(
                _IGNORED_SUFFIXES
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

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a stream of ``(hf_name, tensor)``; return the names that were written (see :meth:`load_weight`)."""
        loaded = set()
        for name, tensor in named_tensors:
            if self.load_weight(name, tensor):
                loaded.add(name)
        return loaded

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
        model = cls(DecoderArch.from_hf_config(config), dtype=dtype, device=device)
        loaded = model.load_weights(iter_safetensors(folder))
        missing = sorted(set(model.weights_manifest()) - loaded)
        if missing:
            raise ValueError(f"checkpoint {folder} lacks {len(missing)} weights, e.g. {missing[:5]}")
        return model

    # ----------------------------------------------------------------------------------------------------
    # Forward passes.

    def _build_rope_table(self, num_positions: int) -> None:
        """Tables ``[P, D]`` for positions ``0..P-1``: ``[cos, cos]`` and ``[-sin, sin]`` (see :func:`_rotate`),
        computed in fp32 as Hugging Face does, then cast."""
        inv_freq, scaling = self.arch.rope_inv_freq()
        inv_freq = inv_freq.to(self.device)
        freqs = torch.arange(num_positions, device=self.device).float()[:, None] * inv_freq[None, :]
        cos, sin = (freqs.cos() * scaling).to(self.dtype), (freqs.sin() * scaling).to(self.dtype)
        self._rope_cos = torch.cat((cos, cos), dim=-1)
        self._rope_sin = torch.cat((-sin, sin), dim=-1)

    def ensure_positions(self, num_positions: int) -> None:
        """Make the rotary table cover positions ``0..num_positions-1``."""
        if self._rope_cos.shape[0] < num_positions:
            self._build_rope_table(max(num_positions, 2 * self._rope_cos.shape[0]))

    def _qkv(
        self, x: torch.Tensor, w: dict[str, torch.Tensor | None], cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project ``x [..., H]`` to rotated ``q [..., N, D]``, rotated ``k [..., K, D]`` and ``v [..., K, D]``."""
        a = self.arch
        qkv = F.linear(x, w["qkv_w"], w["qkv_b"])  # type: ignore[arg-type]
        heads = qkv.view(*x.shape[:-1], a.num_heads + 2 * a.num_kv_heads, a.head_dim)
        n, k = a.num_heads, a.num_kv_heads
        if a.qk_norm:
            q = _rms_norm(heads[..., :n, :], w["q_norm"], a.rms_norm_eps)  # type: ignore[arg-type]
            kk = _rms_norm(heads[..., n : n + k, :], w["k_norm"], a.rms_norm_eps)  # type: ignore[arg-type]
            return _rotate(q, cos, sin), _rotate(kk, cos, sin), heads[..., n + k :, :]
        qk = _rotate(heads[..., : n + k, :], cos, sin)
        return qk[..., :n, :], qk[..., n:, :], heads[..., n + k :, :]

    def _mlp(self, x: torch.Tensor, w: dict[str, torch.Tensor | None]) -> torch.Tensor:
        gate_up = F.linear(x, w["gu_w"], w["gu_b"])  # type: ignore[arg-type]
        i = self.arch.intermediate_size
        return F.linear(F.silu(gate_up[..., :i]) * gate_up[..., i:], w["down_w"], w["down_b"])  # type: ignore[arg-type]

    def _trunk(self, input_ids_BT: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """Causal forward over whole rows starting at position 0; fills ``cache`` rows ``0..B-1`` if given."""
        a = self.arch
        num_rows, num_tokens = input_ids_BT.shape
        self.ensure_positions(num_tokens)
        cos = self._rope_cos[:num_tokens, None, :]  # [T, 1, D] broadcasting over heads
        sin = self._rope_sin[:num_tokens, None, :]
        x = F.embedding(input_ids_BT, self._embed)
        for layer, w in enumerate(self._layers):
            h = _rms_norm(x, w["ln1"], a.rms_norm_eps)  # type: ignore[arg-type]
            q_BTND, k_BTKD, v_BTKD = self._qkv(h, w, cos, sin)
            q, k, v = q_BTND.transpose(1, 2), k_BTKD.transpose(1, 2), v_BTKD.transpose(1, 2)
            if cache is not None:
                cache.data[layer, 0, :num_rows, :, :num_tokens] = k
                cache.data[layer, 1, :num_rows, :, :num_tokens] = v
            # Right padding: a real query at position t only sees keys 0..t, all real, so a causal mask is
            # exact; queries at pad positions produce values nobody reads.
            attn = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=a.head_dim**-0.5, enable_gqa=a.num_kv_heads != a.num_heads
            )
            x = x + F.linear(attn.transpose(1, 2).reshape(num_rows, num_tokens, a.q_size), w["o_w"], w["o_b"])  # type: ignore[arg-type]
            x = x + self._mlp(_rms_norm(x, w["ln2"], a.rms_norm_eps), w)  # type: ignore[arg-type]
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms_norm(x, self._final_norm, self.arch.rms_norm_eps), self._lm_head)

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of a right-padded batch (no cache); for tests and scoring."""
        return self._logits(self._trunk(input_ids_BT, None))

    def prefill(
        self, input_ids_BT: torch.Tensor, input_lengths_B: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """Run right-padded prompts, store their keys/values in cache rows ``0..B-1``, return last logits ``[B, V]``.

        The cache must hold at least ``T`` positions; each row's entries past its own length are garbage
        that the decode steps overwrite (they write token ``t`` of a row at position ``t``).
        """
        x = self._trunk(input_ids_BT, cache)
        last = x[torch.arange(x.shape[0], device=x.device), input_lengths_B - 1]
        return self._logits(last)

    def decode(
        self, tokens_B: torch.Tensor, positions_B: torch.Tensor, cache: KVCache, num_positions: int
    ) -> torch.Tensor:
        """One step for cache rows ``0..B-1``: token ``tokens_B[b]`` sits at ``positions_B[b]``; return logits ``[B, V]``.

        ``num_positions`` bounds the attended span: every ``positions_B[b] < num_positions``.
        """
        a = self.arch
        num_rows = tokens_B.shape[0]
        rows = torch.arange(num_rows, device=tokens_B.device)
        cos = self._rope_cos[positions_B][:, None, :]  # [B, 1, D]
        sin = self._rope_sin[positions_B][:, None, :]
        # Additive mask [B, 1, 1, P]: a row attends to its own positions 0..positions_B[b].
        span = torch.arange(num_positions, device=tokens_B.device)
        mask = torch.zeros((num_rows, 1, 1, num_positions), dtype=self.dtype, device=tokens_B.device)
        mask.masked_fill_((span[None, :] > positions_B[:, None])[:, None, None, :], float("-inf"))
        scale = a.head_dim**-0.5
        group = a.num_heads // a.num_kv_heads
        x = F.embedding(tokens_B, self._embed)
        for layer, w in enumerate(self._layers):
            h = _rms_norm(x, w["ln1"], a.rms_norm_eps)  # type: ignore[arg-type]
            q_BND, k_BKD, v_BKD = self._qkv(h, w, cos, sin)
            keys = cache.data[layer, 0]
            values = cache.data[layer, 1]
            keys[rows, :, positions_B] = k_BKD
            values[rows, :, positions_B] = v_BKD
            keys_BKPD = keys[:num_rows, :, :num_positions]
            values_BKPD = values[:num_rows, :, :num_positions]
            # Grouped-query attention without repeating keys: the G query heads of a key/value head are the
            # rows of one small matmul. Plain matmuls beat the fused CPU kernels at one query position, where
            # reading the cache is the whole cost.
            q_BKGD = q_BND.view(num_rows, a.num_kv_heads, group, a.head_dim)
            scores_BKGP = torch.matmul(q_BKGD, keys_BKPD.transpose(-1, -2)).mul_(scale).add_(mask)
            attn = torch.matmul(torch.softmax(scores_BKGP, dim=-1), values_BKPD)
            x = x + F.linear(attn.reshape(num_rows, a.q_size), w["o_w"], w["o_b"])  # type: ignore[arg-type]
            x = x + self._mlp(_rms_norm(x, w["ln2"], a.rms_norm_eps), w)  # type: ignore[arg-type]
        return self._logits(x)
