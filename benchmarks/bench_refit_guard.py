"""What the refit guard (``policy.refit.guard.checksums``) adds to a refit, measured against the same refit
without it in one run.

One policy process sends a synthetic decoder's weights (``bench_refit.py``'s shapes) to one generation process
through the shared-memory transport, alternately without the guard and with it. With it, the receiver takes
the checksum of every tensor that arrives (inside the refit), and the generation process then takes the
checksum of every weight it holds and compares the two trees of names (what
``Refitter.verify`` has each engine do after a refit). Prints, per refit (medians of ``--repeats`` pairs),
the wall time and the CPU time of both processes for the plain refit, the guarded refit and the held-side
check, and the ratio guarded / plain (CPU time is the trustworthy one on a shared machine)::

    python benchmarks/bench_refit_guard.py --total-mb 256 --bucket-mb 64 --repeats 5

``--moe`` sends the per-expert mixture-of-experts set of the same size instead (600 small tensors).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import moe_weight_shapes, num_params, weight_shapes

from nemo_rl.weight_sync import SharedMemoryTransport, TransportSettings, WeightManifest
from nemo_rl.weight_sync.checksums import named_checksums
from nemo_rl.weight_sync.guard import find_divergence
from nemo_rl.weight_sync.manifest import dtype_from_name

_MIB = 1024 * 1024


def _worker(rank: int, conn: Connection, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> None:
    """Rank 0 sends, rank 1 receives and, for a guarded refit, checks what it holds; commands over ``conn``."""
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

    while True:
        command, endpoint = conn.recv()
        if command == "stop":
            break
        if rank == 0:
            cpu = time.process_time()
            endpoint.send(iter(weights.items()))
            conn.send(time.process_time() - cpu)
            continue
        wall, cpu = time.perf_counter(), time.process_time()
        stats = endpoint.receive(load, manifest)
        refit_s, refit_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
        check_s = check_cpu_s = 0.0
        if stats.checksums is not None:
            wall, cpu = time.perf_counter(), time.process_time()
            problems = find_divergence(stats.checksums, named_checksums(weights.items(), dtype))
            check_s, check_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
            if problems:
                raise RuntimeError(f"the guard found differences on a clean refit: {problems}")
        conn.send((refit_s, refit_cpu_s, check_s, check_cpu_s))


def _refit(conns: list[Connection], transport: SharedMemoryTransport, refit_id: str) -> tuple[float, ...]:
    """One refit: the driver's wall time, the CPU time of both processes, the held check's wall and CPU time."""
    senders, receivers = transport.endpoints(refit_id)
    start = time.perf_counter()
    conns[0].send(("refit", senders[0]))
    conns[1].send(("refit", receivers[0]))
    sender_cpu_s = conns[0].recv()
    _, refit_cpu_s, check_s, check_cpu_s = conns[1].recv()
    driver_s = time.perf_counter() - start  # the receiver answers after its check
    return driver_s, sender_cpu_s + refit_cpu_s + check_cpu_s, check_s, check_cpu_s


def measure(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, bucket_bytes: int, repeats: int) -> None:
    """Alternate plain and guarded refits of ``shapes`` and print the medians."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_worker, args=(r, pipes[r][1], shapes, dtype)) for r in range(2)]
    for proc in procs:
        proc.start()
    conns = [pipe[0] for pipe in pipes]
    transports = {
        guarded: SharedMemoryTransport(
            TransportSettings(dtype, bucket_bytes, 600.0, "127.0.0.1", tensor_checksums=guarded),
            policy_node_ids=["n"],
            generation_node_ids=["n"],
        )
        for guarded in (False, True)
    }
    runs: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
    try:
        for i in range(repeats + 1):  # the first pair warms up segments and pages
            for guarded, transport in transports.items():
                result = _refit(conns, transport, f"{'g' if guarded else 'p'}{i}")
                if i > 0:
                    runs[guarded].append(result)
    finally:
        for conn in conns:
            conn.send(("stop", None))
        for proc in procs:
            proc.join(timeout=60)
        for transport in transports.values():
            transport.shutdown()
    plain = [statistics.median(column) for column in zip(*runs[False], strict=True)]
    guarded = [statistics.median(column) for column in zip(*runs[True], strict=True)]
    print(f"{'':<28}{'wall s':>9}{'CPU s (both)':>16}")
    print(f"{'refit without the guard':<28}{plain[0]:9.3f}{plain[1]:16.3f}")
    print(f"{'refit with the guard':<28}{guarded[0]:9.3f}{guarded[1]:16.3f}")
    print(f"{'  of which the held check':<28}{guarded[2]:9.3f}{guarded[3]:16.3f}")
    print(
        f"guarded / plain: wall {guarded[0] / plain[0]:.2f}, CPU {guarded[1] / plain[1]:.2f} "
        f"(the guard adds {guarded[0] - plain[0]:.3f} s of wall time per refit)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mb", type=int, default=256, help="MiB of weights (in the generation dtype)")
    parser.add_argument("--bucket-mb", type=int, default=64, help="refit bucket size in MiB")
    parser.add_argument("--dtype", default="float32", help="generation dtype (the policy holds float32)")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the synthetic decoder")
    parser.add_argument("--repeats", type=int, default=5, help="timed pairs of refits (median)")
    parser.add_argument("--moe", action="store_true", help="the per-expert MoE set instead of the dense one")
    args = parser.parse_args()
    dtype = dtype_from_name(args.dtype)
    shapes = weight_shapes(args.total_mb * _MIB, dtype.itemsize, args.hidden)
    if args.moe:
        vocab = shapes["model.embed_tokens.weight"][0]
        shapes = moe_weight_shapes(num_params(shapes), args.hidden, vocab, 64, 128, per_expert=True)
    wire_bytes = num_params(shapes) * dtype.itemsize
    print(f"{len(shapes)} tensors, {wire_bytes / 1e9:.3f} GB in {args.dtype}, {args.bucket_mb} MiB buckets")
    measure(shapes, dtype, args.bucket_mb * _MIB, args.repeats)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
