"""The context-parallel stage of ``tools/gpu_check.sh``: three training steps with CP=2 on two GPUs against
CP=1 on the same two GPUs (DP=2), on the tiny checkpoint, float32 with TF32 off.

``dtensor``: the DTensor worker with ``policy.dtensor_cfg.context_parallel_size=2`` (the hooks of
``nemo_rl/models/policy/context_parallel.py``, over NCCL). ``megatron``: the Megatron worker with
``policy.megatron_cfg.context_parallel_size=2`` and TP=1 (megatron-core's context-parallel attention, Transformer
Engine's). CP=2 puts half of every row on each GPU, CP=1 half of the rows; the losses, gradient norms and
log-probs of both must agree (the numbers do not depend on the split). ``--cpu`` runs ``dtensor`` on gloo
without CUDA, to try the script on any machine.

Exit status: 0 when the check passed, 77 when it cannot run here (the reason on the last line), 1 when it
failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "assets" / "tiny_qwen2_init"
SKIP = 77
TIMEOUT_S = 300.0
GLOBAL_BATCH, NUM_STEPS, SEQ_LEN = 4, 3, 60
RTOL = 1e-4
"""GPU kernels sum in another order for each split (float32, TF32 off): agreement to about 1e-6 relative per
step, loosened for three optimizer steps."""


def _policy(backend: str, cp: int) -> Any:
    from nemo_rl.config.policy import PolicyConfig

    common = {
        "model_name": str(MODEL),
        "precision": "float32",
        "train_global_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_total_sequence_length": SEQ_LEN,
        "make_sequence_length_divisible_by": 4,
        "max_grad_norm": 1.0,
    }
    if backend == "dtensor":
        return PolicyConfig.model_validate(
            common
            | {
                "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3, "weight_decay": 0.0}},
                "dtensor_cfg": {"context_parallel_size": cp, "data_parallel_mode": "fsdp"},
            }
        )
    return PolicyConfig.model_validate(
        common
        | {
            "optimizer": None,
            "scheduler": None,
            "dtensor_cfg": {"enabled": False},
            "megatron_cfg": {
                "enabled": True,
                "context_parallel_size": cp,
                "optimizer": {"lr": 1e-3, "min_lr": 0.0, "weight_decay": 0.0, "clip_grad": 1.0},
                "scheduler": {"lr_warmup_iters": 0},
            },
        }
    )


def _batch(seed: int, num_rows: int) -> Any:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, SEQ_LEN + 1, (num_rows,), generator=g)
    positions = torch.arange(SEQ_LEN)[None, :]
    valid = positions < lengths[:, None]
    return BatchedDataDict(
        {
            "input_ids": torch.randint(3, 104, (num_rows, SEQ_LEN), generator=g) * valid,
            "input_lengths": lengths,
            "token_mask": ((positions >= 2) & valid).float(),
            "sample_mask": torch.ones(num_rows),
        }
    )


def _rank(rank: int, backend: str, port: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        from nemo_rl.algorithms.loss_functions import NLLLoss

        if backend == "dtensor":
            from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker as Worker
        else:
            from nemo_rl.models.policy.megatron_worker import MegatronPolicyWorker as Worker  # type: ignore[assignment]
        data, score = _batch(1, GLOBAL_BATCH * NUM_STEPS), _batch(2, 4)
        for cp in (2, 1):
            worker = Worker(_policy(backend, cp), init_reference_model=False)
            shard = data.shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH)[worker.dp_rank]
            train = worker.train(shard, NLLLoss())
            logprobs = worker.get_logprobs(score)["logprobs"].cpu()
            torch.save((train["loss"], train["grad_norm"], logprobs), Path(out_dir) / f"cp{cp}.rank{rank}.pt")
            worker.shutdown()
    except BaseException:
        (Path(out_dir) / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _compare(out_dir: Path) -> list[str]:
    problems = []
    for rank in range(2):
        cp2, cp1 = (torch.load(out_dir / f"cp{cp}.rank{rank}.pt") for cp in (2, 1))
        for name, got, want in zip(("loss", "grad_norm", "log-probs"), cp2, cp1, strict=True):
            if not torch.allclose(got.double(), want.double(), rtol=RTOL, atol=1e-5):
                worst = float((got.double() - want.double()).abs().max())
                problems.append(f"rank {rank}: CP=2 {name} differs from CP=1 by up to {worst:.2e}")
    return problems


def check(backend: str, cpu: bool) -> int:
    gpus = 0 if cpu else torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not cpu and gpus < 2:
        print(f"SKIP: context parallelism over 2 GPUs needs 2, this machine has {gpus}")
        return SKIP
    if backend == "megatron" and (cpu or importlib.util.find_spec("transformer_engine") is None):
        why = "runs on CUDA only" if cpu else "is not importable (install the `te` extra)"
        print(f"SKIP: Megatron's context-parallel attention is Transformer Engine's, which {why}")
        return SKIP
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the spawned ranks then use gloo on the host
    from nemo_rl.distributed.virtual_cluster import free_port

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp)
        port = free_port()
        processes = [ctx.Process(target=_rank, args=(rank, backend, port, tmp)) for rank in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=TIMEOUT_S)
            if process.is_alive():
                process.kill()
        errors = sorted(out_dir.glob("error.*.txt"))
        if errors or any(p.exitcode != 0 for p in processes):
            print("\n".join(p.read_text() for p in errors))
            print(f"FAIL: the ranks exited with {[p.exitcode for p in processes]}")
            return 1
        problems = _compare(out_dir)
    where = "2 CPU ranks (gloo)" if cpu else "2 GPUs"
    if problems:
        print("\n".join(problems))
        print(f"FAIL: {backend} CP=2 differs from CP=1 on {where}")
        return 1
    print(
        f"{backend}: {NUM_STEPS} steps with CP=2 on {where} match CP=1 (loss, grad norm, log-probs, rtol {RTOL})"
    )
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend", choices=["dtensor", "megatron"])
    parser.add_argument("--cpu", action="store_true", help="run on gloo without CUDA (dtensor only)")
    args = parser.parse_args()
    sys.exit(check(args.backend, args.cpu))


if __name__ == "__main__":
    main()
