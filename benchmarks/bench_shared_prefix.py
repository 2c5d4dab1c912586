"""The shared-prompt forward (``policy.shared_prefix``) against the ordinary one, on GRPO-shaped batches.

One DTensor policy worker (one process, world size 1, gloo, one torch thread) trains the committed
``examples/assets/tiny_math_sft`` checkpoint on GRPO batches of the bundled ``tiny_math`` prompts: ``P``
prompts x ``G`` samples, each sample a random response of uniformly drawn length (``N / 4`` to ``N`` tokens),
with the policy settings of ``examples/configs/grpo_math_tiny.yaml`` (token-budget micro-batches) and GRPO's
clipped policy-gradient loss. Each shape runs twice on fresh copies of the same weights, without and with
``policy.shared_prefix.enabled``. Printed per shape: tokens/s (real tokens of the unshared rows, prompts
counted once per sample) of a training step (forward, backward, AdamW step) and of a log-prob pass, the
ratio shared / unshared, and the first step's loss of each (they must agree: the shared forward computes the
same function). A third run, ``shared, FSDP``, wraps the one-rank model in FSDP2 as it was before one-rank
float32 policies ran as plain modules (``parallelize.needs_fsdp``), to measure what that costs::

    uv run python benchmarks/bench_shared_prefix.py [--shapes 8x8x32 32x16x24] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from nemo_rl.algorithms.loss_functions import ClippedPGLossFn
from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.loss import ClippedPGLossConfig
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
MAX_SEQ_LEN = 80


def prompts(config: GRPOMasterConfig, num_prompts: int) -> list[list[int]]:
    """The first ``num_prompts`` prompts of the tiny math training split, as token ids."""
    from nemo_rl.data.datasets import setup_rl_data
    from nemo_rl.models.tokenizer import get_policy_tokenizer

    train, _ = setup_rl_data(
        config.data, get_policy_tokenizer(config.policy), max_total_sequence_length=MAX_SEQ_LEN
    )
    return [[int(t) for m in train[i]["message_log"] for t in m["token_ids"]] for i in range(num_prompts)]


def grpo_batch(prompt_ids: list[list[int]], group: int, new_tokens: int, vocab: int) -> BatchedDataDict[Any]:
    """``group`` consecutive samples per prompt with random responses, and GRPO's per-token keys."""
    g = torch.Generator().manual_seed(0)
    rows = [
        prompt
        + torch.randint(
            3, vocab, (int(torch.randint(new_tokens // 4, new_tokens + 1, (), generator=g)),), generator=g
        ).tolist()
        for prompt in prompt_ids
        for _ in range(group)
    ]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    token_mask = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        token_mask[i, len(prompt_ids[i // group]) : len(row)] = 1.0
    advantages = torch.randn(len(rows), 1, generator=g).expand(-1, width).contiguous()
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.tensor([len(r) for r in rows]),
            "token_mask": token_mask,
            "sample_mask": torch.ones(len(rows)),
            "advantages": advantages,
            "generation_logprobs": -torch.rand(len(rows), width, generator=g) * token_mask,
        }
    )


def build(cfg: PolicyConfig, fsdp: bool) -> Any:
    """A one-rank worker; ``fsdp`` wraps it in FSDP2 although it has one rank (the layout before)."""
    from nemo_rl.models.policy import hf_io
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    needs_fsdp = hf_io.needs_fsdp
    if fsdp:
        hf_io.needs_fsdp = lambda *args: True
    try:
        return DTensorPolicyWorker(cfg, init_reference_model=False)
    finally:
        hf_io.needs_fsdp = needs_fsdp


def measure(
    workers: dict[str, Any], batch: BatchedDataDict[Any], repeats: int
) -> dict[str, dict[str, float]]:
    """Median seconds of a training step and of a log-prob pass of each worker, and its first step's loss.

    The workers take turns within each repeat, so a change in the machine's load hits all of them alike; the
    first repeat (allocator and kernel warm-up) is not counted.
    """
    loss_fn = ClippedPGLossFn(
        ClippedPGLossConfig(reference_policy_kl_penalty=0.0, token_level_loss=True),
        prev_logprobs_from_forward=True,
    )
    times: dict[str, dict[str, list[float]]] = {name: {"train": [], "score": []} for name in workers}
    losses: dict[str, float] = {}
    for _ in range(repeats + 1):
        for name, worker in workers.items():
            start = time.perf_counter()
            loss = float(worker.train(batch, loss_fn)["loss"][0])
            times[name]["train"].append(time.perf_counter() - start)
            losses.setdefault(name, loss)
            start = time.perf_counter()
            worker.get_logprobs(batch)
            times[name]["score"].append(time.perf_counter() - start)
    return {
        name: {
            "train_s": statistics.median(t["train"][1:]),
            "score_s": statistics.median(t["score"][1:]),
            "loss": losses[name],
        }
        for name, t in times.items()
    }


def main() -> None:
    """Time both forwards on each shape and print tokens/s, ratios and first-step losses."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", nargs="+", default=["8x8x32", "32x16x24"], help="PROMPTSxGROUPxNEW_TOKENS"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    os.environ.setdefault("NEMO_RL_TORCH_THREADS", "1")
    config = load_and_validate(CONFIG, GRPOMasterConfig, [f"policy.max_total_sequence_length={MAX_SEQ_LEN}"])
    vocab = int(__import__("transformers").AutoConfig.from_pretrained(config.policy.model_name).vocab_size)
    print(f"load average {os.getloadavg()[0]:.2f} (timings on a loaded machine are noisy)")
    for shape in args.shapes:
        num_prompts, group, new_tokens = (int(x) for x in shape.split("x"))
        batch = grpo_batch(prompts(config, num_prompts), group, new_tokens, vocab)
        rows = batch.size
        real_tokens = int(batch["input_lengths"].sum())
        prompt_tokens = int((batch["token_mask"].argmax(dim=1)).sum())
        print(
            f"{shape}: {rows} rows, {real_tokens} tokens ({prompt_tokens} of them prompt tokens, "
            f"{prompt_tokens // group} once shared), micro-batch budgets "
            f"{config.policy.dynamic_batching.train_mb_tokens} / {config.policy.dynamic_batching.logprob_mb_tokens} tokens"
        )
        workers = {}
        for name, shared, fsdp in (
            ("unshared", False, False),
            ("shared", True, False),
            ("shared, FSDP", True, True),
        ):
            policy = config.policy.model_copy(deep=True)
            policy.train_global_batch_size = rows
            policy.shared_prefix.enabled = shared
            workers[name] = build(PolicyConfig.model_validate(policy.model_dump()), fsdp)
        results = measure(workers, batch, args.repeats)
        for worker in workers.values():
            worker.shutdown()
        base = results["unshared"]
        for name, r in results.items():
            print(
                f"  {name:12s} training {real_tokens / r['train_s']:8.0f} tok/s "
                f"({r['train_s']:.3f} s, {base['train_s'] / r['train_s']:.2f}x)   log-probs "
                f"{real_tokens / r['score_s']:8.0f} tok/s ({r['score_s']:.3f} s, "
                f"{base['score_s'] / r['score_s']:.2f}x)   first loss {r['loss']:.7f}"
            )


if __name__ == "__main__":
    main()
