"""Data-parallel scaling of the DTensor policy worker: training tokens/s at DP=1 on one CPU slot against DP=2
on two, in one run.

A compute-bound model: a random Qwen2 built here (default hidden 512, 6 layers, vocabulary 8192: about 27M
parameters, float32), trained with the SFT loss (``NLLLoss``) by the DTensor policy workers started through
Ray as a run starts them (``RayVirtualCluster`` slots, one ``RayWorkerGroup`` actor per slot, each on one
torch thread), on the same random batches with the same global batch and micro-batch size at both DP sizes.
For each DP size the script takes one warm-up step and ``--steps`` timed optimizer steps, alternating the two
DP sizes ``--rounds`` times so that machine load falls on both alike, then profiles one more step on every
rank to show where DP=2 spends the time DP=1 does not: gloo collectives (FSDP's parameter all-gathers,
gradient reduce-scatters, the all-reduces of counts and norms) and FSDP's own bookkeeping.

    python benchmarks/bench_dp_scaling.py [--hidden 512] [--layers 6] [--seq-len 128] [--batch 16] \\
        [--micro-batch 4] [--steps 3] [--rounds 2]

Prints the median training tokens/s at each DP size, the ratio DP=2 / DP=1 (the target is at least 1.6x on
two idle cores), the first-step losses of both (they must agree: same data, same model), and the profile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from safetensors.torch import load_file

from nemo_rl.algorithms.loss_functions import NLLLoss
from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_start import init_ray
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.distributed.worker_group_facade import WorkerGroupFacade
from nemo_rl.distributed.worker_groups import RayWorkerGroup
from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_megatron_vs_dtensor import build_model, make_batch

LR = 1e-4
CALL_TIMEOUT_S = 3600.0
# Profiler event names that are communication or FSDP bookkeeping (FSDP2 labels its phases "FSDP::...").
_COMM_MARKERS = ("FSDP::", "c10d::", "gloo", "all_gather", "reduce_scatter", "allreduce", "all_reduce")


class ProfilingDTensorPolicyWorker(DTensorPolicyWorker):
    """The DTensor policy worker plus two methods for this benchmark: its CPU clock, and a profiled step."""

    def cpu_seconds(self) -> float:
        """CPU time this worker process (all its threads, gloo's included) has used so far."""
        return time.process_time()

    def profiled_train(self, data: BatchedDataDict[Any], gbs: int) -> dict[str, float]:
        """Run ``train`` under the torch profiler; seconds per communication / FSDP event name, and the wall
        and CPU time of the call (``wall_s``, ``cpu_s``)."""
        from torch.profiler import ProfilerActivity, profile

        wall0, cpu0 = time.perf_counter(), time.process_time()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.train(data, NLLLoss(), gbs=gbs)
        found: dict[str, float] = {
            "wall_s": time.perf_counter() - wall0,
            "cpu_s": time.process_time() - cpu0,
        }
        for event in prof.key_averages():
            if any(marker in event.key for marker in _COMM_MARKERS):
                found[event.key] = event.cpu_time_total / 1e6
        return found


def policy_cfg(model_dir: Path, args: argparse.Namespace) -> PolicyConfig:
    """The same training settings at every DP size."""
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "train_global_batch_size": args.batch,
            "train_micro_batch_size": args.micro_batch,
            "logprob_batch_size": args.micro_batch,
            "max_total_sequence_length": args.seq_len,
            "max_grad_norm": 1.0,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": LR, "weight_decay": 0.0}},
            "dtensor_cfg": {"data_parallel_mode": args.dp_mode},
        }
    )


