"""Training-step time of the Megatron policy worker against the DTensor worker, same model, same batches.

Both backends train the same random Qwen2 model (float32, built here) with the same SFT loss on the same
random batches, with the same optimizer settings (Adam, no weight decay, gradient clipping), in one run:
for each layout (data parallel over the workers, and tensor parallel over them), ``--workers`` gloo processes
build each backend's worker in turn and time ``--steps`` optimizer steps after one warm-up step, alternating
the backends ``--rounds`` times so machine load falls on both alike. Log-prob scoring of the same batch is
timed too.

    python benchmarks/bench_megatron_vs_dtensor.py [--workers 2] [--steps 4] [--rounds 2] [--hidden 256]

Prints, per layout and backend, the median seconds per optimizer step (wall time of the slowest rank, and
CPU time summed over ranks) and tokens per second, then the ratio Megatron / DTensor (below 1: Megatron is
faster). On a CPU-only machine this measures the backends' overheads on small models, not GPU throughput.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import free_port

LR = 1e-4


def build_model(path: Path, hidden: int, layers: int, vocab: int) -> None:
    """A random Qwen2 with ``hidden`` width (``hidden // 32`` heads, half as many KV heads) and a tokenizer-free
    checkpoint (the workers only need the weights and the config)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    heads = max(2, hidden // 32)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)


def make_batch(rows: int, seq_len: int, vocab: int) -> BatchedDataDict[Any]:
    """Random full-length sequences, every token but the first trained on."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    token_mask = torch.ones(rows, seq_len)
    token_mask[:, 0] = 0
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.full((rows,), seq_len),
            "token_mask": token_mask,
            "sample_mask": torch.ones(rows),
        }
    )


def policy_cfg(
    model_dir: Path, backend: str, layout: str, workers: int, args: argparse.Namespace
) -> PolicyConfig:
    """The same training settings on either backend; ``layout`` is ``dp`` or ``tp`` over ``workers``."""
    tp = workers if layout == "tp" else 1
    common: dict[str, Any] = {
        "model_name": str(model_dir),
        "train_global_batch_size": args.batch,
        "train_micro_batch_size": args.micro_batch,
        "logprob_batch_size": args.micro_batch,
        "max_total_sequence_length": args.seq_len,
        "max_grad_norm": 1.0,
    }
    if backend == "dtensor":
        return PolicyConfig.model_validate(
            common
            | {
                "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": LR, "weight_decay": 0.0}},
                "dtensor_cfg": {"tensor_parallel_size": tp},
            }
        )
    return PolicyConfig.model_validate(
        common
        | {
            "optimizer": None,
            "dtensor_cfg": {"enabled": False},
            "megatron_cfg": {
                "enabled": True,
                "tensor_model_parallel_size": tp,
                "optimizer": {"lr": LR, "weight_decay": 0.0, "clip_grad": 1.0},
            },
        }
    )


def _time(fn: Any) -> tuple[float, float]:
    """(wall time of the slowest rank, CPU time summed over ranks) of ``fn()``, a collective."""
    dist.barrier()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    fn()
    times = torch.tensor([time.perf_counter() - wall0, time.process_time() - cpu0], dtype=torch.float64)
    wall = times[:1].clone()
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    cpu = times[1:].clone()
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
    return float(wall), float(cpu)


def _rank_main(
    rank: int, workers: int, port: int, model_dir: str, out: str, args: argparse.Namespace
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(workers),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NEMO_RL_TORCH_THREADS="1",
    )
    try:
        from nemo_rl.algorithms.loss_functions import NLLLoss
        from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker
        from nemo_rl.models.policy.megatron_worker import MegatronPolicyWorker

        classes = {"dtensor": DTensorPolicyWorker, "megatron": MegatronPolicyWorker}
        results: dict[tuple[str, str], dict[str, list[float]]] = {}
        for layout in args.layouts:
            for _ in range(args.rounds):
                for backend in ("dtensor", "megatron"):
                    worker = classes[backend](
                        policy_cfg(Path(model_dir), backend, layout, workers, args),
                        init_reference_model=False,
                    )
                    dp_size, dp_rank = worker.dp_size, worker.dp_rank
                    data = make_batch(args.batch * (args.steps + 1), args.seq_len, args.vocab)
                    shard = data.shard_by_batch_size(dp_size, batch_size=args.batch)[dp_rank]
                    local = args.batch // dp_size
                    worker.train(shard.slice(0, local), NLLLoss())  # warm-up step
                    train = _time(lambda w=worker, s=shard, n=local: w.train(s.slice(n, s.size), NLLLoss()))
                    score = _time(lambda w=worker, s=shard, n=local: w.get_logprobs(s.slice(0, n)))
                    entry = results.setdefault((layout, backend), {"train": [], "train_cpu": [], "score": []})
                    entry["train"].append(train[0] / args.steps)
                    entry["train_cpu"].append(train[1] / args.steps)
                    entry["score"].append(score[0])
                    worker.shutdown()
                    dist.barrier()
        if rank == 0:
            torch.save(results, out)
    except BaseException:
        Path(out + f".error{rank}").write_text(traceback.format_exc())
        raise


def main() -> None:
    """Build the model, run both backends in ``--workers`` processes, print the comparison."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", choices=["dp", "tp"], default=["dp", "tp"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (global)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two backends")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, out = Path(tmp) / "model", str(Path(tmp) / "results.pt")
        build_model(model_dir, args.hidden, args.layers, args.vocab)
        mp.start_processes(
            _rank_main,
            args=(args.workers, free_port(), str(model_dir), out, args),
            nprocs=args.workers,
            start_method="spawn",
        )
        errors = sorted(Path(tmp).glob("results.pt.error*"))
        if errors:
            raise SystemExit(errors[0].read_text())
        results = torch.load(out, weights_only=False)

    tokens = args.batch * args.seq_len
    print(
        f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; {args.batch} x {args.seq_len} tokens "
        f"per step, micro-batches of {args.micro_batch}; {args.workers} gloo workers, 1 thread each"
    )
    for layout in args.layouts:
        medians = {
            backend: {k: statistics.median(v) for k, v in results[layout, backend].items()}
            for backend in ("dtensor", "megatron")
        }
        for backend, m in medians.items():
            print(
                f"  {layout} {backend:9s} train {m['train']:.3f} s/step ({tokens / m['train']:.0f} tokens/s, "
                f"CPU {m['train_cpu']:.3f} s/step)  logprobs {m['score']:.3f} s"
            )
        d, g = medians["dtensor"], medians["megatron"]
        print(
            f"  {layout} ratio megatron / dtensor: train {g['train'] / d['train']:.2f}x (wall), "
            f"{g['train_cpu'] / d['train_cpu']:.2f}x (CPU); logprobs {g['score'] / d['score']:.2f}x"
        )


if __name__ == "__main__":
    main()
