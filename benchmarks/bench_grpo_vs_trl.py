"""A GRPO step of this project against TRL's ``GRPOTrainer`` on identical work, side by side in one invocation.

Both sides train the committed ``examples/assets/tiny_math_sft`` checkpoint on the same arithmetic prompts of
the bundled ``tiny_math`` data, taken in order (no shuffling), with the same settings: ``P`` prompts x ``G``
samples per step, at most ``N`` new tokens, temperature 1, no top-k / top-p, AdamW lr 1e-5 constant, no KL
term, rewards scaled by the group's standard deviation, token-level (DAPO) loss averaging, one optimizer
step per batch, fp32 on CPU. Shapes: ``64x32`` (8 prompts x 8 samples, 32 new tokens) and ``512x24``
(32 x 16, 24 new tokens, the README main job's batch). Threads: ``1`` runs TRL on one torch thread and this
project with one policy worker (DP=1); ``2`` runs TRL on two torch threads and this project with DP=2 (two
CPU worker slots of one thread each), or with ``--ours-layout threads`` one worker on two torch threads
(``NEMO_RL_TORCH_THREADS``): the same two cores, used by intra-op threads instead of data parallelism.

TRL lives in its own virtual environment (its dependencies need not agree with this project's lock)::

    uv venv /work/trl_venv --python 3.11
    # The CPU torch wheel where download.pytorch.org is reachable, else the same torch from PyPI:
    uv pip install --python /work/trl_venv/bin/python torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    uv pip install --python /work/trl_venv/bin/python "trl==1.16.0" "transformers>=5,<6" math-verify datasets

Then, from the repository root::

    uv run python benchmarks/bench_grpo_vs_trl.py --trl-python /work/trl_venv/bin/python \\
        [--shapes 64x32 512x24] [--threads 1 2] [--steps 8] [--warmup 2] [--rounds 1] [--json-out results.json]

For each shape and thread count, TRL runs first and this project second (``examples/run_grpo_math.py`` in a
subprocess, the path a user takes; with ``--rounds``, odd rounds run this project first); each side takes ``--warmup`` steps that are not timed and then
``--steps`` timed ones. Printed: the median step time of each side, the ratio (this project / TRL), each
side's median phase breakdown, the time from process start to the end of the first step and to the process's
exit, the CPU seconds of every process each side started (polled from /proc: on a busy machine the number to
compare), and the agreement checks: the same prompt token ids on both sides, the mean generated tokens per sample, and the
reward over the first and second half of the steps (with its standard error). With ``--rounds R`` every
comparison runs R times (both sides back to back each time, the order alternating between rounds) and a summary lists each round's
ratio and first-step time with their median and worst: on a small machine two-thread step times move by a
third between back-to-back runs, so one round's ratio says little about how reliably a target is met.

Phases. TRL: ``generation`` (``_generate``, transformers' ``generate()``), ``reward`` (the reward function),
``rollout_other`` (the rest of ``_generate_and_score_completions``: tokenizing, advantages, any log-prob
pass), ``training`` (forward, backward and optimizer step). This project: the ``timing/train/*`` metrics
(``refit``, ``generation``, ``reward``, ``logprobs``, ``policy_training``) and ``other`` (the step's
remaining time: Ray calls, building the batch, bookkeeping).

Timings on a shared machine are noisy: the two sides run one after the other, so measure on an idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "assets" / "tiny_math_sft"
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
SCRIPT = ROOT / "examples" / "run_grpo_math.py"
LEARNING_RATE = 1e-5
SEED = 0
MAX_SEQ_LEN = 80
OUR_PHASES = ("refit", "generation", "reward", "logprobs", "policy_training")
TRL_PHASES = ("generation", "reward", "rollout_other", "training")


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_by_process(root: int) -> dict[int, tuple[float, str]]:
    """CPU seconds and command line of ``root`` and every process below it."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
            cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    family, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in family and pid not in family:
                family.add(pid)
                grew = True
    found = {}
    for pid in family & cpu.keys():
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
            found[pid] = (cpu[pid], command or Path(f"/proc/{pid}/comm").read_text().strip())
    return found


