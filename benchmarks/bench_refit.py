"""Refit throughput: both transports next to a plain memcpy and a raw gloo broadcast of the same bytes.

One policy process sends a synthetic set of weights (sizes shaped like a decoder: a few large embedding-like
tensors, many layer matrices, small norms) to one generation process, through

- the shared-memory transport and the collective transport (packing, casting, checksums, manifest checks,
  the loader's copy into the receiver's weights: the whole refit), timed by the driver as ``refit`` does;
- a plain ``torch`` copy of the same bytes into preallocated memory (``memcpy``), the ceiling for one copy;
- a raw gloo broadcast of the same bytes in bucket-sized pieces (``raw_broadcast``), the ceiling of the wire
  the collective transport uses.

Prints GB/s (1e9 bytes per second, median of ``--repeats`` runs after a warm-up) and the ratios
transport / memcpy and transport / raw broadcast. ``--num-experts E`` makes every MLP a mixture of ``E``
experts of the same total size, sent one tensor per expert as a MoE refit sends them (many small tensors
instead of three large ones per layer). Runs on CPU with gloo; nothing is downloaded::

    python benchmarks/bench_refit.py --total-mb 512 --bucket-mb 64
    python benchmarks/bench_refit.py --total-mb 512 --bucket-mb 64 --num-experts 64
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nemo_rl.distributed.virtual_cluster import free_port
from nemo_rl.weight_sync import CollectiveTransport, SharedMemoryTransport, WeightManifest
from nemo_rl.weight_sync.interfaces import RefitTransport
from nemo_rl.weight_sync.manifest import dtype_from_name

_MIB = 1024 * 1024


def weight_shapes(
    total_bytes: int, itemsize: int, hidden: int, num_experts: int = 0
) -> dict[str, tuple[int, ...]]:
    """Decoder-like weight shapes adding up to about ``total_bytes``: embedding + lm_head take ~25%. With
    ``num_experts`` every MLP is a mixture of that many experts of width ``4 * hidden / num_experts`` (the same
    parameters as the dense MLP, in 3 tensors per expert under checkpoint names, as a MoE refit sends them)
    plus its router."""
    numel = total_bytes // itemsize
    vocab = max(1, numel // 8 // hidden)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    layer_numel = 4 * hidden * hidden + 3 * hidden * 4 * hidden + 2 * hidden + num_experts * hidden
    num_layers = max(1, (numel - 2 * vocab * hidden) // layer_numel)
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{prefix}.self_attn.{proj}.weight"] = (hidden, hidden)
        shapes.update(_mlp_shapes(f"{prefix}.mlp", hidden, num_experts))
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, num_experts: int) -> dict[str, tuple[int, ...]]:
    """One dense MLP (``num_experts`` 0), or a router and ``num_experts`` experts of the same total size."""
    if num_experts == 0:
        return {
            f"{prefix}.gate_proj.weight": (4 * hidden, hidden),
            f"{prefix}.up_proj.weight": (4 * hidden, hidden),
            f"{prefix}.down_proj.weight": (hidden, 4 * hidden),
        }
    width = 4 * hidden // num_experts
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.gate.weight": (num_experts, hidden)}
    for e in range(num_experts):
        shapes[f"{prefix}.experts.{e}.gate_proj.weight"] = (width, hidden)
        shapes[f"{prefix}.experts.{e}.up_proj.weight"] = (width, hidden)
        shapes[f"{prefix}.experts.{e}.down_proj.weight"] = (hidden, width)
    return shapes


def _worker(
    rank: int, conn: Connection, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, port: int
) -> None:
    """Rank 0 is the policy (sends), rank 1 the generation worker (receives). Commands come over ``conn``."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    if rank == 0:
        weights = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    else:
        weights = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    manifest = WeightManifest({name: (shape, dtype) for name, shape in shapes.items()})

    def load(stream: Any) -> None:
        for name, tensor in stream:
            weights[name].copy_(tensor)

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )
    while True:
        command, arg = conn.recv()
        if command == "stop":
            break
        if command == "refit":
            stats = arg.send(iter(weights.items())) if rank == 0 else arg.receive(load, manifest)
            conn.send(stats.wire_bytes)
        elif command == "raw_broadcast":
            total_bytes, chunk_bytes = arg
            buffer = torch.ones(chunk_bytes, dtype=torch.uint8)
            dist.barrier()
            start = time.perf_counter()
            for offset in range(0, total_bytes, chunk_bytes):
                dist.broadcast(buffer[: min(chunk_bytes, total_bytes - offset)], src=0)
            conn.send(time.perf_counter() - start)
        elif command == "memcpy":
            total_bytes, chunk_bytes = arg
            source = torch.ones(total_bytes, dtype=torch.uint8)
            target = torch.empty(total_bytes, dtype=torch.uint8)
            target.copy_(source)  # fault the pages in once, as the transports reuse their buffers
            start = time.perf_counter()
            for offset in range(0, total_bytes, chunk_bytes):
                target[offset : offset + chunk_bytes].copy_(source[offset : offset + chunk_bytes])
            conn.send(time.perf_counter() - start)
    dist.destroy_process_group()


