"""Throughput of the embedded generation engine against ``transformers``' ``generate()``, side by side.

Both sample from the same random tiny Qwen2 model (hidden 128, 4 layers, 4 heads, 2 KV heads, ~100-token
vocabulary) on the same prompts of mixed lengths with the same sampling settings, in one process on one
torch thread. Stop tokens are disabled on both sides, so every sequence gets exactly ``max_new_tokens``
tokens and tokens/s compare like for like. ``transformers`` gets the prompts left-padded with an attention
mask (what its batched ``generate()`` needs); the engine gets them right-padded (what it needs).

    python benchmarks/bench_generation.py [--batch-size 64] [--max-new-tokens 128] [--repeats 3]

Prints tokens/s for each and the ratio engine / transformers.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from nemo_rl.models.generation.embedded.engine import EmbeddedEngine, SamplingParams
from nemo_rl.models.generation.embedded.model import DecoderArch, DecoderLM

VOCAB_SIZE = 100
PAD_ID = 0


def build_model(seed: int) -> Qwen2ForCausalLM:
    """A random tiny Qwen2 (~0.8M parameters) with weights large enough to give a non-uniform distribution."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    return model


def make_prompts(batch_size: int, min_len: int, max_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random prompts ``[B, max_len]`` and their lengths ``[B]``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=gen)
    ids = torch.randint(1, VOCAB_SIZE, (batch_size, max_len), generator=gen)
    ids[torch.arange(max_len)[None, :] >= lengths[:, None]] = PAD_ID
    return ids, lengths


def left_pad(ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same prompts left-padded, with their attention mask."""
    width = ids.shape[1]
    out = torch.full_like(ids, PAD_ID)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths.tolist()):
        out[b, width - n :] = ids[b, :n]
        mask[b, width - n :] = 1
    return out, mask


def time_best(fn: Callable[[], None], repeats: int) -> float:
    """Best wall time of ``repeats`` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Run both generators and print their throughput."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    hf_model = build_model(seed=0)
    ids, lengths = make_prompts(args.batch_size, args.min_prompt_len, args.max_prompt_len, seed=1)
    left_ids, left_mask = left_pad(ids, lengths)

    model = DecoderLM(DecoderArch.from_hf_config(hf_model.config), dtype=torch.float32)
    model.load_weights(hf_model.state_dict().items())
    engine = EmbeddedEngine(
        model,
        pad_token_id=PAD_ID,
        max_sequence_length=args.max_prompt_len + args.max_new_tokens,
        decode_fn=None,
    )
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=frozenset(),
        stop_strings=(),
    )
    hf_config = GenerationConfig(
        do_sample=True,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )

    def run_engine() -> None:
        out = engine.generate(ids, lengths, params, greedy=False, seed=0)
        assert int(out.generation_lengths.sum()) == args.batch_size * args.max_new_tokens

    def run_hf() -> None:
        with torch.inference_mode():
            generate: Any = getattr(hf_model, "generate")  # noqa: B009 (transformers' self-typed signature confuses mypy)
            out = generate(input_ids=left_ids, attention_mask=left_mask, generation_config=hf_config)
        assert out.shape == (args.batch_size, ids.shape[1] + args.max_new_tokens)

    num_tokens = args.batch_size * args.max_new_tokens
    hf_s = time_best(run_hf, args.repeats)
    engine_s = time_best(run_engine, args.repeats)
    hf_tps, engine_tps = num_tokens / hf_s, num_tokens / engine_s
    print(f"batch {args.batch_size}, {args.max_new_tokens} new tokens each, {args.threads} thread(s)")
    print(f"transformers generate(): {hf_tps:10.1f} tokens/s ({hf_s:.3f} s)")
    print(f"embedded engine:         {engine_tps:10.1f} tokens/s ({engine_s:.3f} s)")
    print(f"ratio engine / transformers: {engine_tps / hf_tps:.2f}x")


if __name__ == "__main__":
    main()
