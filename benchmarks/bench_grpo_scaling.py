"""How a GRPO step's cost against TRL's grows with the model and with the sequences.

    uv run python benchmarks/bench_grpo_scaling.py --trl-python /work/trl_venv/bin/python \\
        [--models tiny 25m 100m] [--model-shape 16x32] [--lengths 32 128 512 1024] [--length-samples 16] \\
        [--threads 1] [--steps 3] [--warmup 1] [--json-out scaling.json]

Both sides run ``bench_grpo_vs_trl.py``'s comparison (the same prompts, settings, phases and agreement checks)
on checkpoints built here from configs, with the tiny model's tokenizer (104 tokens) and random weights:

- ``tiny``: the tiny model's shape (hidden 128, 4 layers, 0.8M parameters);
- ``25m``: hidden 512, 8 layers, intermediate 1536 (25M parameters);
- ``100m``: hidden 768, 12 layers, intermediate 3072 (106M parameters).

A random model would end its samples at a random length, so every checkpoint is built so that it never picks
the end-of-sequence token: its output layer (not tied to the embeddings) has unit-scale weights, which give
logits tens apart, and an all-zero row for that token, whose logit stays 0. Both sides then generate exactly
the new-token budget, and the sequence axis is measured as given. The model axis runs every ``--models`` at
``--model-shape`` (samples x new tokens, as ``bench_grpo_vs_trl.py``'s shapes: 16 samples are 2 prompts x 8);
the sequence axis runs the tiny shape with ``--length-samples`` samples and each of ``--lengths`` new tokens. It ends with one table per axis: each side's median step, the ratio, and
each side's generation and training shares.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_grpo_vs_trl import MODEL, check_trl_bytecode, run_pair

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 384, "heads": 4},
    "25m": {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1536, "heads": 8},
    "100m": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 3072, "heads": 12},
}


def build_model(size: str, out_dir: Path, max_positions: int) -> Path:
    """A random checkpoint of ``size`` with the tiny tokenizer that never ends a sample early (module docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = out_dir / f"random_{size}"
    if (path / "config.json").exists():
        return path
    shape = SIZES[size]
    config = AutoConfig.from_pretrained(MODEL)
    config.hidden_size = shape["hidden_size"]
    config.num_hidden_layers = shape["num_hidden_layers"]
    config.intermediate_size = shape["intermediate_size"]
    config.num_attention_heads = shape["heads"]
    config.num_key_value_heads = shape["heads"] // 2
    config.layer_types = ["full_attention"] * shape["num_hidden_layers"]
    config.max_position_embeddings = max_positions
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
        model.lm_head.weight[config.eos_token_id].zero_()
    model.save_pretrained(path)
    # The tokenizer's own files, as they are (a save through transformers rewrites them).
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(MODEL / name, path / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"built {path.name}: {params / 1e6:.1f}M parameters")
    return path


def _row(axis_value: str, report: dict[str, Any]) -> str:
    median = report["median_step_s"]
    phases = report["phases_median_s"]

    def share(side: str, *names: str) -> str:
        return "/".join(f"{phases[side].get(name, 0.0) / median[side]:.0%}" for name in names)

    tokens = report["gen_tokens_per_sample"]
    return (
        f"| {axis_value} | {median['trl']:.3f} | {median['ours']:.3f} | {report['ratio']:.2f} | "
        f"{share('trl', 'generation', 'training')} | {share('ours', 'generation', 'policy_training')} | "
        f"{tokens['trl']:.0f} / {tokens['ours']:.0f} |"
    )


def main() -> None:
    """Parse the arguments, build the checkpoints, run both axes and print their tables."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trl-python", default="/work/trl_venv/bin/python")
    parser.add_argument("--models", nargs="*", default=["tiny", "25m", "100m"], choices=sorted(SIZES))
    parser.add_argument("--model-shape", default="16x32", help="samples x new tokens, model axis")
    parser.add_argument("--lengths", nargs="*", type=int, default=[32, 128, 512, 1024])
    parser.add_argument("--length-samples", type=int, default=16, help="samples per step, sequence axis")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--work-dir", type=Path)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    check_trl_bytecode(args.trl_python)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_grpo_scaling_"))
    max_positions = 128 + max([*args.lengths, 32])
    model_shape, length_samples = args.model_shape, args.length_samples

    def pair(model: Path, shape: str) -> dict[str, Any]:
        return run_pair(shape, args.threads, args.steps, args.warmup, args.trl_python, work, model=model)

    by_model = [(size, pair(build_model(size, work, max_positions), model_shape)) for size in args.models]
    tiny = build_model("tiny", work, max_positions)
    by_length = [(n, pair(tiny, f"{length_samples}x{n}")) for n in args.lengths]

    header = (
        "| {axis} | TRL step s | nemo_rl step s | ratio | TRL generation/training | "
        "nemo_rl generation/training | tokens per sample TRL / nemo_rl |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    print(f"\n== model size ({model_shape} samples x new tokens, {args.threads} thread(s))")
    print(header.format(axis="model"))
    for size, report in by_model:
        print(_row(size, report))
    print(f"\n== new tokens per sample (tiny shape, {length_samples} samples, {args.threads} thread(s))")
    print(header.format(axis="new tokens"))
    for length, report in by_length:
        print(_row(str(length), report))
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"models": by_model, "lengths": by_length}, indent=2))


if __name__ == "__main__":
    main()
