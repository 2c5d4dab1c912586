"""Where the embedded engine's ``generate()`` spends its time on the GRPO bench's real work, in one process.

The work of ``bench_grpo_vs_trl.py``: the committed ``examples/assets/tiny_math_sft`` (hidden 128, 4 layers,
vocabulary 104), the first prompts of the bundled tiny math training split as this project tokenizes them,
each repeated ``G`` times, T=1, EOS stops, the bench's sequence limit. For every shape and torch thread count
it times whole ``generate()`` calls (median of ``--repeats`` after a warm-up) and the hosted replica's call
(``EmbeddedReplica.generate``: the engine plus building the rollout batch), and with ``--profile`` counts the
torch ops of one call with ``torch.profiler`` (ops per decode step and per layer, time by op).

    uv run python tools/probes/profile_engine.py [--shapes 64x32 512x24] [--threads 1 2] [--repeats 20] [--profile]

``--compare-ref REF`` also times the engine of git revision ``REF`` (its ``engine.py`` and ``model.py``
loaded from ``git show``) in alternation with the working tree's on the same prompts and seeds, prints the
ratio of the medians and whether the sampled tokens are identical.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
# The GRPO bench's work (prompts, config, shapes) comes from benchmarks/bench_grpo_vs_trl.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_grpo_vs_trl import CONFIG, MAX_SEQ_LEN, _our_prompts, parse_shape  # noqa: E402

from nemo_rl.models.generation.embedded import engine as engine_mod  # noqa: E402
from nemo_rl.models.generation.embedded import model as model_mod  # noqa: E402

CHECKPOINT = ROOT / "examples" / "assets" / "tiny_math_sft"


def _prompt_batch(num_prompts: int, group: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids ``[P * G, T]`` of the first ``num_prompts`` prompts, each repeated ``group`` times."""
    rows = [r["ids"] for r in _our_prompts(num_prompts) for _ in range(group)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    return ids, torch.tensor([len(r) for r in rows])


def _load_revision(ref: str) -> tuple[ModuleType, ModuleType]:
    """``model.py`` and ``engine.py`` of git revision ``ref`` as stand-alone modules (engine bound to that model)."""
    tmp = Path(tempfile.mkdtemp(prefix="engine_ref_"))
    mods = []
    for name in ("model", "engine"):
        src = subprocess.run(
            ["git", "show", f"{ref}:nemo_rl/models/generation/embedded/{name}.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        src = src.replace("from nemo_rl.models.generation.embedded.model import", "from ref_model import")
        (tmp / f"ref_{name}.py").write_text(src)
    sys.path.insert(0, str(tmp))
    for name in ("model", "engine"):
        spec = importlib.util.spec_from_file_location(f"ref_{name}", tmp / f"ref_{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"ref_{name}"] = module
        spec.loader.exec_module(module)
        mods.append(module)
    return mods[0], mods[1]


def _engine(model_module: ModuleType, engine_module: ModuleType, pad_id: int) -> Any:
    model = model_module.DecoderLM.from_pretrained(CHECKPOINT, dtype=torch.float32)
    return engine_module.EmbeddedEngine(
        model, pad_token_id=pad_id, max_sequence_length=MAX_SEQ_LEN, decode_fn=None
    )


def _params(engine_module: ModuleType, new_tokens: int, eos: list[int]) -> Any:
    return engine_module.SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        max_new_tokens=new_tokens,
        stop_token_ids=frozenset(eos),
        stop_strings=(),
    )


def _time_calls(fn: Any, repeats: int, cpu: list[float] | None = None) -> list[float]:
    """Wall seconds of ``repeats`` calls ``fn(i)``; their CPU seconds (all threads) appended to ``cpu``."""
    times = []
    for i in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(i)
        times.append(time.perf_counter() - start)
        if cpu is not None:
            cpu.append(time.process_time() - start_cpu)
    return times


def _profile(engine: Any, ids: torch.Tensor, lengths: torch.Tensor, params: Any, num_layers: int) -> None:
    """Op counts of one call by name, per decode step and per layer, and the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    out = engine.generate(ids, lengths, params, greedy=False, seed=1)
    num_steps = int(out.generation_lengths.max())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate(ids, lengths, params, greedy=False, seed=1)
    events = [e for e in prof.events() if e.cpu_parent is None]
    counts = Counter(e.name for e in events)
    total = sum(counts.values())
    print(f"  top-level ops in one call: {total} over {num_steps} decode steps (+ prefill): ")
    print("   " + ", ".join(f"{n} {c}" for n, c in counts.most_common(30)))
    print(
        f"   ~{total / max(num_steps, 1):.0f} ops per step, ~{total / max(num_steps, 1) / num_layers:.1f} per layer"
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def _compare(
    shape: str, threads: int, ours: Any, ref: Any, ref_mod: ModuleType, eos: list[int], repeats: int
) -> None:
    """Alternate the working tree's engine with the reference revision's on the same prompts and seeds."""
    num_prompts, group, new_tokens = parse_shape(shape)
    ids, lengths = _prompt_batch(num_prompts, group, ours.pad_token_id)
    params, ref_params = _params(engine_mod, new_tokens, eos), _params(ref_mod, new_tokens, eos)
    ours.generate(ids, lengths, params, greedy=False, seed=0)
    ref.generate(ids, lengths, ref_params, greedy=False, seed=0)
    wall: dict[str, list[float]] = {"old": [], "new": []}
    cpu: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(repeats):
        for name, engine, p in (("old", ref, ref_params), ("new", ours, params)):
            start, start_cpu = time.perf_counter(), time.process_time()
            engine.generate(ids, lengths, p, greedy=False, seed=i)
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    same = all(
        torch.equal(
            ours.generate(ids, lengths, params, greedy=False, seed=i).output_ids,
            ref.generate(ids, lengths, ref_params, greedy=False, seed=i).output_ids,
        )
        for i in range(3)
    )
    med = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    print(
        f"{shape} threads={threads}: generate() median wall (CPU) old {med['old']:.1f} ({med_cpu['old']:.1f}) ms, "
        f"new {med['new']:.1f} ({med_cpu['new']:.1f}) ms, ratio new/old {med['new'] / med['old']:.2f} "
        f"({med_cpu['new'] / med_cpu['old']:.2f}); identical samples: {'yes' if same else 'no'}; "
        f"load {os.getloadavg()[0]:.2f}",
        flush=True,
    )


def _measure(
    shape: str, threads: int, engine: Any, replica: Any, eos: list[int], args: argparse.Namespace
) -> None:
    """Time (and with ``--profile`` profile) ``generate()`` and the replica's call on one shape."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    num_prompts, group, new_tokens = parse_shape(shape)
    ids, lengths = _prompt_batch(num_prompts, group, engine.pad_token_id)
    params = _params(engine_mod, new_tokens, eos)
    engine.generate(ids, lengths, params, greedy=False, seed=0)
    cpu: list[float] = []
    times = _time_calls(
        lambda i: engine.generate(ids, lengths, params, greedy=False, seed=i), args.repeats, cpu
    )
    out = engine.generate(ids, lengths, params, greedy=False, seed=0)
    print(
        f"{shape} threads={threads}: generate() median {statistics.median(times) * 1e3:.1f} ms "
        f"(CPU {statistics.median(cpu) * 1e3:.1f} ms), {float(out.generation_lengths.float().mean()):.1f} "
        f"tokens/row, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    if args.profile:
        _profile(engine, ids, lengths, params, engine.model.arch.num_layers)
    # The hosted replica's call: the engine plus the rollout batch it hands back.
    replica.sampling = params
    data = BatchedDataDict({"input_ids": ids, "input_lengths": lengths})
    replica.generate(data, False, 0)
    times = _time_calls(lambda i: replica.generate(data, False, i), args.repeats)
    print(
        f"{shape} threads={threads}: EmbeddedReplica.generate() median {statistics.median(times) * 1e3:.1f} ms"
    )


def main() -> None:
    """Parse the arguments and time (and optionally profile) every shape x thread count."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=["64x32", "512x24"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compare-ref", default=None, help="a git revision whose engine to alternate with")
    args = parser.parse_args()

    from nemo_rl.config.loader import load_and_validate
    from nemo_rl.config.master import GRPOMasterConfig
    from nemo_rl.models.generation.embedded.replica import EmbeddedReplica, eos_token_ids
    from nemo_rl.models.tokenizer import get_policy_tokenizer

    config = load_and_validate(CONFIG, GRPOMasterConfig, [f"policy.max_total_sequence_length={MAX_SEQ_LEN}"])
    tokenizer = get_policy_tokenizer(config.policy)
    pad_id = int(tokenizer.pad_token_id)
    eos = eos_token_ids(tokenizer, CHECKPOINT)
    ours = _engine(model_mod, engine_mod, pad_id)
    print(f"load average at start {os.getloadavg()[0]:.2f}")
    if args.compare_ref:
        ref_model_mod, ref_engine_mod = _load_revision(args.compare_ref)
        ref = _engine(ref_model_mod, ref_engine_mod, pad_id)
        for shape in args.shapes:
            for threads in args.threads:
                torch.set_num_threads(threads)
                _compare(shape, threads, ours, ref, ref_engine_mod, eos, args.repeats)
        return
    replica = EmbeddedReplica(
        config.policy, tokenizer, ours.model, checkpoint_dir=CHECKPOINT, dp_rank=0, device=torch.device("cpu")
    )
    replica.engine = ours
    for shape in args.shapes:
        for threads in args.threads:
            torch.set_num_threads(threads)
            _measure(shape, threads, ours, replica, eos, args)


if __name__ == "__main__":
    main()
