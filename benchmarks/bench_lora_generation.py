"""LoRA in the embedded engine: adapters merged into the weights against adapter matmuls in the forward.

The two ways an engine can apply the policy's LoRA adapters (``W x + s B A x``) after each refit:

- ``merged`` (what :class:`nemo_rl.models.generation.lora.MergedAdapters` does): keep each adapted layer's base
  weight and load ``W = W_base + s B A`` when adapters arrive; generation then runs the plain model. Costs one
  ``[out, r] @ [r, in]`` matmul per adapted layer per refit.
- ``unmerged``: keep the base weights as they are and add ``s (x A^T) B^T`` to every adapted projection in the
  forward (q/k/v share one ``[3r, H]`` down-projection and a block-diagonal up-projection, gate/up likewise: the
  cheapest layout on the engine's fused storage). No work at refit; two thin matmuls per projection per step.

It times a prefill plus ``--new-tokens`` decode steps of ``--rows`` sequences (what a generation call runs), and
the per-refit merge, on a Qwen2-shaped model with every linear layer adapted, and prints both, the ratio
unmerged / merged of one generation call, and the merge's cost. CPU, one thread by default; nothing is
downloaded::

    python benchmarks/bench_lora_generation.py --hidden 512 --layers 8 --rank 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Qwen2Config

from nemo_rl.config.model_arch import ModelArch
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.generation.embedded.layer_ops import Attend, linear, residual_linear, rms_norm
from nemo_rl.models.generation.embedded.model import DecoderLM, KVCache
from nemo_rl.models.generation.lora import AdapterLayout, MergedAdapters
from nemo_rl.models.hf_decoder import decoder_arch


class UnmergedLoraLM(DecoderLM):
    """The engine's model with adapter matmuls in the layer body (the benchmark's alternative)."""

    lora: list[dict[str, torch.Tensor]]
    scale: float

    def set_adapters(self, adapters: dict[str, torch.Tensor], scale: float) -> None:
        """Arrange ``<module>.lora_A`` / ``.lora_B`` per layer: fused down-projections, block-diagonal ups."""
        self.scale = scale
        self.lora = []
        for layer in range(self.arch.num_layers):
            attn, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."

            def fused(modules: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
                a = torch.cat([adapters[f"{m}.lora_A"] for m in modules])  # [n r, in]
                b = torch.block_diag(*[adapters[f"{m}.lora_B"] for m in modules])  # [sum out, n r]
                return a.t().contiguous(), b.t().contiguous()

            qkv = fused([attn + "q_proj", attn + "k_proj", attn + "v_proj"])
            gate_up = fused([mlp + "gate_proj", mlp + "up_proj"])
            o, down = fused([attn + "o_proj"]), fused([mlp + "down_proj"])
            self.lora.append({"qkv": qkv, "o": o, "gate_up": gate_up, "down": down})  # type: ignore[dict-item]

    def _delta(self, x: torch.Tensor, pair: Any) -> torch.Tensor:
        a_t, b_t = pair
        return torch.mm(torch.mm(x, a_t), b_t).mul_(self.scale)

    def _layer(
        self, layer: int, x_MH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        a, w, lora = self.arch, self._layers[layer], self.lora[layer]
        h = rms_norm(x_MH, w.ln1, a.rms_norm_eps)
        heads = (linear(h, w.qkv_t, w.qkv_b) + self._delta(h, lora["qkv"])).view(
            -1, a.num_heads + 2 * a.num_kv_heads, a.head_dim
        )
        n, k = a.num_heads, a.num_kv_heads
        qk = torch.cat((heads[:, :n], heads[:, n : n + k]), dim=1)
        qk = qk * cos + torch.roll(qk, qk.shape[-1] // 2, dims=-1) * sin
        attn = attend(layer, qk[:, :n], qk[:, n:], heads[:, n + k :])
        x_MH = residual_linear(x_MH, attn, w.o_t, w.o_b) + self._delta(attn, lora["o"])
        h2 = rms_norm(x_MH, w.ln2, a.rms_norm_eps)
        gate_up = linear(h2, w.gate_up_t, w.gate_up_b) + self._delta(h2, lora["gate_up"])
        i = a.intermediate_size
        act = F.silu(gate_up[:, :i]).mul_(gate_up[:, i:])
        return residual_linear(x_MH, act, w.down_t, w.down_b) + self._delta(act, lora["down"])


def _arch(args: argparse.Namespace) -> ModelArch:
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        intermediate_size=args.hidden * 3,
        tie_word_embeddings=True,
    )
    return decoder_arch(config)


def _fill(model: DecoderLM, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights = {name: torch.randn(t.shape, generator=g) * 0.05 for name, t in model.named_weights()}
    model.load_weights(weights.items())
    return weights


def _call_s(model: DecoderLM, args: argparse.Namespace) -> float:
    """Seconds of one generation call's forward work: a prefill and ``new_tokens`` greedy decode steps."""
    rows, prompt = args.rows, args.prompt_tokens
    cache = KVCache(model.arch, rows, prompt + args.new_tokens, model.dtype, model.device)
    ids = torch.randint(0, args.vocab, (rows, prompt))
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.prefill(ids, torch.full((rows,), prompt), cache).argmax(-1)
        for step in range(args.new_tokens):
            positions = torch.full((rows,), prompt + step)
            tokens = model.decode(tokens, positions, cache, prompt + step + 1).argmax(-1)
    return time.perf_counter() - start