class TreeCpu:
    """The CPU seconds of a process and of every process it starts, polled from /proc (the last value seen of
    each: a process that ends between two polls loses at most one interval's CPU)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, float] = {}
        self._next_poll_s = 0.0

    def poll(self, every_s: float = 0.25) -> None:
        """Read the tree's CPU times, at most once per ``every_s``."""
        if time.monotonic() < self._next_poll_s:
            return
        self._next_poll_s = time.monotonic() + every_s
        self.seen.update({pid: cpu_s for pid, (cpu_s, _) in cpu_by_process(self.root).items()})

    def summary(self) -> dict[str, float]:
        """``{"cpu_s": total CPU seconds, "processes": how many processes were seen}``."""
        return {"cpu_s": sum(self.seen.values()), "processes": len(self.seen)}


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"64x32"`` -> (prompts, samples per prompt, new tokens): 64 samples as 8 x 8; ``512x24`` as 32 x 16."""
    samples, _, tokens = text.partition("x")
    num_samples = int(samples)
    group = 8 if num_samples <= 64 else 16
    if num_samples % group:
        raise SystemExit(f"--shapes {text}: the number of samples must be a multiple of {group}")
    return num_samples // group, group, int(tokens)


# --------------------------------------------------------------------------------------------- TRL side
def _trl_side(spec: dict[str, Any]) -> dict[str, Any]:
    """Run TRL's GRPOTrainer per ``spec`` (in the TRL venv); returns per-step times, phases and checks."""
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    import trl
    from math_verify import parse, verify
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

    prompts = spec["prompts"]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model"])
    for row in prompts:  # the agreement check: TRL tokenizes the prompt text into this project's ids
        ids = tokenizer(text=row["text"])["input_ids"]
        if ids != row["ids"]:
            raise SystemExit(f"TRL tokenizes {row['text']!r} as {ids}, this project as {row['ids']}")
    dataset = datasets.Dataset.from_list(
        [{"prompt": r["text"], "ground_truth": r["answer"]} for r in prompts]
    )

    phases: dict[str, list[float]] = {name: [] for name in (*TRL_PHASES, "rollout")}
    rollouts: list[dict[str, Any]] = []

    def score(answer_text: str, truth: str) -> float:
        start = answer_text.rfind("\\boxed{")
        end = answer_text.find("}", start)
        if start < 0 or end < 0:
            return 0.0
        answer = answer_text[start + len("\\boxed{") : end].strip()
        if answer == truth:
            return 1.0
        gold, guess = parse(f"\\boxed{{{truth}}}"), parse(f"\\boxed{{{answer}}}")
        return float(bool(gold and guess and verify(gold, guess)))

    def reward_fn(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any
    ) -> list[float]:
        rewards = [score(c, t) for c, t in zip(completions, kw["ground_truth"], strict=True)]
        rollouts.append(
            {
                "prompts": list(dict.fromkeys(prompts)),
                "reward": sum(rewards) / len(rewards),
                "gen_tokens": sum(len(c) for c in completion_ids) / len(completion_ids),
            }
        )
        return rewards

    def timed(cls: Any, method: str, label: str) -> None:
        original = getattr(cls, method)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                phases[label].append(time.perf_counter() - start)

        setattr(cls, method, wrapper)

    timed(trl.GRPOTrainer, "_generate", "generation")
    timed(trl.GRPOTrainer, "_calculate_rewards", "reward")
    timed(trl.GRPOTrainer, "_generate_and_score_completions", "rollout")
    begins: list[float] = []
    ends: list[float] = []

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            begins.append(time.time())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.time())

    num_samples = spec["num_prompts"] * spec["group"]
    args = trl.GRPOConfig(
        output_dir=spec["out_dir"],
        per_device_train_batch_size=num_samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=spec["group"],
        max_completion_length=spec["new_tokens"],
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=spec["num_steps"],
        shuffle_dataset=False,
        seed=SEED,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward_fn,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    step_s = [b - a for a, b in zip(begins, [*begins[1:], ends[-1]], strict=True)]
    train_s = [e - b - r for b, e, r in zip(begins, ends, phases["rollout"], strict=True)]
    rollout_other = [
        r - g - w for r, g, w in zip(phases["rollout"], phases["generation"], phases["reward"], strict=True)
    ]
    return {
        "step_s": step_s,
        "first_step_end": ends[0],
        "phases": {
            "generation": phases["generation"],
            "reward": phases["reward"],
            "rollout_other": rollout_other,
            "training": train_s,
        },
        "rollouts": rollouts,
    }


# -------------------------------------------------------------------------------------- this project's side
def _our_prompts(num_rows: int) -> list[dict[str, Any]]:
    """The first ``num_rows`` prompts of the tiny math training split, as this project tokenizes them."""
    from nemo_rl.config.loader import load_and_validate
    from nemo_rl.config.master import GRPOMasterConfig
    from nemo_rl.data.datasets import setup_rl_data
    from nemo_rl.models.tokenizer import get_policy_tokenizer

    config = load_and_validate(CONFIG, GRPOMasterConfig, [f"policy.max_total_sequence_length={MAX_SEQ_LEN}"])
    tokenizer = get_policy_tokenizer(config.policy)
    train, _ = setup_rl_data(config.data, tokenizer, max_total_sequence_length=MAX_SEQ_LEN)
    rows = []
    for i in range(num_rows):
        datum = train[i]
        info = datum["extra_env_info"]
        assert info is not None
        rows.append(
            {
                "text": "".join(m["content"] for m in datum["message_log"]),
                "ids": [int(t) for m in datum["message_log"] for t in m["token_ids"]],
                "answer": str(info["ground_truth"]),
            }
        )
    return rows


def grpo_overrides(
    num_prompts: int, group: int, new_tokens: int, threads: int, num_steps: int, log_dir: Path
) -> list[str]:
    """The overrides of ``grpo_math_tiny.yaml`` that make this project's run the compared work."""
    num_samples = num_prompts * group
    return [
        f"grpo.num_prompts_per_step={num_prompts}",
        f"grpo.num_generations_per_prompt={group}",
        f"grpo.max_num_steps={num_steps}",
        f"grpo.seed={SEED}",
        "grpo.val_period=0",
        "grpo.val_at_start=false",
        "data.shuffle=false",
        f"policy.max_total_sequence_length={MAX_SEQ_LEN}",
        f"policy.generation.max_new_tokens={new_tokens}",
        f"policy.train_global_batch_size={num_samples}",
        f"policy.train_micro_batch_size={num_samples // threads}",
        f"policy.logprob_batch_size={num_samples // threads}",
        f"policy.optimizer.kwargs.lr={LEARNING_RATE}",
        "policy.scheduler.0.kwargs.start_factor=1.0",
        f"cluster.gpus_per_node={threads}",
        "checkpointing.enabled=false",
        f"logger.log_dir={log_dir}",
        "logger.console_enabled=false",
        "logger.progress_bar=false",
        "logger.monitor_gpus=false",
        "logger.plot_metrics=[]",
    ]


def run_our_side(
    num_prompts: int,
    group: int,
    new_tokens: int,
    threads: int,
    num_steps: int,
    out_dir: Path,
    extra_overrides: tuple[str, ...] = (),
    torch_threads: int = 1,
) -> dict[str, Any]:
    """``examples/run_grpo_math.py`` on the same work (plus ``extra_overrides``; each worker on
    ``torch_threads`` torch threads); per-step metrics from its ``metrics.jsonl``."""
    log_dir = out_dir / "logs"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--config",
        str(CONFIG),
        *grpo_overrides(num_prompts, group, new_tokens, threads, num_steps, log_dir),
        *extra_overrides,
    ]
    metrics_file = log_dir / "metrics.jsonl"
    start = time.time()
    first_step_end: float | None = None
    with open(out_dir / "run.log", "w") as log:
        env = {**os.environ, "NEMO_RL_TORCH_THREADS": str(torch_threads)}
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        tree = TreeCpu(proc.pid)
        while proc.poll() is None:
            if first_step_end is None and metrics_file.exists() and '"step": 1' in metrics_file.read_text():
                first_step_end = time.time()
            tree.poll()
            time.sleep(0.05)
    exit_end = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"this project's run failed (exit {proc.returncode}); see {out_dir / 'run.log'}")
    by_step: dict[int, dict[str, float]] = {}
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    steps = [by_step[s] for s in sorted(by_step) if s >= 1]
    totals = [m["timing/train/total_step_time"] for m in steps]
    phases = {p: [m.get(f"timing/train/{p}", 0.0) for m in steps] for p in OUR_PHASES}
    phases["other"] = [t - sum(phases[p][i] for p in OUR_PHASES) for i, t in enumerate(totals)]
    return {
        "step_s": totals,
        "first_step_end": first_step_end if first_step_end is not None else start,
        "start": start,
        "exit_end": exit_end,
        "cpu": tree.summary(),
        "phases": phases,
        "rollouts": [
            {"reward": m["train/reward"], "gen_tokens": m["train/mean_gen_tokens_per_sample"]} for m in steps
        ],
    }


