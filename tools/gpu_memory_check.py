"""The ``--dry-run`` memory plan of the DTensor policy's training step against one CUDA GPU.

Each case (a random Qwen2, ``mid`` = test_memory_plan's 27M model or ``large`` = 316M, and a
``policy.precision``) builds a one-rank :class:`~nemo_rl.models.policy.dtensor_worker.DTensorPolicyWorker`
in this process and trains two steps of one fixed micro-batch (``--rows`` x ``--seq-len`` full rows, dynamic
batching off, so the plan's tokens are exact); the second step is measured:

- **state**: parameter, gradient and optimizer-state bytes, counted tensor by tensor, must EQUAL the plan's
  terms (``nemo_rl.config.memory_plan.policy_train_terms``);
- **total**: the plan's policy total must be within 25% of ``torch.cuda.max_memory_allocated()``;
- **activations** (reported): bytes allocated from the forward's start to the loss, less the float32 logits
  and FSDP's gathered parameters, with the attention kernel torch picked (``math`` keeps T x T scores).

    python3 tools/gpu_memory_check.py [--cases mid:float32,large:bfloat16] [--rows 4] [--seq-len 512]
        [--budget-s 60] [--out results.json]
    python3 tools/gpu_memory_check.py --cpu   # state bytes only, on CPU (gloo, one thread, 2 x 128 tokens)

Cases not started after ``--budget-s`` seconds print SKIP. Exit status: 0 when every check passed, 1 when one
failed, 2 when a case raised or none ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script from any folder, nemo_rl installed or not
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    import torch

    from nemo_rl.config.policy import PolicyConfig
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker
    from nemo_rl.models.policy.loss_interface import LossFunction

TINY = ROOT / "examples/assets/tiny_qwen2_init"
TOKENIZER_VOCAB = 104
"""Entries of the tiny asset's tokenizer: every token id drawn stays below it."""
TOLERANCE = 0.25
MIB = 2**20
_KEYS = ("vocab_size", "hidden_size", "intermediate_size")
_KEYS += ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
MODELS: dict[str, dict[str, Any]] = {
    "mid": dict(zip(_KEYS, (4096, 512, 1536, 8, 8, 4), strict=True)),  # test_memory_plan's build_mid_model
    "large": dict(zip(_KEYS, (32000, 1024, 2816, 24, 16, 8), strict=True)),
}
GPU_CASES = "mid:float32,mid:bfloat16,large:bfloat16,large:float32"
CPU_CASES = "mid:float32,mid:bfloat16"
STATE_TERMS = ("weights", "gradients", "optimizer")


@dataclass
class CaseResult:
    """One case's plan terms and measurements (bytes), and its verdicts."""

    model: str
    precision: str
    plan: dict[str, int] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)
    """Bytes, the micro-batch's tokens and ``sdpa``: the attention kernels torch picked."""
    checks: dict[str, str] = field(default_factory=dict)
    """``state`` / ``total`` -> PASS, FAIL or SKIP."""
    lines: list[str] = field(default_factory=list)
    """The PASS / FAIL / INFO lines printed under the table."""
    error: str | None = None
    seconds: float = 0.0

    @property
    def name(self) -> str:
        """``model/precision``."""
        return f"{self.model}/{self.precision}"


# ----------------------------------------------------------------------------------------- set-up
def set_environment(cpu: bool) -> None:
    """What ``RayWorkerGroup`` gives a worker of a one-rank policy, before torch is imported."""
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # nemo_rl picks CUDA whenever torch sees a GPU
    threads = 1 if cpu else min(8, os.cpu_count() or 1)  # on GPU the host only loads the models
    # The GPU machine has no network: a hub look-up must fail at once rather than wait for a timeout.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # one table, not a bar per load
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        NEMO_RL_TORCH_THREADS=str(threads),
    )
    from nemo_rl.distributed.virtual_cluster import free_port

    os.environ["MASTER_PORT"] = str(free_port())