def _median(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    arch = _arch(args)

    merged = DecoderLM(arch, dtype=torch.float32)
    base = _fill(merged, seed=0)
    manifest = {name: (tuple(t.shape), "float32") for name, t in base.items()}
    cfg = PolicyConfig.model_validate(
        {"model_name": "bench", "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": args.rank, "alpha": 16}}}
    )
    layout = AdapterLayout.from_policy_config(cfg, manifest, "float32")
    assert layout is not None
    g = torch.Generator().manual_seed(1)
    adapters = {
        name: torch.randn(shape, generator=g) * 0.05 for name, (shape, _) in layout.adapter_manifest().items()
    }
    merger = MergedAdapters(layout)
    merged.load_weights(merger.merge([*base.items(), *adapters.items()], "full"))

    def refit_merge() -> float:
        start = time.perf_counter()
        merged.load_weights(merger.merge(adapters.items(), "adapters"))
        return time.perf_counter() - start

    unmerged = UnmergedLoraLM(arch, dtype=torch.float32)
    unmerged.load_weights(base.items())
    unmerged.set_adapters(adapters, layout.scale)
    # Same function either way (checks the unmerged forward before timing it).
    ids = torch.randint(0, args.vocab, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(unmerged.forward(ids), merged.forward(ids), rtol=1e-4, atol=1e-4)

    merged_s = _median(lambda: _call_s(merged, args), args.repeats)
    unmerged_s = _median(lambda: _call_s(unmerged, args), args.repeats)
    merge_s = _median(refit_merge, args.repeats)
    params_m = sum(t.numel() for t in base.values()) / 1e6
    print(
        f"model {params_m:.1f}M params, {len(layout.targets)} adapted layers, rank {args.rank}; "
        f"{args.rows} rows x ({args.prompt_tokens} prompt + {args.new_tokens} new) tokens, {args.threads} thread(s)"
    )
    print(f"merged   : generation call {merged_s * 1e3:8.1f} ms, merge at refit {merge_s * 1e3:6.1f} ms")
    print(f"unmerged : generation call {unmerged_s * 1e3:8.1f} ms, nothing at refit")
    print(f"ratio unmerged / merged (one call): {unmerged_s / merged_s:.2f}x")
    print(f"ratio unmerged / (merged + merge) (one call per refit): {unmerged_s / (merged_s + merge_s):.2f}x")


if __name__ == "__main__":
    main()
