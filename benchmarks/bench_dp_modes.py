"""Where a small model's DP=2 training step goes under FSDP2, against a replicated plain module whose gradients
are summed with one flat all-reduce (DDP's way), in one run.

Two processes over gloo, one torch thread each, train the checked-in tiny Qwen2 (``examples/assets/
tiny_math_sft``: hidden 128, 4 layers, 0.8M parameters, float32) on ``--rows`` random sequences per rank of
``--seq-len`` tokens: one forward and backward, the gradient reduction, gradient-norm clipping and an AdamW step
per optimizer step. ``fsdp`` wraps the model as the DTensor policy worker does on CPU
(``parallelize.apply_fsdp`` with ``reshard_after_forward=False``: every decoder layer and the root, SUM
reduction); ``replicate`` keeps the plain module on both ranks and all-reduces every gradient in one flat buffer
after the backward. The two modes alternate ``--rounds`` times so that machine load falls on both alike.

    python benchmarks/bench_dp_modes.py [--rows 32] [--seq-len 48] [--steps 12] [--rounds 2]

Prints, per mode, the median milliseconds per step of each phase on rank 0 (the first two steps are warm-up),
the first-step loss and gradient norm of both modes (they agree: same data, same model, summed gradients), and
the ratio of the medians of the whole step.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODEL = Path(__file__).resolve().parent.parent / "examples" / "assets" / "tiny_math_sft"
PHASES = ("forward", "backward", "reduce", "clip", "optimizer", "step")


def _rank(rank: int, mode: str, args: argparse.Namespace, port: int, out: Any) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    vocab = model.config.vocab_size
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        from nemo_rl.models.policy.parallelize import apply_fsdp

        apply_fsdp(model, init_device_mesh("cpu", (2,)), torch.float32, False, reshard_after_forward=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
    ids = torch.randint(0, vocab, (args.rows, args.seq_len), generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    first: tuple[float, float] | None = None
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        # Each rank's share of the global mean, so the step's gradient is the SUM over ranks.
        loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), ids.view(-1)) / 2
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if mode == "replicate":
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        t3 = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        t4 = time.perf_counter()
        optimizer.step()
        t5 = time.perf_counter()
        for phase, seconds in zip(
            PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0), strict=True
        ):
            times[phase].append(seconds)
        if first is None:
            first = (float(loss.detach()) * 2, norm_value)
    if rank == 0:
        out.put({phase: statistics.median(values[2:]) for phase, values in times.items()} | {"first": first})
    dist.destroy_process_group()


def _measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, mode, args, port, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    result: dict[str, Any] = out.get(timeout=600)
    for proc in procs:
        proc.join(timeout=60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=32, help="sequences per rank and step")
    parser.add_argument("--seq-len", type=int, default=48)
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per measurement (2 warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two modes")
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"fsdp": [], "replicate": []}
    for _ in range(args.rounds):
        for mode in results:
            results[mode].append(_measure(mode, args))
    print(
        f"tiny Qwen2 (0.8M parameters), DP=2 over gloo, {args.rows} x {args.seq_len} tokens per rank and step; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    medians: dict[str, float] = {}
    for mode, runs in results.items():
        per_phase = {phase: statistics.median(run[phase] for run in runs) for phase in PHASES}
        medians[mode] = per_phase["step"]
        loss, norm = runs[0]["first"]
        phases = ", ".join(f"{phase} {seconds * 1000:.1f}" for phase, seconds in per_phase.items())
        print(
            f"  {mode:9s} ms per step (rank 0, median): {phases}; first-step loss {loss:.6f}, grad norm {norm:.5f}"
        )
    print(f"  ratio of the step, replicate / fsdp: {medians['replicate'] / medians['fsdp']:.2f}x")


if __name__ == "__main__":
    main()