def build_model(name: str, path: Path, seq_len: int, device: torch.device) -> None:
    """A random Qwen2 of ``MODELS[name]`` with the tiny asset's tokenizer, written to ``path``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**MODELS[name], max_position_embeddings=max(seq_len, 256), tie_word_embeddings=True)
    # Drawn on the device (seconds less for the 316M model than on the host), saved in bfloat16 (half the
    # disk); the worker loads float32 master weights whatever the file holds.
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    except Exception as error:  # a one-shot run on a rented GPU must not stop here: draw it on the host
        print(f"building {name} on {device} failed ({error!r}); building it on the host", flush=True)
        model = Qwen2ForCausalLM(config)
    model.bfloat16().save_pretrained(path)
    del model
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY / file, path / file)


def policy_cfg(model_dir: Path, precision: str, rows: int, seq_len: int) -> PolicyConfig:
    """One micro-batch of ``rows`` sequences per step, dynamic batching off (the plan's default tokens)."""
    from nemo_rl.config.policy import PolicyConfig

    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "precision": precision,
            "train_global_batch_size": rows,
            "train_micro_batch_size": rows,
            "max_total_sequence_length": seq_len,
            "dynamic_batching": {"enabled": False},
            "shared_prefix": {"enabled": False},
        }
    )


def make_batch(rows: int, seq_len: int) -> BatchedDataDict[Any]:
    """``rows`` full-length random sequences, so the micro-batch is exactly ``rows x seq_len`` tokens."""
    import torch

    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    g = torch.Generator().manual_seed(0)
    token_mask = torch.ones(rows, seq_len)
    token_mask[:, :3] = 0.0
    return BatchedDataDict(
        {
            "input_ids": torch.randint(2, TOKENIZER_VOCAB, (rows, seq_len), generator=g),
            "input_lengths": torch.full((rows,), seq_len),
            "token_mask": token_mask,
            "sample_mask": torch.ones(rows),
        }
    )


# --------------------------------------------------------------------------------------------- plan
def plan_terms(cfg: PolicyConfig) -> dict[str, int]:
    """The plan's policy-training terms at world size 1, by their first word, and their total."""
    from nemo_rl.config.memory_plan import WorkerPlan, policy_train_terms, train_tokens
    from nemo_rl.config.model_arch import resolve_arch

    arch, source = resolve_arch(cfg.model_name, cfg.hf_config_overrides)
    if arch is None:
        raise RuntimeError(f"no architecture for {cfg.model_name}: {source}")
    worker = WorkerPlan("policy (training)", policy_train_terms(arch, cfg, 1))
    by_word = {t.name.split(" ")[0]: t.nbytes for t in worker.terms}
    return {
        "weights": by_word["weights"],
        "gradients": by_word["gradients"],
        "optimizer": by_word["optimizer"],
        "fsdp_gathered": by_word.get("FSDP", 0),
        "activations": by_word["activations"],
        "logits": by_word["logits"],
        "total": worker.nbytes,
        "tokens": train_tokens(cfg),
        "parameters": arch.num_parameters,
    }


