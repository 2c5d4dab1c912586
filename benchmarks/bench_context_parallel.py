"""Context parallelism's activation memory per rank and step time, CP=1 against CP=2 on the same batch.

    uv run python benchmarks/bench_context_parallel.py [--seqs 4096 8192 --hidden 256 --layers 8 --rows 1]

Builds a Qwen2 model locally (no hub; grouped-query attention, one key/value head), then for each sequence
length and each side runs DTensor policy workers on gloo ranks (one process per rank, one torch thread each):
CP=1 on one rank, CP=2 on two ranks of one data-parallel group. Each side trains the same ``--rows`` random rows
of the full length with the token-level NLL: one warm-up step, then one measured step. Per rank it reports

- the activations the measured step keeps for its backward pass: every tensor autograd saves during the
  forward and the loss (``torch.autograd.graph.saved_tensors_hooks``), each storage counted once, parameters
  (and views of them) left out. With one micro-batch nothing is freed before the backward starts, so their
  sum is the peak of activation memory;
- the measured step's wall time and CPU seconds.

It prints both sides and the ratios CP=2 / CP=1 (the worst rank of each side). On a shared or contended machine
the CPU seconds say more than the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def build_model(path: Path, hidden: int, layers: int, max_positions: int) -> int:
    """A Qwen2 model with the tiny character tokenizer; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nemo_rl.data.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(path)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


class SavedActivations:
    """Sums the bytes of every storage autograd saves while active, parameters and their views left out."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.storages: dict[int, int] = {}

    def _pack(self, tensor: Any) -> Any:
        import torch
        from torch.distributed.tensor import DTensor

        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, (torch.nn.Parameter, DTensor)):
            return tensor
        # Under FSDP2 a module's parameters are unsharded ones while it runs: read them at each save.
        params = {
            p.untyped_storage().data_ptr()
            for p in self.model.parameters()
            if not isinstance(p, DTensor) and p.untyped_storage().nbytes() > 0
        }
        storage = base.untyped_storage()
        if storage.data_ptr() not in params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def hooks(self) -> Any:
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def run_rank(rank: int, world_size: int, port: int, model_dir: str, seq: int, rows: int, out: str) -> None:
    """One rank of one side: build the worker, warm up, measure one training step, write the numbers."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NEMO_RL_TORCH_THREADS="1")
    import torch

    from nemo_rl.algorithms.loss_functions import NLLLoss
    from nemo_rl.config.policy import PolicyConfig
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    cfg = PolicyConfig.model_validate(
        {
            "model_name": model_dir,
            "train_global_batch_size": rows,
            "train_micro_batch_size": rows,
            "max_total_sequence_length": seq,
            "make_sequence_length_divisible_by": 4,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4}},
            "dtensor_cfg": {"context_parallel_size": world_size},
        }
    )
    worker = DTensorPolicyWorker(cfg)
    g = torch.Generator().manual_seed(0)
    batch = BatchedDataDict(
        {
            "input_ids": torch.randint(2, 40, (rows, seq), generator=g),
            "input_lengths": torch.full((rows,), seq),
            "token_mask": torch.ones(rows, seq),
            "sample_mask": torch.ones(rows),
        }
    )
    worker.train(batch, NLLLoss())  # warm-up
    saved = SavedActivations(worker.model)
    wall, cpu = time.perf_counter(), time.process_time()
    with saved.hooks():
        result = worker.train(batch, NLLLoss())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    worker.shutdown()
    numbers = {"activation_bytes": saved.nbytes, "step_s": wall, "step_cpu_s": cpu}
    numbers["loss"] = float(result["loss"][-1])
    Path(out, f"cp{world_size}.rank{rank}.json").write_text(json.dumps(numbers))


def run_side(
    cp: int, model_dir: str, seq: int, rows: int, out: Path, timeout_s: float
) -> list[dict[str, float]]:
    """Every rank's numbers of the CP=``cp`` side."""
    sys.path.insert(0, str(ROOT / "tests" / "distributed"))
    from rank_groups import spawn_and_wait

    from nemo_rl.distributed.virtual_cluster import free_port

    spawn_and_wait(run_rank, (cp, free_port(), model_dir, seq, rows, str(out)), cp, timeout_s)
    return [json.loads(Path(out, f"cp{cp}.rank{r}.json").read_text()) for r in range(cp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp, "model")
        num_params = build_model(model_dir, args.hidden, args.layers, max(args.seqs))
        print(f"model: {num_params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers), fp32")
        print(
            f"{'tokens':>7} {'side':>5} {'activations/rank MiB':>21} {'step s':>8} {'step CPU s/rank':>16} {'loss':>8}"
        )
        for seq in args.seqs:
            worst = {}
            for cp in (1, 2):
                out = Path(tmp, f"seq{seq}")
                out.mkdir(exist_ok=True)
                ranks = run_side(cp, str(model_dir), seq, args.rows, out, args.timeout_s)
                worst[cp] = {key: max(r[key] for r in ranks) for key in ranks[0]}
                w = worst[cp]
                print(
                    f"{seq:>7} {'CP=' + str(cp):>5} {w['activation_bytes'] / 2**20:>21.1f} {w['step_s']:>8.2f} "
                    f"{w['step_cpu_s']:>16.2f} {w['loss']:>8.4f}",
                    flush=True,
                )
            ratios = {
                key: worst[2][key] / worst[1][key] for key in ("activation_bytes", "step_s", "step_cpu_s")
            }
            print(
                f"{seq:>7} ratio CP=2/CP=1: activations {ratios['activation_bytes']:.3f}, step time "
                f"{ratios['step_s']:.3f}, CPU seconds per rank {ratios['step_cpu_s']:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
