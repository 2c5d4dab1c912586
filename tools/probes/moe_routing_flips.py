"""How much of a mixture-of-experts model's sampler/policy disagreement is routing, and what replaying the
sampler's routing in the policy's forward (routing replay, "R3") would remove.

A bfloat16 copy of a tiny model stands in for a bfloat16 sampler (the embedded engine routes as
``transformers`` does), the float32 model for the policy. On sequences sampled from the bfloat16 copy it
measures, over the positions that predict sampled tokens:

- ``flips``: the share of (token, MoE layer) whose set of top-k experts differs between the two forwards;
- ``kl``: the mean KL(bfloat16 || float32) of the next-token distributions, and ``k3``: the mean of
  ``exp(d) - 1 - d`` over the sampled tokens, ``d`` the log-prob difference (GRPO's ``gen_kl_error``);
- the same two with the float32 forward replaying the experts the bfloat16 forward chose, their weights
  recomputed from the float32 router's own probabilities (as R3 replays: the selection, not the weights).

The dense model has no routing; its numbers are the floor set by rounding alone::

    python tools/probes/moe_routing_flips.py --num-seqs 64 --new-tokens 40
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "dense": "examples/assets/tiny_qwen2_init",
    "qwen3_moe": "examples/assets/tiny_qwen3_moe_init",
    "glm4_moe": "examples/assets/tiny_glm4_moe_init",
}


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers (``mlp.gate`` of a layer with ``mlp.experts``), in forward order."""
    return [
        module
        for name, module in model.named_modules()
        if name.endswith("mlp.gate") and hasattr(model.get_submodule(name.rsplit(".", 1)[0]), "experts")
    ]


@contextmanager
def recorded(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Yields a list that receives each router's chosen experts ``[N, K]`` of the forwards run inside."""
    chosen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda m, a, out: chosen.append(out[2])) for r in routers(model)]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


def replay_weights(router: Any, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The routing weights the router would give ``experts`` from its own ``logits``."""
    if hasattr(router, "e_score_correction_bias"):
        weights = logits.float().sigmoid().gather(1, experts)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


@contextmanager
def replayed(model: nn.Module, chosen: list[torch.Tensor]) -> Iterator[None]:
    """Inside, one forward of ``model`` routes every token to the experts in ``chosen`` (per router)."""
    layers = iter(chosen)

    def hook(router: nn.Module, args: Any, out: Any) -> Any:
        experts = next(layers)
        return out[0], replay_weights(router, out[0], experts), experts

    handles = [r.register_forward_hook(hook) for r in routers(model)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def divergence(
    low_BTV: torch.Tensor, high_BTV: torch.Tensor, ids_BT: torch.Tensor, start: int
) -> tuple[float, float]:
    """``(mean KL(low || high), mean k3)`` over the positions predicting tokens ``start..``."""
    low = torch.log_softmax(low_BTV[:, start - 1 : -1].float(), dim=-1)
    high = torch.log_softmax(high_BTV[:, start - 1 : -1].float(), dim=-1)
    kl = (low.exp() * (low - high)).sum(dim=-1).mean()
    tokens = ids_BT[:, start:, None]
    d = high.gather(-1, tokens) - low.gather(-1, tokens)
    return float(kl), float((d.exp() - 1 - d).mean())


def measure(model_dir: str, num_seqs: int, prompt_len: int, new_tokens: int, seed: int) -> dict[str, float]:
    """The probe's numbers for one model (see the module docstring)."""
    high = AutoModelForCausalLM.from_pretrained(ROOT / model_dir, dtype=torch.float32).eval()
    low = AutoModelForCausalLM.from_pretrained(ROOT / model_dir, dtype=torch.bfloat16).eval()
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, high.config.vocab_size, (num_seqs, prompt_len), generator=generator)
    torch.manual_seed(seed)
    with torch.no_grad():
        ids = low.generate(
            prompts, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, pad_token_id=0,
        )  # fmt: skip
        with recorded(low) as low_experts:
            low_logits = low(ids).logits
        with recorded(high) as high_experts:
            high_logits = high(ids).logits
        out = dict(zip(("kl", "k3"), divergence(low_logits, high_logits, ids, prompt_len), strict=True))
        if low_experts:
            flips = [
                (a.sort(dim=-1)[0] != b.sort(dim=-1)[0]).any(dim=-1).float().mean()
                for a, b in zip(low_experts, high_experts, strict=True)
            ]
            out["flips"] = float(torch.stack(flips).mean())
            with replayed(high, low_experts):
                replay_logits = high(ids).logits
            replay_kl, replay_k3 = divergence(low_logits, replay_logits, ids, prompt_len)
            out["kl_replayed"], out["k3_replayed"] = replay_kl, replay_k3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':<10}{'seed':>5}{'flips':>8}{'kl':>11}{'k3':>11}{'kl replayed':>13}{'k3 replayed':>13}")
    for name in args.models:
        for seed in args.seeds:
            r = measure(MODELS[name], args.num_seqs, args.prompt_len, args.new_tokens, seed)
            extra = (
                f"{r['flips']:8.4f}{r['kl']:11.3e}{r['k3']:11.3e}{r['kl_replayed']:13.3e}{r['k3_replayed']:13.3e}"
                if "flips" in r
                else f"{'-':>8}{r['kl']:11.3e}{r['k3']:11.3e}{'-':>13}{'-':>13}"
            )
            print(f"{name:<10}{seed:>5}{extra}", flush=True)


if __name__ == "__main__":
    main()