# ------------------------------------------------------------------------------------------ measure
def local_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes of this rank's piece of ``tensor`` (a DTensor's local shard)."""
    from nemo_rl.models.policy.parallelize import local_tensor

    if tensor is None:
        return 0
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def state_bytes(worker: DTensorPolicyWorker) -> dict[str, int]:
    """Parameters, gradients and optimizer state (Adam's host ``step`` counters left out), as the test counts
    them."""
    import torch

    params = list(worker.model.parameters())
    optimizer = sum(
        local_bytes(value)
        for state in worker.optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != "step"
    )
    return {
        "weights": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params),
        "optimizer": optimizer,
    }


def gathered_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters FSDP holds gathered right now: FSDP2 swaps a module's sharded DTensor
    parameter for a plain one (in the compute dtype) while it is unsharded. 0 without FSDP."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        return 0
    return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))


class ProbedLoss:
    """``inner`` (a LossFunction) that also records, for the worker's forward passes, the allocated bytes
    when the forward starts and when its loss has been computed (autograd then holds every activation the
    backward pass will read), and what of that is logits or FSDP's gathered parameters."""

    def __init__(
        self, inner: LossFunction, worker: DTensorPolicyWorker, allocated: Callable[[], int]
    ) -> None:
        self.inner = inner
        self.loss_type = inner.loss_type
        self.rows_per_group = inner.rows_per_group
        self.worker = worker
        self.allocated = allocated
        self.record: dict[str, int] = {}
        forward = worker._forward

        def probed_forward(mb: BatchedDataDict[Any]) -> torch.Tensor:
            # Called by _forward_backward after zero_grad: the gradients of the last step are freed here.
            self.record["forward_start"] = allocated()
            self.record["gathered_at_start"] = gathered_bytes(worker.model)
            return forward(mb)

        worker._forward = probed_forward  # type: ignore[method-assign]

    def __call__(
        self, logits: torch.Tensor, data: BatchedDataDict[Any], seqs: torch.Tensor, toks: torch.Tensor, /
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The inner loss; records the bytes held once it is computed."""
        loss, metrics = self.inner(logits, data, seqs, toks)
        self.record["at_loss"] = self.allocated()
        self.record["logits_at_loss"] = logits.numel() * logits.element_size()
        self.record["gathered_at_loss"] = gathered_bytes(self.worker.model)
        self.record["tokens"] = int(logits.shape[0] * logits.shape[1])
        return loss, metrics


@contextmanager
def sdpa_kernels(seen: set[str]) -> Iterator[None]:
    """Record in ``seen`` the kernel torch picks for each scaled-dot-product-attention call in the block (Hugging
    Face's sdpa attention calls ``torch.nn.functional.scaled_dot_product_attention``). The activation term
    assumes a fused kernel (flash, memory-efficient, cuDNN); ``MATH`` keeps the T x T scores it does not count."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    original = F.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        try:  # torch's own dispatch decision for these arguments (a private API: a diagnostic only)
            seen.add(SDPBackend(torch._fused_sdp_choice(*args, **kwargs)).name)
        except Exception as error:
            seen.add(f"unknown ({type(error).__name__})")
        return original(*args, **kwargs)

    F.scaled_dot_product_attention = recording
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def measure(
    worker: DTensorPolicyWorker, data: BatchedDataDict[Any], cuda: bool, baseline: int
) -> dict[str, Any]:
    """A warm-up step (Adam's state, cuBLAS's workspace, FSDP's lazy set-up), the state bytes, then one
    probed step: the allocated bytes before it and at its peak (less ``baseline``, what was allocated before
    the worker was built), and at its forward's start and loss."""
    import torch

    from nemo_rl.algorithms.loss_functions import NLLLoss

    def allocated() -> int:
        return torch.cuda.memory_allocated() if cuda else 0

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    worker.train(data, NLLLoss())
    measured: dict[str, Any] = {**state_bytes(worker), "baseline": baseline}
    probe = ProbedLoss(NLLLoss(), worker, allocated)
    if cuda:
        torch.cuda.synchronize()
        measured["first_step_peak"] = torch.cuda.max_memory_allocated() - baseline
        torch.cuda.reset_peak_memory_stats()
        measured["before"] = allocated() - baseline
    kernels: set[str] = set()
    with sdpa_kernels(kernels):
        worker.train(data, probe)
    if cuda:
        torch.cuda.synchronize()
        measured["peak"] = torch.cuda.max_memory_allocated() - baseline
    rec = probe.record
    measured |= {k: rec[k] for k in ("tokens", "logits_at_loss", "gathered_at_start", "gathered_at_loss")}
    measured["sdpa"] = ",".join(sorted(kernels))
    if cuda:
        held = rec["at_loss"] - rec["forward_start"]
        gathered = rec["gathered_at_loss"] - rec["gathered_at_start"]
        measured |= {"forward_held": held, "activations": held - rec["logits_at_loss"] - gathered}
    return measured


def train_and_measure(cfg: PolicyConfig, data: BatchedDataDict[Any], cuda: bool) -> dict[str, Any]:
    """Build the worker on this process's device, measure it, and free what it held."""
    import torch

    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    # What earlier cases left allocated (cuBLAS's workspace lives as long as the process), not this worker's.
    baseline = torch.cuda.memory_allocated() if cuda else 0
    worker = DTensorPolicyWorker(cfg, init_reference_model=False)
    try:
        return measure(worker, data, cuda, baseline)
    finally:
        worker.shutdown()
        del worker
        gc.collect()  # the model and optimizer must be gone before the next case's baseline
        if cuda:
            torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------- judge
def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f}"


def judge(result: CaseResult, cuda: bool) -> None:
    """Set ``result.checks`` and its PASS / FAIL / INFO lines."""
    plan, got, name = result.plan, result.measured, result.name
    diffs = [f"{t} plan {plan[t]} B, measured {got[t]} B" for t in STATE_TERMS if plan[t] != got[t]]
    result.checks["state"] = "FAIL" if diffs else "PASS"
    state_total = sum(plan[t] for t in STATE_TERMS)
    result.lines.append(
        f"FAIL {name} state: " + "; ".join(diffs)
        if diffs
        else f"PASS {name} state: weights, gradients and optimizer state equal the plan ({state_total} B)"
    )
    if got["tokens"] != plan["tokens"]:
        result.lines.append(
            f"INFO {name} the micro-batch had {got['tokens']} tokens, the plan counts {plan['tokens']}"
        )
    if not cuda:
        result.checks["total"] = "SKIP"
        result.lines.append(f"SKIP {name} total: no peak is measured on the host (--cpu)")
        return
    ratio = plan["total"] / got["peak"]
    within = abs(plan["total"] - got["peak"]) <= TOLERANCE * got["peak"]
    result.checks["total"] = "PASS" if within else "FAIL"
    result.lines.append(
        f"{result.checks['total']} {name} total: plan {_mib(plan['total'])} MiB "
        f"{'within' if within else 'NOT within'} {TOLERANCE:.0%} of the measured peak "
        f"{_mib(got['peak'])} MiB (plan / peak {ratio:.3f}; first step's peak {_mib(got['first_step_peak'])} MiB)"
    )
    act_ratio = plan["activations"] / got["activations"] if got["activations"] > 0 else float("nan")
    result.lines.append(
        f"INFO {name} activations: plan {_mib(plan['activations'])} MiB, measured "
        f"{_mib(got['activations'])} MiB (plan / measured {act_ratio:.3f}; attention kernel {got['sdpa']}); "
        f"allocated before the step "
        f"{_mib(got['before'])} MiB against the plan's weights + gradients + optimizer {_mib(state_total)} MiB"
    )


_HEADER = "case=15 tokens=6 weights=8 grads=8 optim=8 fsdp=6 act:plan=8 act:meas=8 p/m=5 logits=7 "
_HEADER += "total:plan=10 before=8 peak=8 p/m=5 attn=6 state=5 total=5"
COLUMNS = tuple((title, int(width)) for title, width in (c.rsplit("=", 1) for c in _HEADER.split()))
"""The table's columns: title and width."""


def table_row(result: CaseResult) -> list[str]:
    """One row of the table: the plan's terms, what was measured, their ratios (MiB)."""
    if result.error is not None or not result.plan or not result.measured:
        status = "ERROR" if result.error is not None else "SKIP"
        return [result.name, *[""] * (len(COLUMNS) - 3), status, status]
    plan, got = result.plan, result.measured
    on_gpu = "peak" in got

    def meas(key: str) -> str:
        return _mib(got[key]) if on_gpu else "-"

    def ratio(a: int, b: int) -> str:
        return f"{a / b:.2f}" if on_gpu and b > 0 else "-"

    return [
        result.name,
        str(got["tokens"]),
        *(_mib(plan[t]) for t in (*STATE_TERMS, "fsdp_gathered", "activations")),
        meas("activations"),
        ratio(plan["activations"], got.get("activations", 0)),
        _mib(plan["logits"]),
        _mib(plan["total"]),
        meas("before"),
        meas("peak"),
        ratio(plan["total"], got.get("peak", 0)),
        got["sdpa"].lower().replace("_attention", "")[:6],
        result.checks.get("state", "-"),
        result.checks.get("total", "-"),
    ]


def format_table(results: list[CaseResult]) -> str:
    """The compact table: a header, one row per case."""
    rows = [[title for title, _ in COLUMNS], *(table_row(r) for r in results)]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, (_, w)) in enumerate(zip(row, COLUMNS, strict=True))
        )
        for row in rows
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run on the host (gloo), checking the state bytes only"
    )
    parser.add_argument(
        "--cases", default=None, help=f"MODEL:PRECISION,... (default {GPU_CASES}; --cpu: {CPU_CASES})"
    )
    parser.add_argument(
        "--rows", type=int, default=None, help="sequences per micro-batch (default 4; --cpu: 2)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default 512; --cpu: 128)"
    )
    parser.add_argument("--budget-s", type=float, default=60.0, help="start no case after this many seconds")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:  # checked before torch loads: a typo costs no device time
        args.case_list = parse_cases(args.cases or (CPU_CASES if args.cpu else GPU_CASES))
    except ValueError as error:
        parser.error(f"--cases: {error}")
    args.rows = args.rows or (2 if args.cpu else 4)
    args.seq_len = args.seq_len or (128 if args.cpu else 512)
    return args


