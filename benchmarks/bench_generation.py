"""Throughput of the embedded generation engine against ``transformers``' ``generate()``, side by side.

Both sample from the project's random tiny Qwen2 model (``nemo_rl.data.tiny``: hidden 128, 4 layers, 4 heads,
2 KV heads, 104-token vocabulary) on the same prompts of mixed lengths with the same sampling settings, in one
process on one torch thread. Stop tokens are disabled on both sides, so every sequence gets exactly ``max_new_tokens``
tokens and tokens/s compare like for like. ``transformers`` gets the prompts left-padded with an attention
mask (what its batched ``generate()`` needs); the engine gets them right-padded (what it needs).

    python benchmarks/bench_generation.py [--batch-size 64] [--max-new-tokens 128] [--repeats 5]

Prints tokens/s for each and the ratio engine / transformers, by CPU time of this process (steady on a shared
machine) and by wall time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, Qwen2ForCausalLM

from nemo_rl.data.tiny import build_tiny_model, build_tiny_tokenizer
from nemo_rl.models.generation.embedded.engine import EmbeddedEngine, SamplingParams
from nemo_rl.models.generation.embedded.model import DecoderLM
from nemo_rl.models.hf_decoder import decoder_arch

PAD_ID = 0


def build_model(seed: int) -> Qwen2ForCausalLM:
    """The project's tiny random Qwen2 (``nemo_rl.data.tiny``: ~0.8M parameters, 104-token vocabulary)."""
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_tokenizer(Path(tmp) / "tokenizer")
        return build_tiny_model(Path(tmp) / "model", Path(tmp) / "tokenizer", seed=seed).eval()


def make_prompts(
    batch_size: int, min_len: int, max_len: int, vocab_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random prompts ``[B, max_len]`` and their lengths ``[B]``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=gen)
    ids = torch.randint(1, vocab_size, (batch_size, max_len), generator=gen)
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


def best_times(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, tuple[float, float]]:
    """Best (wall, CPU) seconds of each function over ``repeats`` rounds, after one warm-up round.

    The functions take turns within each round, so a burst of load from other processes on a shared machine
    hits both sides alike; CPU time (this process only, one thread) is the steadier of the two numbers.
    """
    for fn in fns.values():
        fn()
    best = {name: (float("inf"), float("inf")) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    hf_model = build_model(seed=0)
    ids, lengths = make_prompts(
        args.batch_size, args.min_prompt_len, args.max_prompt_len, hf_model.config.vocab_size, seed=1
    )
    left_ids, left_mask = left_pad(ids, lengths)

    model = DecoderLM(decoder_arch(hf_model.config), dtype=torch.float32)
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
    times = best_times({"transformers": run_hf, "engine": run_engine}, args.repeats)
    print(f"batch {args.batch_size}, {args.max_new_tokens} new tokens each, {args.threads} thread(s)")
    for name, label in (("transformers", "transformers generate()"), ("engine", "embedded engine")):
        wall, cpu = times[name]
        print(
            f"{label:24s} {num_tokens / cpu:10.1f} tokens/s of CPU time, {num_tokens / wall:10.1f} tokens/s wall"
        )
    ratio_cpu = times["transformers"][1] / times["engine"][1]
    ratio_wall = times["transformers"][0] / times["engine"][0]
    print(f"ratio engine / transformers: {ratio_cpu:.2f}x (CPU time), {ratio_wall:.2f}x (wall)")


if __name__ == "__main__":
    main()