def measure(
    dp: int, cfg: PolicyConfig, data: BatchedDataDict[Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Start ``dp`` workers, take a warm-up step and ``--steps`` timed ones; the workers are then shut down."""
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=dp, num_nodes=1), name=f"dp{dp}")
    group = WorkerGroupFacade(
        RayWorkerGroup(
            cluster,
            ProfilingDTensorPolicyWorker,
            name=f"policy_dp{dp}",
            init_kwargs={"cfg": cfg, "init_reference_model": False},
            dp_size=dp,
        ),
        call_timeout_s=CALL_TIMEOUT_S,
    )
    workers = group.worker_group
    try:

        def step(index: int, method: str = "train", **kwargs: Any) -> list[Any]:
            batch = data.slice(index * args.batch, (index + 1) * args.batch)
            shards = batch.shard_by_batch_size(dp, batch_size=args.batch)
            refs = workers.run_all_workers_sharded_data(method, shards, gbs=args.batch, **kwargs)
            return workers.get_all_worker_results(refs, CALL_TIMEOUT_S)

        first = step(0, loss_fn=NLLLoss())[0]
        cpu0 = workers.get_all_worker_results(workers.run_all_workers_single_data("cpu_seconds"), 60.0)
        start = time.perf_counter()
        for index in range(1, args.steps + 1):
            step(index, loss_fn=NLLLoss())
        seconds = (time.perf_counter() - start) / args.steps
        cpu1 = workers.get_all_worker_results(workers.run_all_workers_single_data("cpu_seconds"), 60.0)
        rank_cpu_s = [(b - a) / args.steps for a, b in zip(cpu0, cpu1, strict=True)]
        profiles = step(args.steps + 1, method="profiled_train")
    finally:
        group.shutdown()
        cluster.shutdown()
    return {
        "step_s": seconds,
        "rank_cpu_s": rank_cpu_s,
        "first_loss": float(first["loss"][0]),
        "profiles": profiles,
    }


def main() -> None:
    """Build the model, measure DP=1 and DP=2 alternately, print tokens/s, the ratio and the profile."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (global)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of DP=1 and DP=2")
    parser.add_argument(
        "--dp-mode",
        choices=("fsdp", "replicate"),
        default="fsdp",
        help="policy.dtensor_cfg.data_parallel_mode",
    )
    args = parser.parse_args()
    os.environ.setdefault("NEMO_RL_TORCH_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir, args.hidden, args.layers, args.vocab)
        num_params = sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())
        cfg = policy_cfg(model_dir, args)
        data = make_batch(args.batch * (args.steps + 2), args.seq_len, args.vocab)
        init_ray(ClusterConfig(gpus_per_node=2, num_nodes=1))
        try:
            results: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
            for _ in range(args.rounds):
                for dp in (1, 2):
                    results[dp].append(measure(dp, cfg, data, args))
        finally:
            ray.shutdown()
    tokens = args.batch * args.seq_len
    print(
        f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} ({num_params / 1e6:.1f}M "
        f"parameters); {args.batch} x {args.seq_len} "
        f"tokens per optimizer step, micro-batches of {args.micro_batch}; one torch thread per rank; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    rates, busiest_cpu_s = {}, {}
    for dp in (1, 2):
        step_s = statistics.median(r["step_s"] for r in results[dp])
        busiest_cpu_s[dp] = statistics.median(max(r["rank_cpu_s"]) for r in results[dp])
        rates[dp] = tokens / step_s
        cpu = ", ".join(f"{c:.3f}" for c in results[dp][-1]["rank_cpu_s"])
        print(
            f"  DP={dp}: {step_s:.3f} s/step, {rates[dp]:.0f} training tokens/s; CPU s/step per rank: {cpu} "
            f"(first-step loss {results[dp][0]['first_loss']:.6f})"
        )
    print(f"  ratio DP=2 / DP=1: {rates[2] / rates[1]:.2f}x in training tokens/s")
    # What the ratio would be with a free core per rank: a loaded machine shares the cores with other work,
    # which shows in wall time but not in the ranks' own CPU time.
    print(
        f"  ratio of the busiest rank's CPU time per step, DP=1 / DP=2: {busiest_cpu_s[1] / busiest_cpu_s[2]:.2f}x"
    )
    for dp in (1, 2):
        print(f"  profile of one DP={dp} step (per rank; seconds):")
        for rank, prof in enumerate(results[dp][-1]["profiles"]):
            gloo = {k: v for k, v in prof.items() if k.startswith("gloo:")}
            fsdp = sorted(((k, v) for k, v in prof.items() if k.startswith("FSDP::")), key=lambda kv: -kv[1])
            print(
                f"    rank {rank}: wall {prof['wall_s']:.3f}, CPU {prof['cpu_s']:.3f}; gloo collectives "
                f"{sum(gloo.values()):.3f} ({', '.join(f'{k[5:]} {v:.3f}' for k, v in sorted(gloo.items()))}); "
                f"FSDP phases (inclusive, top 3): {', '.join(f'{k[6:]} {v:.3f}' for k, v in fsdp[:3])}"
            )


if __name__ == "__main__":
    main()
