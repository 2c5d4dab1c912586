"""Where the DTensor policy worker's training step spends its time on the GRPO bench's work, in one process.

The work of ``bench_grpo_vs_trl.py`` at ``--shape`` (default 64x32): the first prompts of the bundled tiny math
training split, each repeated G times, with responses of random tokens whose lengths are drawn like the
bench's (uniform within ``--response-lengths``), random advantages, ``grpo_math_tiny.yaml``'s policy (one rank,
shared prefix on, one micro-batch) and its clipped policy-gradient loss with the previous policy's
log-probs taken from the training forward, as the GRPO run does. One ``DTensorPolicyWorker`` is built in this
process (world size 1, gloo) and its ``train()`` step is timed piece by piece, as ``train()`` runs it:
forward, loss, backward, gradient clipping, optimizer step, zero_grad, step and micro-batch assembly, logs.

    uv run python tools/probes/profile_policy_step.py [--shape 64x32] [--threads 1 2] [--steps 15]
        [--alternate policy.optimizer.kwargs.fused=false ...]

``--alternate OVERRIDE ...`` builds a second optimizer from the config with those ``policy.optimizer.kwargs``
overrides and alternates whole steps of both from the same starting weights: it prints the ratio of the
median steps and how far the weights end apart (0.0: bit for bit).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

# The GRPO bench's work (prompts, config, shapes) comes from benchmarks/bench_grpo_vs_trl.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_grpo_vs_trl import CONFIG, MAX_SEQ_LEN, _our_prompts, parse_shape

PIECES = ("assembly", "zero_grad", "forward", "loss", "backward", "clip", "optimizer", "logs")


def _batch(num_prompts: int, group: int, lengths: tuple[int, int], vocab: int, seed: int) -> Any:
    """A GRPO training batch: each prompt ``group`` times, random responses and advantages."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(seed)
    prompts = [r["ids"] for r in _our_prompts(num_prompts)]
    rows = []
    for ids in prompts:
        for _ in range(group):
            n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
            rows.append((ids, torch.randint(3, vocab, (n,), generator=gen).tolist()))
    width = min(MAX_SEQ_LEN, max(len(p) + len(r) for p, r in rows))
    ids_BT = torch.zeros(len(rows), width, dtype=torch.long)
    token_mask_BT = torch.zeros(len(rows), width)
    for b, (prompt, response) in enumerate(rows):
        tokens = (prompt + response)[:width]
        ids_BT[b, : len(tokens)] = torch.tensor(tokens)
        token_mask_BT[b, len(prompt) : len(tokens)] = 1.0
    advantages_B = torch.randn(len(rows), generator=gen)
    return BatchedDataDict(
        {
            "input_ids": ids_BT,
            "input_lengths": torch.tensor([min(width, len(p) + len(r)) for p, r in rows]),
            "token_mask": token_mask_BT,
            "advantages": advantages_B[:, None].expand(-1, width).clone(),
            "generation_logprobs": torch.zeros(len(rows), width),
            "sample_mask": torch.ones(len(rows)),
        }
    )


def _timed_step(worker: Any, data: Any, loss_fn: Any) -> dict[str, float]:
    """One ``DTensorPolicyWorker.train()`` step (one rank), with a timer around each piece."""
    from nemo_rl.models.policy.optim import clip_grad_norm_
    from nemo_rl.models.policy.worker_batches import TrainLog, step_batches

    times: dict[str, float] = defaultdict(float)
    last = start = time.perf_counter()

    def lap(piece: str) -> None:
        nonlocal last
        now = time.perf_counter()
        times[piece] += now - last
        last = now

    worker.model.train(True)
    log = TrainLog()
    for step in step_batches(
        data,
        worker.cfg,
        gbs=None,
        mbs=None,
        rows_per_group=loss_fn.rows_per_group,
        dp_size=1,
        seq_multiple=worker.seq_multiple,
        device=worker.device,
        dp_group=worker.dp_group,
    ):
        lap("assembly")
        worker.optimizer.zero_grad(set_to_none=True)
        lap("zero_grad")
        batches = list(
            worker._micro_batches(step.batch, step.micro_batch_size, worker._mb_tokens(train=True))
        )
        lap("assembly")
        step_loss, mb_metrics = 0.0, []
        for _, mb in batches:
            logits_BTV = worker._forward(mb)
            lap("forward")
            loss, metrics = loss_fn(logits_BTV, mb, step.global_valid_seqs, step.global_valid_toks)
            lap("loss")
            loss.backward()
            lap("backward")
            step_loss += float(loss.detach().double())
            mb_metrics.append(metrics)
        grad_norm = clip_grad_norm_(worker.model.parameters(), worker.cfg.max_grad_norm)
        lap("clip")
        log.add_update(grad_norm, float(worker.optimizer.param_groups[0]["lr"]))
        worker.optimizer.step()
        worker.scheduler.step()
        lap("optimizer")
        log.end_step(step, step_loss, mb_metrics, worker.dp_group, worker.device)
    log.result(False)
    lap("logs")
    times["total"] = time.perf_counter() - start
    return times