def _time_refit(conns: list[Connection], transport: RefitTransport, refit_id: str) -> tuple[float, int]:
    senders, receivers = transport.endpoints(refit_id)
    start = time.perf_counter()
    conns[0].send(("refit", senders[0]))
    conns[1].send(("refit", receivers[0]))
    wire_bytes = conns[0].recv()
    conns[1].recv()
    return time.perf_counter() - start, wire_bytes


def _median_gbps(run: Callable[[int], float], num_bytes: int, repeats: int) -> float:
    run(-1)  # warm-up: groups, buffers and segments are created on first use
    return num_bytes / statistics.median(run(i) for i in range(repeats)) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mb", type=int, default=256, help="MiB of weights (in the generation dtype)")
    parser.add_argument("--bucket-mb", type=int, default=32, help="refit bucket size in MiB")
    parser.add_argument("--dtype", default="float32", help="generation dtype (the policy holds float32)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the synthetic decoder")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument(
        "--num-experts", type=int, default=0, help="make every MLP a mixture of this many experts (0: dense)"
    )
    args = parser.parse_args()
    dtype = dtype_from_name(args.dtype)
    shapes = weight_shapes(args.total_mb * _MIB, dtype.itemsize, args.hidden, args.num_experts)
    wire_bytes = sum(torch.Size(s).numel() for s in shapes.values()) * dtype.itemsize
    bucket_bytes = args.bucket_mb * _MIB
    print(f"{len(shapes)} tensors, {wire_bytes / 1e9:.3f} GB in {args.dtype}, {args.bucket_mb} MiB buckets")

    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_worker, args=(r, pipes[r][1], shapes, dtype, port)) for r in range(2)]
    for proc in procs:
        proc.start()
    conns = [pipe[0] for pipe in pipes]
    common = {
        "dtype": dtype,
        "bucket_size_bytes": bucket_bytes,
        "timeout_s": 600.0,
        "store_host": "127.0.0.1",
    }
    transports: dict[str, RefitTransport] = {
        "shared_memory": SharedMemoryTransport(policy_node_ids=["n"], generation_node_ids=["n"], **common),
        "collective": CollectiveTransport(num_policy_workers=1, num_generation_workers=1, **common),
    }
    try:
        results: dict[str, float] = {}
        for kind, transport in transports.items():

            def run(i: int, transport: RefitTransport = transport, kind: str = kind) -> float:
                time_s, sent = _time_refit(conns, transport, f"{kind[:3]}{i + 1}")
                if sent < wire_bytes:
                    raise RuntimeError(
                        f"{kind} sent {sent} bytes, fewer than the {wire_bytes} of the weights"
                    )
                return time_s

            results[kind] = _median_gbps(run, wire_bytes, args.repeats)

        def raw_broadcast(_: int) -> float:
            for conn in conns:
                conn.send(("raw_broadcast", (wire_bytes, bucket_bytes)))
            return max(conn.recv() for conn in conns)

        def memcpy(_: int) -> float:
            conns[1].send(("memcpy", (wire_bytes, bucket_bytes)))
            return float(conns[1].recv())

        results["raw_broadcast"] = _median_gbps(raw_broadcast, wire_bytes, args.repeats)
        results["memcpy"] = _median_gbps(memcpy, wire_bytes, args.repeats)
    finally:
        for conn in conns:
            conn.send(("stop", None))
        for proc in procs:
            proc.join(timeout=60)
        for transport in transports.values():
            transport.shutdown()

    print(f"{'path':<16}{'GB/s':>8}{'/ memcpy':>10}{'/ raw bcast':>13}")
    for path in ("memcpy", "raw_broadcast", "shared_memory", "collective"):
        gbps = results[path]
        print(f"{path:<16}{gbps:8.2f}{gbps / results['memcpy']:10.2f}{gbps / results['raw_broadcast']:13.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
