"""What a reward-model training step costs per preference pair, with and without sharing within a batch.

One DTensor policy worker per case (one process, world size 1, gloo, one torch thread) holds
``rm_tiny_math.yaml``'s reward model (``tiny_math_teacher`` frozen, three fresh layers and the scalar head)
and trains on batches of that recipe's ``tiny_math_preference`` pairs (128 pairs = 256 rows, one micro-batch):

- ``pairs shuffled, plain``: pairs drawn one by one (the recipe's earlier shape), the ordinary forward;
- ``pairs shuffled, shared prompt``: the same batches with ``policy.shared_prefix`` (a pair's chosen and
  rejected rows hold their prompt once);
- ``2 pairs of a problem, plain``: batches served two pairs of a problem at a time
  (``rm.group_pairs_by_prompt: 2``), the ordinary forward;
- ``2 pairs of a problem, shared + dedupe``: those batches with ``shared_prefix`` and ``dedupe_rows`` (a
  group's prompt and its repeated correct answer run once): the recipe's shape on one worker slot.

The cases take turns within each repeat (the first repeat, warm-up, is not counted), so a change in the
machine's load hits all alike. Printed: the median seconds of a training step, pairs per second, the ratio to
the first case, and each case's first loss (the two forwards of one kind of batch must agree)::

    uv run python benchmarks/bench_rm_pairs.py [--repeats 5] [--pairs 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from nemo_rl.algorithms.loss_functions import PreferenceLoss
from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.master import RMMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "rm_tiny_math.yaml"


def batches(config: RMMasterConfig, pairs: int, group: int, count: int) -> list[BatchedDataDict[Any]]:
    """The recipe's first ``count`` training batches of ``pairs`` pairs, served ``group`` pairs of a problem
    at a time (0: pairs shuffled one by one)."""
    from nemo_rl.data.collate_fn import make_preference_collate_fn
    from nemo_rl.data.dataloader import StatefulDataLoader
    from nemo_rl.data.datasets import prompt_groups, setup_preference_data
    from nemo_rl.models.tokenizer import get_policy_tokenizer

    tokenizer = get_policy_tokenizer(config.policy)
    seq_len = config.policy.max_total_sequence_length
    train, _ = setup_preference_data(config.data, tokenizer, max_total_sequence_length=seq_len)
    loader = StatefulDataLoader(
        train,
        batch_size=pairs,
        shuffle=True,
        seed=config.rm.seed,
        drop_last=True,
        collate_fn=make_preference_collate_fn(tokenizer, seq_len),
        groups=prompt_groups(train, group) if group else None,
    )
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == count:
            return out
    raise ValueError(f"the data has fewer than {count} batches of {pairs} pairs")


def build(config: RMMasterConfig, pairs: int, shared: bool, dedupe: bool) -> Any:
    """A one-rank reward-model worker with the recipe's policy, one micro-batch of ``pairs`` pairs."""
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    policy = config.policy.model_copy(deep=True)
    policy.train_global_batch_size = policy.train_micro_batch_size = pairs
    policy.shared_prefix.enabled = shared
    policy.shared_prefix.dedupe_rows = dedupe
    return DTensorPolicyWorker(PolicyConfig.model_validate(policy.model_dump()), init_reference_model=False)


def main() -> None:
    """Time each case's training step on the same batches and print pairs/s and ratios."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=128)
    args = parser.parse_args()
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    os.environ.setdefault("NEMO_RL_TORCH_THREADS", "1")
    config = load_and_validate(CONFIG, RMMasterConfig)
    print(f"load average {os.getloadavg()[0]:.2f} (timings on a loaded machine are noisy)")
    data = {
        "shuffled": batches(config, args.pairs, 0, args.repeats + 1),
        "grouped": batches(config, args.pairs, 2, args.repeats + 1),
    }
    cases = {
        "pairs shuffled, plain": ("shuffled", False, False),
        "pairs shuffled, shared prompt": ("shuffled", True, False),
        "2 pairs of a problem, plain": ("grouped", False, False),
        "2 pairs of a problem, shared + dedupe": ("grouped", True, True),
    }
    workers = {name: build(config, args.pairs, shared, dedupe) for name, (_, shared, dedupe) in cases.items()}
    times: dict[str, list[float]] = {name: [] for name in cases}
    first_loss: dict[str, float] = {}
    for repeat in range(args.repeats + 1):
        for name, worker in workers.items():
            batch = data[cases[name][0]][repeat]
            start = time.perf_counter()
            loss = float(worker.train(batch, PreferenceLoss())["loss"][0])
            times[name].append(time.perf_counter() - start)
            first_loss.setdefault(name, loss)
    for worker in workers.values():
        worker.shutdown()
    base = statistics.median(times["pairs shuffled, plain"][1:])
    for name, t in times.items():
        step = statistics.median(t[1:])
        print(
            f"  {name:38s} {step:.3f} s/step  {args.pairs / step:7.1f} pairs/s  {base / step:.2f}x   "
            f"first loss {first_loss[name]:.7f}"
        )


if __name__ == "__main__":
    main()
