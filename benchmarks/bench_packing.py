"""Sequence packing and dynamic batching against fixed micro-batches, on batches of mixed lengths.

One DTensor policy worker (one process, world size 1, gloo, one torch thread) trains and scores the same
batch three ways, each on a fresh copy of the same random Qwen2 model:

- ``fixed``: ``policy.train_micro_batch_size`` rows per micro-batch, padded to the batch's longest row;
- ``dynamic``: ``policy.dynamic_batching`` (token-budget micro-batches cut to their longest row);
- ``packed``: ``policy.sequence_packing`` (each micro-batch's rows laid end to end in one row).

Lengths are drawn uniformly between ``--min-len`` and ``--max-len`` (RL responses vary this much), so about
half of a padded batch is padding. Prints tokens/s (real tokens, not padding) of one training step (forward,
backward, optimizer step) and of one log-prob pass for each, the speed-up over ``fixed``, and the first step's
loss of each (the three must agree: the micro-batching changes the arithmetic order, not the result)::

    uv run python benchmarks/bench_packing.py [--rows 64] [--min-len 16] [--max-len 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from nemo_rl.algorithms.loss_functions import NLLLoss
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import free_port

VOCAB = 512


def build_model(path: Path, hidden: int, layers: int) -> None:
    """A random Qwen2 (``hidden`` wide, ``layers`` deep) and a word-level tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    vocab = {"<pad>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>").save_pretrained(
        path
    )


def make_batch(rows: int, min_len: int, max_len: int) -> BatchedDataDict[Any]:
    """Right-padded random sequences of uniformly drawn lengths; every token after the first is trained on."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(min_len, max_len + 1, (rows,), generator=g)
    positions = torch.arange(max_len)[None, :]
    valid = positions < lengths[:, None]
    ids = torch.randint(2, VOCAB, (rows, max_len), generator=g) * valid
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": lengths,
            "token_mask": (valid & (positions > 0)).float(),
            "sample_mask": torch.ones(rows),
        }
    )


def policy_cfg(model_dir: Path, rows: int, mbs: int, max_len: int, mode: str) -> PolicyConfig:
    budget = {
        "train_mb_tokens": mbs * max_len,
        "logprob_mb_tokens": mbs * max_len,
        "sequence_length_round": 8,
    }
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "train_global_batch_size": rows,
            "train_micro_batch_size": mbs,
            "logprob_batch_size": mbs,
            "max_total_sequence_length": max_len,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5}},
            "dynamic_batching": {"enabled": mode == "dynamic", **budget},
            "sequence_packing": {"enabled": mode == "packed", **budget},
        }
    )


def main() -> None:
    """Time the three ways on one batch and print tokens/s and speed-ups."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    os.environ.setdefault("NEMO_RL_TORCH_THREADS", "1")
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    batch = make_batch(args.rows, args.min_len, args.max_len)
    real_tokens = int(batch["input_lengths"].sum())
    print(
        f"{args.rows} rows of {args.min_len}-{args.max_len} tokens ({real_tokens} real tokens, "
        f"{real_tokens / (args.rows * args.max_len):.0%} of the padded batch), micro-batches of "
        f"{args.micro_batch_size} rows or {args.micro_batch_size * args.max_len} tokens, Qwen2 hidden "
        f"{args.hidden} x {args.layers} layers, one thread"
    )
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), args.hidden, args.layers)
        for mode in ("fixed", "dynamic", "packed"):
            cfg = policy_cfg(Path(tmp), args.rows, args.micro_batch_size, args.max_len, mode)
            worker = DTensorPolicyWorker(cfg, init_reference_model=False)
            train_s, score_s, losses = [], [], []
            for _ in range(args.repeats):
                # A real optimizer step (forward, backward, update); the first one starts from the same weights
                # in every mode, so its losses must agree.
                start = time.perf_counter()
                result = worker.train(batch, NLLLoss())
                train_s.append(time.perf_counter() - start)
                losses.append(float(result["loss"][0]))
                start = time.perf_counter()
                worker.get_logprobs(batch)
                score_s.append(time.perf_counter() - start)
            worker.shutdown()
            results[mode] = {
                "train": real_tokens / statistics.median(train_s),
                "score": real_tokens / statistics.median(score_s),
                "loss": losses[0],
            }
    base = results["fixed"]
    for mode, r in results.items():
        print(
            f"{mode:8s} training {r['train']:9.0f} tok/s ({r['train'] / base['train']:.2f}x)   "
            f"log-probs {r['score']:9.0f} tok/s ({r['score'] / base['score']:.2f}x)   loss {r['loss']:.6f}"
        )


if __name__ == "__main__":
    main()