# ------------------------------------------------------------------------------------------------ report
def _halves(values: list[float], samples_per_step: int) -> str:
    """Mean of the first and second half of ``values`` (per-step mean rewards), each with its standard error
    (one mean for a single step)."""
    half = max(1, len(values) // 2)
    parts = []
    # One step (a start-up comparison) has no second half.
    for chunk in [c for c in (values[:half], values[half:]) if c]:
        mean = sum(chunk) / len(chunk)
        se = (mean * (1 - mean) / (len(chunk) * samples_per_step)) ** 0.5
        parts.append(f"{mean:.3f}±{se:.3f}")
    return " -> ".join(parts)


def _median_phases(phases: dict[str, list[float]], warmup: int) -> str:
    return ", ".join(
        f"{name} {statistics.median(v[warmup:]):.3f}" for name, v in phases.items() if v[warmup:]
    )


def run_pair(
    shape: str,
    threads: int,
    steps: int,
    warmup: int,
    trl_python: str,
    work: Path,
    layout: str = "dp",
    round_index: int = 0,
    model: Path = MODEL,
) -> dict[str, Any]:
    """Run TRL and this project back to back on one shape and thread count (this project first in odd
    rounds) with ``model`` (a checkpoint with the tiny model's tokenizer); print and return the comparison."""
    num_prompts, group, new_tokens = parse_shape(shape)
    num_steps = warmup + steps
    prompts = _our_prompts(num_prompts * num_steps)
    max_seq_len = max(MAX_SEQ_LEN, MAX_SEQ_LEN - 32 + new_tokens)
    model_overrides = (f"policy.model_name={model}", f"policy.max_total_sequence_length={max_seq_len}")
    case_dir = work / f"{model.name}_{shape}_t{threads}" / f"round{round_index}"
    (case_dir / "trl").mkdir(parents=True, exist_ok=True)
    (case_dir / "ours").mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "prompts": prompts,
        "num_prompts": num_prompts,
        "group": group,
        "new_tokens": new_tokens,
        "threads": threads,
        "num_steps": num_steps,
        "out_dir": str(case_dir / "trl"),
    }
    spec_file = case_dir / "trl_spec.json"
    spec_file.write_text(json.dumps(spec))
    result_file = case_dir / "trl_result.json"

    def run_trl() -> dict[str, Any]:
        start = time.time()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        with open(case_dir / "trl" / "run.log", "w") as log:
            proc = subprocess.Popen(
                [trl_python, __file__, "--side", str(spec_file), str(result_file)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            tree = TreeCpu(proc.pid)
            while proc.poll() is None:
                tree.poll()
                time.sleep(0.05)
        exit_end = time.time()
        if proc.returncode != 0:
            raise SystemExit(
                f"the TRL side failed (exit {proc.returncode}); see {case_dir / 'trl' / 'run.log'}"
            )
        result: dict[str, Any] = json.loads(result_file.read_text())
        result["start"] = start
        result["exit_end"] = exit_end
        result["cpu"] = tree.summary()
        return result

    def run_ours() -> dict[str, Any]:
        dp, torch_threads = (1, threads) if layout == "threads" else (threads, 1)
        return run_our_side(
            num_prompts,
            group,
            new_tokens,
            dp,
            num_steps,
            case_dir / "ours",
            extra_overrides=model_overrides,
            torch_threads=torch_threads,
        )

    # Odd rounds run this project first: a machine whose speed drifts over a minute (a burst after idle, a
    # neighbour starting) then favours neither side systematically across rounds.
    ours_first = round_index % 2 == 1
    if ours_first:
        ours = run_ours()
        trl_result = run_trl()
    else:
        trl_result = run_trl()
        ours = run_ours()

    # Agreement: TRL saw the prompts this project's loader yields, step by step, in order.
    expected = [
        [r["text"] for r in prompts[s * num_prompts : (s + 1) * num_prompts]] for s in range(num_steps)
    ]
    seen = [r["prompts"] for r in trl_result["rollouts"]]
    same_prompts = seen == expected
    samples = num_prompts * group
    median = {
        name: statistics.median(side["step_s"][warmup:])
        for name, side in (("trl", trl_result), ("ours", ours))
    }
    report = {
        "model": model.name,
        "shape": shape,
        "threads": threads,
        "round": round_index,
        "first_side": "nemo_rl" if ours_first else "trl",
        "ours_layout": f"DP=1, {threads} torch threads"
        if layout == "threads"
        else f"DP={threads}, 1 thread each",
        "median_step_s": median,
        "ratio": median["ours"] / median["trl"],
        "time_to_first_step_s": {
            name: side["first_step_end"] - side["start"]
            for name, side in (("trl", trl_result), ("ours", ours))
        },
        "time_to_exit_s": {
            name: side["exit_end"] - side["start"] for name, side in (("trl", trl_result), ("ours", ours))
        },
        "cpu_start_to_exit": {name: side["cpu"] for name, side in (("trl", trl_result), ("ours", ours))},
        "phases_median_s": {
            name: {p: statistics.median(v[warmup:]) for p, v in side["phases"].items()}
            for name, side in (("trl", trl_result), ("ours", ours))
        },
        "same_prompts": same_prompts,
        "gen_tokens_per_sample": {
            name: sum(r["gen_tokens"] for r in side["rollouts"]) / len(side["rollouts"])
            for name, side in (("trl", trl_result), ("ours", ours))
        },
        "rewards": {
            name: [r["reward"] for r in side["rollouts"]]
            for name, side in (("trl", trl_result), ("ours", ours))
        },
    }
    print(
        f"\n== {shape} ({num_prompts} prompts x {group} samples, {new_tokens} new tokens), {threads} thread(s); "
        f"nemo_rl {report['ours_layout']}; round {round_index + 1} ({report['first_side']} first)"
    )
    print(
        f"median step: TRL {median['trl']:.3f} s, nemo_rl {median['ours']:.3f} s, "
        f"ratio nemo_rl / TRL {report['ratio']:.2f}"
    )
    first = report["time_to_first_step_s"]
    to_exit = report["time_to_exit_s"]
    print(
        f"time to the end of the first step: TRL {first['trl']:.1f} s, nemo_rl {first['ours']:.1f} s; "
        f"to the process's exit: TRL {to_exit['trl']:.1f} s, nemo_rl {to_exit['ours']:.1f} s"
    )
    cpu = report["cpu_start_to_exit"]
    print(
        f"CPU seconds from start to exit, every process: TRL {cpu['trl']['cpu_s']:.1f} s "
        f"({cpu['trl']['processes']:.0f} processes), nemo_rl {cpu['ours']['cpu_s']:.1f} s "
        f"({cpu['ours']['processes']:.0f} processes)"
    )
    print(f"  TRL phases (median s): {_median_phases(trl_result['phases'], warmup)}")
    print(f"  nemo_rl phases (median s): {_median_phases(ours['phases'], warmup)}")
    tokens = report["gen_tokens_per_sample"]
    print(
        f"agreement: same prompts in the same order: {'yes' if same_prompts else 'NO'}; generated tokens per "
        f"sample TRL {tokens['trl']:.1f}, nemo_rl {tokens['ours']:.1f}; reward (first half -> second half) "
        f"TRL {_halves(report['rewards']['trl'], samples)}, nemo_rl {_halves(report['rewards']['ours'], samples)}"
    )
    return report


def print_round_summary(reports: list[dict[str, Any]]) -> None:
    """Print, per shape and thread count, every round's ratio and first-step time with their median and worst,
    and every round's time to the processes' exit.

    Each round is its own like-for-like comparison (TRL, then this project, back to back), so a ratio is never
    taken between sides measured in different rounds; the summary shows how much the ratio moves between
    rounds, which on a small shared machine is often more than the difference being measured.
    """
    print("\n== rounds (each ratio from one back-to-back run of both sides)")
    cases: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for report in reports:
        cases.setdefault((report["shape"], report["threads"]), []).append(report)
    for (shape, threads), rounds in cases.items():
        ratios = [r["ratio"] for r in rounds]
        ours_first = [r["time_to_first_step_s"]["ours"] for r in rounds]
        trl_first = [r["time_to_first_step_s"]["trl"] for r in rounds]
        ours_exit = [r["time_to_exit_s"]["ours"] for r in rounds]
        trl_exit = [r["time_to_exit_s"]["trl"] for r in rounds]
        print(
            f"{shape}, {threads} thread(s), nemo_rl {rounds[0]['ours_layout']}: ratio per round "
            f"{' '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}, "
            f"worst {max(ratios):.2f}); first step nemo_rl {' '.join(f'{x:.1f}' for x in ours_first)} s "
            f"(worst {max(ours_first):.1f}), TRL {' '.join(f'{x:.1f}' for x in trl_first)} s; exit nemo_rl "
            f"{' '.join(f'{x:.1f}' for x in ours_exit)} s, TRL {' '.join(f'{x:.1f}' for x in trl_exit)} s"
        )


def check_trl_bytecode(trl_python: str) -> None:
    """Stop unless TRL's venv has its bytecode compiled: where ``PYTHONDONTWRITEBYTECODE`` is set (as on this
    machine) an uncompiled venv recompiles torch, transformers and TRL at every start, which slows TRL's start by
    seconds and would flatter this project's (whose environment ``uv`` compiles, see the README)."""
    probe = (
        "import importlib.util, os; spec = importlib.util.find_spec('trl'); "
        "print(os.path.exists(importlib.util.cache_from_source(spec.origin)))"
    )
    cached = subprocess.run([trl_python, "-c", probe], capture_output=True, text=True, check=True).stdout
    if cached.strip() != "True":
        raise SystemExit(
            f"TRL's venv ({trl_python}) has no compiled bytecode: compile it first "
            f"({trl_python} -m compileall -q -j 0 <its site-packages>), else TRL's start is measured with "
            "compilation in it"
        )


def main() -> None:
    """Parse the arguments and run every shape x thread count."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--side", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--shapes", nargs="+", default=["64x32", "512x24"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side before them")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each comparison (TRL, then this project) this many times and summarise every round's ratio",
    )
    parser.add_argument(
        "--ours-layout",
        choices=("dp", "threads"),
        default="dp",
        help="this project's use of N threads: DP=N workers of one thread (dp) or one worker of N (threads)",
    )
    parser.add_argument(
        "--trl-python",
        default=os.environ.get("TRL_PYTHON", "/work/trl_venv/bin/python"),
        help="the Python of the venv TRL is installed in (or $TRL_PYTHON)",
    )
    parser.add_argument(
        "--work-dir", type=Path, help="where both sides write their logs (default: a new temp dir)"
    )
    parser.add_argument("--json-out", type=Path, help="also write every comparison to this JSON file")
    args, side_args = parser.parse_known_args()
    if args.side is not None and side_args == [] and len(args.side) == 2:
        spec = json.loads(Path(args.side[0]).read_text())
        Path(args.side[1]).write_text(json.dumps(_trl_side(spec)))
        return
    if not Path(args.trl_python).exists():
        raise SystemExit(f"--trl-python {args.trl_python} does not exist; create the TRL venv (see --help)")
    check_trl_bytecode(args.trl_python)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_grpo_vs_trl_"))
    print(f"logs of both sides under {work}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give at least 1")
    reports = []
    for shape in args.shapes:
        for threads in args.threads:
            for round_index in range(args.rounds):
                reports.append(
                    run_pair(
                        shape,
                        threads,
                        args.steps,
                        args.warmup,
                        args.trl_python,
                        work,
                        args.ours_layout,
                        round_index,
                    )
                )
    if args.rounds > 1:
        print_round_summary(reports)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(reports, indent=2))
    if not all(r["same_prompts"] for r in reports):
        raise SystemExit("the two sides did not see the same prompts: the comparison is not like for like")


if __name__ == "__main__":
    main()
