"""Refit throughput: both transports next to a plain memcpy and a raw gloo broadcast of the same bytes.

One policy process sends a synthetic set of weights (sizes shaped like a decoder: a few large embedding-like
tensors, many layer matrices, small norms) to one generation process, through

- the shared-memory transport and the collective transport (packing, casting, checksums, manifest checks,
  the loader's copy into the receiver's weights: the whole refit), timed by the driver as ``refit`` does;
- a plain ``torch`` copy of the same bytes into preallocated memory (``memcpy``), the ceiling for one copy;
- a raw gloo broadcast of the same bytes in bucket-sized pieces (``raw_broadcast``), the ceiling of the wire
  the collective transport uses.

Prints GB/s (1e9 bytes per second, median of ``--repeats`` runs after a warm-up) and the ratios
transport / memcpy and transport / raw broadcast. Runs on CPU with gloo; nothing is downloaded::

    python benchmarks/bench_refit.py --total-mb 512 --bucket-mb 64

``--moe`` also sends two mixture-of-experts weight sets with the dense set's parameter count (to within a
fraction of a percent) and embeddings: the experts as ``transformers`` 5 holds them, two 3-D tensors per layer (what a nemo_rl refit
sends), and as one linear per expert (checkpoint names, what vLLM's loaders and Megatron's exporters use,
``--num-experts`` times more tensors); it prints each set's GB/s through both transports and its ratio to the
dense set's::

    python benchmarks/bench_refit.py --total-mb 256 --bucket-mb 32 --moe
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
from nemo_rl.weight_sync import CollectiveTransport, SharedMemoryTransport, TransportSettings, WeightManifest
from nemo_rl.weight_sync.interfaces import RefitTransport
from nemo_rl.weight_sync.manifest import dtype_from_name

_MIB = 1024 * 1024


def weight_shapes(total_bytes: int, itemsize: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """Decoder-like weight shapes adding up to about ``total_bytes``: embedding + lm_head take ~25%."""
    numel = total_bytes // itemsize
    vocab = max(1, numel // 8 // hidden)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    layer_numel = 4 * hidden * hidden + 3 * hidden * 4 * hidden + 2 * hidden
    num_layers = max(1, (numel - 2 * vocab * hidden) // layer_numel)
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        _attention_shapes(shapes, prefix, hidden)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (4 * hidden, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (4 * hidden, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, 4 * hidden)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _attention_shapes(shapes: dict[str, tuple[int, ...]], prefix: str, hidden: int) -> None:
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        shapes[f"{prefix}.self_attn.{proj}.weight"] = (hidden, hidden)
    shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
    shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)


def moe_weight_shapes(
    numel: int, hidden: int, vocab: int, num_experts: int, expert_width: int, per_expert: bool
) -> dict[str, tuple[int, ...]]:
    """Qwen3-MoE-like weight shapes with ``numel`` parameters and the dense set's embeddings (``vocab`` rows):
    attention, a router and ``num_experts`` gated experts per layer, as many layers as experts of width
    ``expert_width`` fill, the width then adjusted so the total is ``numel`` to within ``3 * E * H`` per layer.

    ``per_expert=False`` keeps each layer's experts as ``transformers`` 5's two 3-D tensors
    (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``); ``True`` splits
    them into one ``gate_proj``/``up_proj``/``down_proj`` linear per expert (checkpoint names).
    """
    budget = numel - 2 * vocab * hidden - hidden
    fixed_numel = 4 * hidden * hidden + 2 * hidden + num_experts * hidden
    num_layers = max(1, round(budget / (fixed_numel + 3 * num_experts * expert_width * hidden)))
    expert_width = max(1, (budget - num_layers * fixed_numel) // (3 * num_experts * hidden * num_layers))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        _attention_shapes(shapes, prefix, hidden)
        shapes[f"{prefix}.mlp.gate.weight"] = (num_experts, hidden)
        experts = f"{prefix}.mlp.experts"
        if not per_expert:
            shapes[f"{experts}.gate_up_proj"] = (num_experts, 2 * expert_width, hidden)
            shapes[f"{experts}.down_proj"] = (num_experts, hidden, expert_width)
            continue
        for e in range(num_experts):
            shapes[f"{experts}.{e}.gate_proj.weight"] = (expert_width, hidden)
            shapes[f"{experts}.{e}.up_proj.weight"] = (expert_width, hidden)
            shapes[f"{experts}.{e}.down_proj.weight"] = (hidden, expert_width)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def num_params(shapes: dict[str, tuple[int, ...]]) -> int:
    """Elements over all the shapes."""
    return sum(torch.Size(s).numel() for s in shapes.values())


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


def _make_transports(dtype: torch.dtype, bucket_bytes: int) -> dict[str, RefitTransport]:
    settings = TransportSettings(dtype, bucket_bytes, timeout_s=600.0, store_host="127.0.0.1")
    return {
        "shared_memory": SharedMemoryTransport(settings, policy_node_ids=["n"], generation_node_ids=["n"]),
        "collective": CollectiveTransport(settings, num_policy_workers=1, num_generation_workers=1),
    }


def measure(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, bucket_bytes: int, repeats: int, ceilings: bool
) -> dict[str, float]:
    """GB/s of a refit of ``shapes`` through each transport (and, with ``ceilings``, of ``memcpy`` and
    ``raw_broadcast`` of the same bytes), with a fresh sender and receiver process and fresh transports."""
    wire_bytes = num_params(shapes) * dtype.itemsize
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_worker, args=(r, pipes[r][1], shapes, dtype, port)) for r in range(2)]
    for proc in procs:
        proc.start()
    conns = [pipe[0] for pipe in pipes]
    transports = _make_transports(dtype, bucket_bytes)
    results: dict[str, float] = {}
    try:
        for kind, transport in transports.items():

            def run(i: int, transport: RefitTransport = transport, kind: str = kind) -> float:
                time_s, sent = _time_refit(conns, transport, f"{kind[:3]}{i + 1}")
                if sent < wire_bytes:
                    raise RuntimeError(
                        f"{kind} sent {sent} bytes, fewer than the {wire_bytes} of the weights"
                    )
                return time_s

            results[kind] = _median_gbps(run, wire_bytes, repeats)

        def raw_broadcast(_: int) -> float:
            for conn in conns:
                conn.send(("raw_broadcast", (wire_bytes, bucket_bytes)))
            return max(conn.recv() for conn in conns)

        def memcpy(_: int) -> float:
            conns[1].send(("memcpy", (wire_bytes, bucket_bytes)))
            return float(conns[1].recv())

        if ceilings:
            results["raw_broadcast"] = _median_gbps(raw_broadcast, wire_bytes, repeats)
            results["memcpy"] = _median_gbps(memcpy, wire_bytes, repeats)
    finally:
        for conn in conns:
            conn.send(("stop", None))
        for proc in procs:
            proc.join(timeout=60)
        for transport in transports.values():
            transport.shutdown()
    return results


def _print_moe_comparison(
    sets: dict[str, dict[str, tuple[int, ...]]], results: dict[str, dict[str, float]]
) -> None:
    print(
        f"{'weights':<22}{'tensors':>9}{'params':>12}{'shm GB/s':>10}{'/ dense':>9}{'coll GB/s':>11}{'/ dense':>9}"
    )
    dense = results["dense"]
    for name, shapes in sets.items():
        row = results[name]
        print(
            f"{name:<22}{len(shapes):>9}{num_params(shapes):>12}"
            f"{row['shared_memory']:10.2f}{row['shared_memory'] / dense['shared_memory']:9.2f}"
            f"{row['collective']:11.2f}{row['collective'] / dense['collective']:9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mb", type=int, default=256, help="MiB of weights (in the generation dtype)")
    parser.add_argument("--bucket-mb", type=int, default=32, help="refit bucket size in MiB")
    parser.add_argument("--dtype", default="float32", help="generation dtype (the policy holds float32)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the synthetic decoder")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--moe", action="store_true", help="also send MoE weight sets of the same size")
    parser.add_argument("--num-experts", type=int, default=64, help="experts per MoE layer (with --moe)")
    parser.add_argument(
        "--expert-width",
        type=int,
        default=128,
        help="starting expert width (with --moe; adjusted to the size)",
    )
    args = parser.parse_args()
    dtype = dtype_from_name(args.dtype)
    bucket_bytes = args.bucket_mb * _MIB
    sets = {"dense": weight_shapes(args.total_mb * _MIB, dtype.itemsize, args.hidden)}
    if args.moe:
        numel = num_params(sets["dense"])
        vocab = sets["dense"]["model.embed_tokens.weight"][0]
        for label, per_expert in (("moe (3-D experts)", False), ("moe (per-expert)", True)):
            sets[label] = moe_weight_shapes(
                numel, args.hidden, vocab, args.num_experts, args.expert_width, per_expert
            )
    results: dict[str, dict[str, float]] = {}
    for name, shapes in sets.items():
        wire_bytes = num_params(shapes) * dtype.itemsize
        print(
            f"{name}: {len(shapes)} tensors, {wire_bytes / 1e9:.3f} GB in {args.dtype}, {args.bucket_mb} MiB buckets"
        )
        results[name] = measure(shapes, dtype, bucket_bytes, args.repeats, ceilings=name == "dense")

    dense = results["dense"]
    print(f"{'path':<16}{'GB/s':>8}{'/ memcpy':>10}{'/ raw bcast':>13}")
    for path in ("memcpy", "raw_broadcast", "shared_memory", "collective"):
        gbps = dense[path]
        print(f"{path:<16}{gbps:8.2f}{gbps / dense['memcpy']:10.2f}{gbps / dense['raw_broadcast']:13.2f}")
    if args.moe:
        _print_moe_comparison(sets, results)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