def parse_cases(text: str) -> list[tuple[str, str]]:
    """``mid:float32,large:bfloat16`` -> ``[("mid", "float32"), ("large", "bfloat16")]``."""
    cases = []
    for item in text.split(","):
        model, _, precision = item.strip().partition(":")
        if model not in MODELS or precision not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"{item!r} is not MODEL:PRECISION with MODEL in {sorted(MODELS)}")
        cases.append((model, precision))
    return cases


def environment(cuda: bool) -> dict[str, Any]:
    """The versions and the device the numbers come from."""
    import platform

    import torch
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": "cpu",
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env |= {"device": props.name, "device_memory": props.total_memory, "cuda": torch.version.cuda}
    return env


def write_json(
    out: Path | None, env: dict[str, Any], args: argparse.Namespace, results: list[CaseResult], seconds: float
) -> None:
    """The results so far as JSON at ``out`` (nothing without ``--out``)."""
    if out is None:
        return
    cases = [{k: v for k, v in vars(r).items() if k != "lines"} | {"name": r.name} for r in results]
    payload = {
        "environment": env,
        "rows": args.rows,
        "seq_len": args.seq_len,
        "seconds": seconds,
        "cases": cases,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")


def run_case(
    model: str, precision: str, model_dir: Path, args: argparse.Namespace, device: torch.device
) -> CaseResult:
    """Build the model (once per model), plan, train and judge one case; an exception is recorded, not
    raised, so the other cases still run."""
    import torch

    result = CaseResult(model, precision)
    start = time.monotonic()
    cuda = device.type == "cuda"
    try:
        if not model_dir.exists():
            build_model(model, model_dir, args.seq_len, device)
            if cuda:
                torch.cuda.empty_cache()  # the drawn model is gone; the worker starts from an empty cache
        cfg = policy_cfg(model_dir, precision, args.rows, args.seq_len)
        result.plan = plan_terms(cfg)
        result.measured = train_and_measure(cfg, make_batch(args.rows, args.seq_len), cuda)
        judge(result, cuda)
    except Exception:
        result.error = traceback.format_exc()
        result.lines.append(f"ERROR {result.name}:\n{result.error}")
    result.seconds = time.monotonic() - start
    return result


def run_all(args: argparse.Namespace, cuda: bool, env: dict[str, Any], start: float) -> list[CaseResult]:
    """Every case in order, each model built once; cases left when the budget is spent are skipped."""
    import torch

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    results: list[CaseResult] = []
    with tempfile.TemporaryDirectory(prefix="gpu_memory_check.") as tmp:
        for model, precision in args.case_list:
            elapsed = time.monotonic() - start
            if elapsed > args.budget_s:
                skipped = CaseResult(model, precision)
                skipped.lines.append(
                    f"SKIP {skipped.name}: {elapsed:.0f} s passed, --budget-s {args.budget_s:g}"
                )
                results.append(skipped)
                continue
            result = run_case(model, precision, Path(tmp) / model, args, device)
            results.append(result)
            # Printed and written as each case ends: a run killed by the machine's time limit keeps them.
            print(f"[{time.monotonic() - start:5.1f} s] {result.name} ({result.seconds:.1f} s):", flush=True)
            print("\n".join(result.lines), flush=True)
            write_json(args.out, env, args, results, time.monotonic() - start)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print the table and the verdicts, write ``--out``; the exit status."""
    start = time.monotonic()
    args = parse_args(argv)
    set_environment(args.cpu)
    import torch
    import torch.distributed as dist

    cuda = not args.cpu and torch.cuda.is_available()
    if not args.cpu and not cuda:
        print("no CUDA GPU is visible: run on a GPU machine, or with --cpu", file=sys.stderr)
        return 2
    env = environment(cuda)
    print(f"{' '.join(f'{k}={v}' for k, v in env.items())}; {args.rows} x {args.seq_len} tokens", flush=True)
    results = run_all(args, cuda, env, start)
    if dist.is_initialized():
        dist.destroy_process_group()
    elapsed = time.monotonic() - start
    write_json(args.out, env, args, results, elapsed)
    print(
        f"\nMiB per device; p/m = plan / measured; within {TOLERANCE:.0%} passes\n{format_table(results)}\n"
    )
    # The verdicts again under the table (tracebacks were printed as they happened).
    print("\n".join(line for r in results for line in r.lines if not line.startswith("ERROR")))
    print(f"{len(results)} cases in {elapsed:.1f} s", flush=True)
    ran = [r for r in results if r.plan and r.measured]
    if any(r.error for r in results) or not ran:
        return 2
    return 1 if any(v == "FAIL" for r in ran for v in r.checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
