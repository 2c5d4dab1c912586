"""The NCCL stage of ``tools/gpu_check.sh``: process groups between processes on this machine's GPUs.

``allreduce``: two processes, one per GPU, all-reduce a tensor over NCCL (needs two GPUs).
``refit``: a collective refit (``nemo_rl.weight_sync.CollectiveTransport``) from a sender process to a
receiver process. With ``--same-gpu`` both use GPU 0, as a colocated layout does: the refit group must be
built on gloo, since NCCL refuses two ranks on one GPU; otherwise they use GPUs 0 and 1 and the group must
be NCCL. ``--cpu`` runs the refit without CUDA (gloo), to try the script on any machine.

Exit status: 0 when the check passed, 77 when it cannot run here (the reason on the last line), 1 when it
failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

SKIP = 77
TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _allreduce_worker(rank: int, port: int, results: Any) -> None:
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        tensor = torch.full((1 << 20,), float(rank + 1), device=f"cuda:{rank}")
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
        ok = bool(torch.all(tensor == 3.0).item())
        dist.destroy_process_group()
        results.put((rank, "ok" if ok else f"wrong sum {tensor[:4].tolist()}"))
    except Exception:
        results.put((rank, traceback.format_exc()))


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "embed.weight": (512, 64),
        "layer.0.weight": (64, 64),
        "layer.0.bias": (64,),
        "head.weight": (512, 64),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _refit_worker(role: str, local_rank: int, endpoint: Any, results: Any) -> None:
    try:
        os.environ["LOCAL_RANK"] = str(local_rank)
        from nemo_rl.distributed.device import cuda_available, get_device
        from nemo_rl.weight_sync import WeightManifest
        from nemo_rl.weight_sync.collective import connect_group

        device = get_device()
        if cuda_available():
            torch.cuda.set_device(device)
        weights = _weights()
        if role == "sender":
            endpoint.send((name, tensor.to(device)) for name, tensor in weights.items())
            backend = connect_group(endpoint.group, 0).backend
            results.put((role, "ok", backend))
            return
        received: dict[str, torch.Tensor] = {}

        def load(stream: Any) -> None:
            for name, tensor in stream:
                received[name] = tensor.detach().to("cpu", copy=True)

        manifest = WeightManifest.from_named_tensors(weights.items(), torch.bfloat16)
        endpoint.receive(load, manifest)
        wrong = [
            name
            for name, tensor in weights.items()
            if not torch.equal(received[name], tensor.to(torch.bfloat16))
        ]
        backend = connect_group(endpoint.groups[0], 1 + endpoint.index).backend
        results.put((role, "ok" if not wrong else f"weights differ: {wrong}", backend))
    except Exception:
        results.put((role, traceback.format_exc(), ""))


def _run(processes: list[Any], results: Any, count: int) -> list[Any]:
    for process in processes:
        process.start()
    out = []
    try:
        for _ in range(count):
            out.append(results.get(timeout=TIMEOUT_S))
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return out


def check_allreduce() -> int:
    if torch.cuda.device_count() < 2:
        print(f"SKIP: the NCCL all-reduce needs 2 GPUs, this machine has {torch.cuda.device_count()}")
        return SKIP
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    processes = [ctx.Process(target=_allreduce_worker, args=(rank, port, results)) for rank in range(2)]
    out = _run(processes, results, 2)
    failed = [f"rank {rank}: {message}" for rank, message in out if message != "ok"]
    if failed:
        print("FAIL: NCCL all-reduce\n" + "\n".join(failed))
        return 1
    print("NCCL all-reduce over 2 GPUs: both ranks got the sum")
    return 0


def check_refit(same_gpu: bool, cpu: bool) -> int:
    if not cpu and not torch.cuda.is_available():
        print("SKIP: no CUDA GPU (torch.cuda.is_available() is False)")
        return SKIP
    if not cpu and not same_gpu and torch.cuda.device_count() < 2:
        print(f"SKIP: a refit between two GPUs needs 2, this machine has {torch.cuda.device_count()}")
        return SKIP
    from nemo_rl.weight_sync import TransportSettings, build_refit_transport

    transport = build_refit_transport(
        "collective",
        TransportSettings(torch.bfloat16, 64 * 1024, TIMEOUT_S, "127.0.0.1"),
        policy_node_ids=["node"],
        generation_node_ids=["node"],
    )
    senders, receivers = transport.endpoints("gpu-check")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env_before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the children see no GPU
    try:
        processes = [
            ctx.Process(target=_refit_worker, args=("sender", 0, senders[0], results)),
            ctx.Process(target=_refit_worker, args=("receiver", 0 if same_gpu else 1, receivers[0], results)),
        ]
        out = _run(processes, results, 2)
    finally:
        if cpu:
            if env_before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = env_before
        transport.shutdown()
    failed = [f"{role}: {message}" for role, message, _ in out if message != "ok"]
    expected = "gloo" if (same_gpu or cpu) else "nccl"
    backends = {backend for _, _, backend in out}
    where = "on CPU" if cpu else ("both on GPU 0" if same_gpu else "on GPUs 0 and 1")
    if failed:
        print(f"FAIL: collective refit, sender and receiver {where}\n" + "\n".join(failed))
        return 1
    if backends != {expected}:
        print(f"FAIL: collective refit {where} built its group on {sorted(backends)}, expected {expected}")
        return 1
    print(f"collective refit, sender and receiver {where}: weights bit for bit, group on {expected}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["allreduce", "refit"])
    parser.add_argument("--same-gpu", action="store_true", help="refit: both processes on GPU 0")
    parser.add_argument("--cpu", action="store_true", help="refit: without CUDA, over gloo")
    args = parser.parse_args()
    if args.check == "allreduce":
        return check_allreduce()
    return check_refit(args.same_gpu, args.cpu)


if __name__ == "__main__":
    sys.exit(main())
