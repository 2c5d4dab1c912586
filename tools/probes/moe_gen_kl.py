"""Does a mixture-of-experts model's sampler disagree with its policy more than a dense model's?

Runs a few GRPO steps (``examples/run_grpo_math.py`` on ``grpo_math_tiny.yaml``, each run a subprocess with
Ray) on tiny models with the embedded engine in workers of its own at a lower precision than the float32
policy (``--precision``, default bfloat16; the refit casts the weights), for several seeds, and prints
``train/gen_kl_error`` (the k3 estimate of KL(sampler || policy) per sampled token) and
``train/token_mult_prob_error`` for every step, then per model the mean and the largest over all steps and
seeds. A router that picks another expert for a token in bfloat16 than in float32 shows up as a larger
``gen_kl_error`` than the dense model's::

    python tools/probes/moe_gen_kl.py --models dense qwen3_moe glm4_moe --seeds 1 2 3 --steps 4

``--router-replay`` runs each MoE model a second time with ``policy.router_replay.enabled=true`` (the policy's
forwards replay the experts the sampler chose) and reports both. Extra ``key=value`` overrides after ``--``
go to every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "dense": "examples/assets/tiny_qwen2_init",
    "qwen3_moe": "examples/assets/tiny_qwen3_moe_init",
    "glm4_moe": "examples/assets/tiny_glm4_moe_init",
}
"""The tiny randomly initialised checkpoints compared: hidden size 128, the same tokenizer."""
METRICS = ("train/gen_kl_error", "train/token_mult_prob_error")


def run_grpo(
    model: str, seed: int, steps: int, precision: str, extra: list[str], work: Path
) -> dict[int, Any]:
    """The logged metrics by step of one GRPO run."""
    log_dir = work / "logs"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo_math.py"),
        "--config",
        str(ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"),
        f"policy.model_name={MODELS[model]}",
        f"grpo.seed={seed}",
        f"grpo.max_num_steps={steps}",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "policy.generation.embedded_cfg.in_policy_workers=false",
        f"policy.generation.embedded_cfg.precision={precision}",
        "checkpointing.enabled=false",
        f"checkpointing.checkpoint_dir={work / 'ckpt'}",
        f"logger.log_dir={log_dir}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
        *extra,
    ]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{model} seed {seed} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    by_step: dict[int, Any] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    return by_step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--precision", default="bfloat16", help="the engine's dtype (the policy's is float32)"
    )
    parser.add_argument(
        "--router-replay",
        action="store_true",
        help="also run every MoE model with policy.router_replay.enabled=true",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run (after --)")
    args = parser.parse_args()
    summary: dict[str, list[float]] = {}
    for model in args.models:
        replays = [False, True] if args.router_replay and model != "dense" else [False]
        for replay, seed in ((r, s) for r in replays for s in args.seeds):
            name = f"{model}+replay" if replay else model
            extra = [*args.overrides, *(["policy.router_replay.enabled=true"] if replay else [])]
            with tempfile.TemporaryDirectory(prefix="moe_gen_kl_") as work:
                metrics = run_grpo(model, seed, args.steps, args.precision, extra, Path(work))
            for step in sorted(metrics):
                if METRICS[0] not in metrics[step]:
                    continue
                values = [metrics[step][metric] for metric in METRICS]
                summary.setdefault(name, []).append(values[0])
                print(
                    f"{name:<17} seed {seed} step {step}: gen_kl_error {values[0]:.3e}  "
                    f"token_mult_prob_error {values[1]:.5f}",
                    flush=True,
                )
    print(f"{'model':<17}{'steps':>7}{'mean gen_kl_error':>20}{'max':>12}")
    for name, values in summary.items():
        print(f"{name:<17}{len(values):>7}{statistics.fmean(values):>20.3e}{max(values):>12.3e}")


if __name__ == "__main__":
    main()
