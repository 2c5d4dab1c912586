"""GRPO with the embedded engine in separate generation workers against the engine in the policy workers.

Runs this project's side of ``bench_grpo_vs_trl.py`` (the same work: ``grpo_math_tiny.yaml`` with its
overrides, ``examples/run_grpo_math.py`` in a subprocess) with
``policy.generation.embedded_cfg.in_policy_workers=false`` and ``=true`` in turn, ``--rounds`` times each,
alternating so both see the same machine load, and prints for each: the median step time, its median
phases (``refit`` is ``timing/train/refit``: the copy with the policy's offload calls around it) and the time
from process start to the end of the first step; then the ratio of the median steps (in policy /
separate)::

    uv run python benchmarks/bench_in_policy_generation.py [--shapes 64x32] [--threads 1 2] \\
        [--steps 8] [--warmup 2] [--rounds 2]

Timings on a shared machine are noisy: quote the ratios of one run, with its load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grpo_vs_trl import parse_shape, run_our_side

KEY = "policy.generation.embedded_cfg.in_policy_workers"


def _summary(result: dict[str, Any], warmup: int) -> tuple[float, str]:
    """The median step time and a one-line report of one run."""
    phases: dict[str, list[float]] = result["phases"]
    first_s = result["first_step_end"] - result["start"]
    step_s = statistics.median(result["step_s"][warmup:])
    text = f"median step {step_s:.3f} s, first step ends {first_s:.1f} s, " + ", ".join(
        f"{name} {statistics.median(values[warmup:]):.4f}" for name, values in phases.items()
    )
    return step_s, text


def main() -> None:
    """Parse the arguments and run every shape x thread count, both ways, ``--rounds`` times."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["64x32"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run before them")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_in_policy_"))
    print(f"logs under {work}; load average at start {os.getloadavg()[0]:.1f}")
    for shape in args.shapes:
        num_prompts, group, new_tokens = parse_shape(shape)
        for threads in args.threads:
            medians: dict[bool, list[float]] = {False: [], True: []}
            for run in range(args.rounds):
                for in_policy in (False, True):
                    out = work / f"{shape}_t{threads}_{in_policy}_{run}"
                    out.mkdir(parents=True)
                    result = run_our_side(
                        num_prompts,
                        group,
                        new_tokens,
                        threads,
                        args.warmup + args.steps,
                        out,
                        (f"{KEY}={str(in_policy).lower()}",),
                    )
                    step_s, text = _summary(result, args.warmup)
                    medians[in_policy].append(step_s)
                    where = "in policy workers" if in_policy else "separate workers"
                    print(f"{shape} DP={threads}, {where}: {text}", flush=True)
            ratio = statistics.median(medians[True]) / statistics.median(medians[False])
            print(
                f"{shape} DP={threads}: median step in policy / separate = {ratio:.2f} "
                f"(load average now {os.getloadavg()[0]:.1f})",
                flush=True,
            )


if __name__ == "__main__":
    main()