def _breakdown(worker: Any, data: Any, loss_fn: Any, steps: int) -> None:
    for _ in range(3):
        _timed_step(worker, data, loss_fn)
    runs = [_timed_step(worker, data, loss_fn) for _ in range(steps)]
    total = statistics.median(r["total"] for r in runs)
    for piece in (*PIECES, "total"):
        median = statistics.median(r[piece] for r in runs)
        print(f"  {piece:10s} {median * 1e3:8.2f} ms  {median / total:6.1%}")


def _alternate(worker: Any, data: Any, loss_fn: Any, overrides: list[str], steps: int) -> None:
    """Whole steps with the config's optimizer and with the overridden one, from the same weights."""
    import copy

    import yaml

    from nemo_rl.models.policy.optim import build_optimizer, build_scheduler

    start = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    variants = {"config": copy.deepcopy(worker.cfg.optimizer)}
    other = copy.deepcopy(worker.cfg.optimizer)
    for override in overrides:
        key, value = override.split("=", 1)
        other.kwargs[key.removeprefix("policy.optimizer.kwargs.")] = yaml.safe_load(value)
    variants[" ".join(overrides)] = other
    times: dict[str, list[float]] = {name: [] for name in variants}
    ends: dict[str, dict[str, torch.Tensor]] = {}
    for _ in range(5):
        for name, optimizer_cfg in variants.items():
            with torch.no_grad():
                for key, value in worker.model.state_dict().items():
                    value.copy_(start[key])
            worker.optimizer = build_optimizer(worker.model.parameters(), optimizer_cfg)
            worker.scheduler = build_scheduler(worker.optimizer, worker.cfg.scheduler)
            for i in range(steps):
                elapsed = _timed_step(worker, data, loss_fn)["total"]
                if i > 0:
                    times[name].append(elapsed)
            ends[name] = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    base = statistics.median(times["config"])
    for name, values in times.items():
        diff = max((ends[name][k] - ends["config"][k]).abs().max().item() for k in ends["config"])
        print(
            f"  {name:40s} median step {statistics.median(values) * 1e3:8.2f} ms "
            f"({statistics.median(values) / base:.2f}x), weights apart by {diff:.1e} after {steps} steps"
        )


def main() -> None:
    """Parse the arguments, build the worker and time its step at every thread count."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="64x32")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--response-lengths", nargs=2, type=int, default=[8, 26])
    parser.add_argument("--alternate", nargs="+", default=None, help="policy.optimizer.kwargs.KEY=VALUE ...")
    args = parser.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from nemo_rl.distributed.virtual_cluster import free_port

    os.environ["MASTER_PORT"] = str(free_port())

    from nemo_rl.algorithms.loss_functions import ClippedPGLossFn
    from nemo_rl.config.loader import load_and_validate
    from nemo_rl.config.master import GRPOMasterConfig
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    num_prompts, group, _ = parse_shape(args.shape)
    num_samples = num_prompts * group
    config = load_and_validate(
        CONFIG,
        GRPOMasterConfig,
        [
            f"policy.max_total_sequence_length={MAX_SEQ_LEN}",
            f"policy.train_global_batch_size={num_samples}",
            f"policy.train_micro_batch_size={num_samples}",
        ],
    )
    worker = DTensorPolicyWorker(config.policy, init_reference_model=False)
    worker.prepare_for_training()
    vocab = int(worker.model.config.vocab_size)
    data = _batch(num_prompts, group, tuple(args.response_lengths), vocab, seed=0)
    loss_fn = ClippedPGLossFn(config.loss_fn, prev_logprobs_from_forward=True)
    print(
        f"load average at start {os.getloadavg()[0]:.2f}; {num_samples} rows, {int(data['input_lengths'].sum())} tokens"
    )
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"{args.shape}, {threads} torch thread(s), median of {args.steps} steps:")
        if args.alternate:
            _alternate(worker, data, loss_fn, args.alternate, args.steps)
        else:
            _breakdown(worker, data, loss_fn, args.steps)


if __name__ == "__main__":
    main()
