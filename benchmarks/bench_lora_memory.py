"""Memory and refit traffic of LoRA against full fine-tuning, on a model of tens of millions of parameters.

    uv run python benchmarks/bench_lora_memory.py [--hidden 512 --layers 8 --rank 8 --steps 2]

Builds a Qwen2 model locally (no hub), then for each side (full fine-tuning, LoRA on every linear layer) runs a
one-rank DTensor policy worker in a fresh process: ``--steps`` SFT steps of AdamW on ``--rows`` x ``--seq``
random tokens, fp32, CPU.
Each side reports the trainable parameters, the optimizer-state bytes, the worker process's peak resident
memory above what it held before the worker was built (the interpreter, torch and transformers, the same on
both sides; on CPU the model load's transient copies set it), how much its resident memory grew while it
trained (gradients, optimizer state, activations), and the refit payload of a step after the first (the bytes the policy's refit stream yields in the
generation dtype: the whole model for full fine-tuning, the adapters for LoRA). Ratios LoRA / full at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def build_model(path: Path, hidden: int, layers: int) -> int:
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
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _tensor_bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_side(model_dir: str, lora_rank: int, steps: int, rows: int, seq: int) -> dict[str, float]:
    """One side, in this process (a fresh one per side): build the worker, train, measure."""
    import torch

    from nemo_rl.config.policy import PolicyConfig
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.distributed.virtual_cluster import free_port
    from nemo_rl.models.lora import is_adapter_name
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    sys.path.insert(0, str(ROOT / "tests" / "distributed"))
    from test_dtensor_worker import TinyNLLLoss  # the token-level NLL of the worker tests

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(free_port()), NEMO_RL_TORCH_THREADS="1")
    lora = {"enabled": True, "dim": lora_rank, "alpha": 2 * lora_rank} if lora_rank else {"enabled": False}
    cfg = PolicyConfig.model_validate(
        {
            "model_name": model_dir,
            "train_global_batch_size": rows,
            "train_micro_batch_size": rows,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-4}},
            "dtensor_cfg": {"lora_cfg": lora},
        }
    )
    # The process's own footprint (torch, transformers, the interpreter) before the worker exists: the peak
    # is reported above it, since it is the same for both sides and would hide their difference.
    baseline = _current_rss_bytes()
    worker = DTensorPolicyWorker(cfg, init_reference_model=bool(lora_rank))
    built = _current_rss_bytes()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(2, 100, (rows, seq), generator=g)
        batch = BatchedDataDict(
            {
                "input_ids": ids,
                "input_lengths": torch.full((rows,), seq),
                "token_mask": torch.ones(rows, seq),
                "sample_mask": torch.ones(rows),
            }
        )
        worker.train(batch, TinyNLLLoss())
    trained = _current_rss_bytes()
    params = dict(worker.model.named_parameters())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    optimizer_bytes = sum(_tensor_bytes(state) for state in worker.optimizer.state.values())
    if lora_rank:
        refit_bytes = sum(_tensor_bytes(p) for name, p in params.items() if is_adapter_name(name))
    else:
        refit_bytes = sum(_tensor_bytes(t) for _, t in worker.iter_hf_weights(torch.float32))
    worker.shutdown()
    return {
        "trainable_params": float(trainable),
        "optimizer_state_bytes": float(optimizer_bytes),
        "peak_rss_above_start_bytes": float(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
        ),
        "rss_growth_in_training_bytes": float(trained - built),
        "refit_bytes_per_step": float(refit_bytes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    # A small batch: on CPU a large one's activations (freed before the optimizer step, whose state then reuses
    # their memory) hide the gradient and optimizer-state terms this compares.
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--side", default=None, help=argparse.SUPPRESS)  # internal: run one side and print
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(run_side(args.model_dir, int(args.side), args.steps, args.rows, args.seq)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        num_params = build_model(Path(tmp), args.hidden, args.layers)
        print(f"model: {num_params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers), fp32")
        results = {}
        for name, rank in (("full", 0), (f"lora r={args.rank}", args.rank)):
            cmd = [
                sys.executable,
                __file__,
                "--side",
                str(rank),
                "--model-dir",
                tmp,
                "--steps",
                str(args.steps),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
            results[name] = json.loads(out.strip().splitlines()[-1])
    full, lora = results["full"], results[f"lora r={args.rank}"]
    print(f"{'':24}{'full':>14}{'lora':>14}{'lora/full':>11}")
    for key in full:
        print(f"{key:24}{full[key]:>14,.0f}{lora[key]:>14,.0f}{lora[key] / full[key]:>11.4f}")


if __name__ == "__main__":
    main()
