"""Where a GRPO run's start-up time goes: timestamps of the driver's phases and every process's CPU time.

Runs ``examples/run_grpo_math.py`` (``grpo_math_tiny.yaml`` with the 64x32 overrides of
``bench_grpo_vs_trl.py``, DP=``--threads``, two steps) in a subprocess that marks, in seconds since that
process started and with the driver's own CPU time, the request to start Ray in the background
(``start_ray_in_background``), the end of its imports, the tokenizer and data, Ray up (``_init_ray_now``, on
the thread that started it) and ``init_ray`` (where ``setup`` waits for it), the environment, generation and
policy actors' creation, the wait until all of them are up, and the end of each step. The marks are hooked
in as the script imports each module, so the script's own import order is what gets measured. Meanwhile it polls the CPU time of every process the run starts (Ray's own, the workers,
the environment and its verifier processes) and prints them when the run ends, with the total, and again
split into three phases: until every worker actor is created, until all of them are up, and after (the
second is where the policy workers' start is the critical path, so what else runs then delays it):

    uv run python benchmarks/startup_profile.py [--threads 1] [key=value ...]

Extra ``key=value`` arguments are passed on as config overrides. On a shared machine the timestamps and CPU
times are inflated by other work; compare versions by running them alternately, and quote idle numbers.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import runpy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grpo_vs_trl import CONFIG, SCRIPT, cpu_by_process, grpo_overrides  # noqa: E402

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _process_start_s(pid: int | str = "self") -> float:
    """When process ``pid`` started, in seconds since the epoch (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    boot_s = float(Path("/proc/stat").read_text().split("btime ")[1].split()[0])
    return boot_s + int(fields[19]) / _CLOCK_TICKS


# ---------------------------------------------------------------------------- inside the traced driver
class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``hooks[name](module)`` right after module ``name`` first runs, before anyone can import from it.

    The script's own import order is kept (it starts Ray before its heavy imports), and the hooks still
    wrap the functions the script binds with ``from module import name``.
    """

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self._hooks = hooks

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        hook = self._hooks.pop(fullname, None)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_hook(module: ModuleType) -> None:
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_then_hook  # type: ignore[method-assign]
        return spec


def _traced_driver(script_args: list[str]) -> None:
    """Run the example script in this process with phase marks on stderr."""
    start_s = _process_start_s()

    def mark(what: str) -> None:
        print(
            f"[startup {time.time() - start_s:7.2f} s, driver CPU {time.process_time():6.2f} s, "
            f"{len(sys.modules):4d} modules] {what}",
            file=sys.stderr,
            flush=True,
        )

    def timed(module: ModuleType, name: str, before: str | None = None) -> None:
        original: Callable[..., Any] | None = getattr(module, name, None)
        if original is None:
            return

        first_call = [True]

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None and first_call[0]:
                mark(before)
            first_call[0] = False
            result = original(*args, **kwargs)
            mark(f"{name} done")
            return result

        setattr(module, name, wrapper)

    def on_ray_start(module: ModuleType) -> None:
        timed(module, "start_ray_in_background")
        # The local start or the attach itself, on whichever thread runs it.
        timed(module, "_init_ray_now")
        # Where setup waits for that start.
        timed(module, "init_ray")

    def on_virtual_cluster(module: ModuleType) -> None:
        # The placement groups' reservation. The method first: timed() replaces the class with a function.
        timed_method(module.RayVirtualCluster, "shutdown", "cluster shutdown done")
        timed(module, "RayVirtualCluster")

    def timed_method(cls: type, name: str, label: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            mark(label)
            return result

        setattr(cls, name, wrapper)

    def on_start_together(module: ModuleType) -> None:
        start_together = module.start_together

        @contextlib.contextmanager
        def marked_start_together(*args: Any, **kwargs: Any) -> Iterator[None]:
            with start_together(*args, **kwargs):
                yield
                mark("all worker actors created")
            mark("all workers up")

        setattr(module, "start_together", marked_start_together)  # noqa: B010 (a module attribute mypy cannot see)

    def on_worker_groups(module: ModuleType) -> None:
        timed_method(module.RayWorkerGroup, "shutdown", "a worker group's shutdown done")

    def on_generation_factory(module: ModuleType) -> None:
        # The script's first call after its heavy imports.
        timed(module, "check_backend_available", before="driver imports done")
        timed(module, "create_generation")

    def on_ray(module: ModuleType) -> None:
        # Registered after Ray's own exit hook, so it runs first: the end of the script's own work.
        atexit.register(mark, "exit hooks begin")

    def on_logger(module: ModuleType) -> None:
        log_metrics = module.Logger.log_metrics

        def marked_log_metrics(
            self: Any, metrics: dict[str, Any], step: int, *args: Any, **kwargs: Any
        ) -> None:
            total = [value for key, value in metrics.items() if key.endswith("total_step_time")]
            if total:
                mark(f"step {step} done ({total[0]:.2f} s)")
            log_metrics(self, metrics, step, *args, **kwargs)

        module.Logger.log_metrics = marked_log_metrics

    hooks: dict[str, Callable[[ModuleType], None]] = {
        # Hooked where each name is defined, so that whichever module of the algorithm imports it gets the
        # marked one.
        "nemo_rl.distributed.ray_start": on_ray_start,
        "nemo_rl.distributed.virtual_cluster": on_virtual_cluster,
        "nemo_rl.distributed.worker_group_facade": on_start_together,
        "nemo_rl.distributed.worker_groups": on_worker_groups,
        "ray": on_ray,
        "nemo_rl.environments.registry": lambda module: timed(module, "create_task_envs"),
        "nemo_rl.models.generation.factory": on_generation_factory,
        "nemo_rl.models.policy.lm_policy": lambda module: timed(module, "Policy"),
        "nemo_rl.algorithms.run_build": lambda module: timed(module, "build_run"),
        "nemo_rl.data.datasets": lambda module: timed(module, "setup_rl_data"),
        "nemo_rl.models.tokenizer": lambda module: timed(module, "get_policy_tokenizer"),
        "nemo_rl.utils.logger": on_logger,
    }
    sys.meta_path.insert(0, _AfterImport(hooks))
    mark("interpreter up")
    sys.argv = [str(SCRIPT), *script_args]
    # This process stands in for `python examples/run_grpo_math.py ...`: the script ends it as it would end that
    # one (nemo_rl.utils.script_exit, which checks what Python was started with).
    sys.orig_argv = [sys.executable, str(SCRIPT), *script_args]
    runpy.run_path(str(SCRIPT), run_name="__main__")


# ------------------------------------------------------------------------------------- the observer
# A driver that only starts Ray as a run does (init_ray, no config), starts one empty actor, waits for it and
# exits the way a run does (Ray's exit hook stops the local cluster): what Ray itself costs per run.
_RAY_ONLY = """
import os, sys, time
_stat = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
_boot_s = float(open("/proc/stat").read().split("btime ")[1].split()[0])
START_S = _boot_s + int(_stat[19]) / os.sysconf("SC_CLK_TCK")
from nemo_rl.distributed.ray_start import init_ray
import ray
init_ray(None)
print(f"[startup {time.time() - START_S:7.2f} s] Ray up", file=sys.stderr, flush=True)
@ray.remote(num_cpus=1)
class Empty:
    def ready(self):
        return True
ray.get(Empty.remote().ready.remote(), timeout=300)
print(f"[startup {time.time() - START_S:7.2f} s] an empty actor up", file=sys.stderr, flush=True)
"""


def _run_polled(
    command: list[str], log_path: Path
) -> tuple[int, dict[int, tuple[float, str]], list[tuple[float, dict[int, float]]], float]:
    """Run ``command`` with its output in ``log_path``, polling the CPU time of its process tree every 0.25 s:
    its exit status, the last CPU time and command line of every process seen, the polls (seconds since it
    started, CPU seconds per pid) and when it exited."""
    seen: dict[int, tuple[float, str]] = {}
    snapshots: list[tuple[float, dict[int, float]]] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        driver_start_s = _process_start_s(proc.pid)
        while proc.poll() is None:
            found = cpu_by_process(proc.pid)
            snapshots.append((time.time() - driver_start_s, {pid: c for pid, (c, _) in found.items()}))
            seen.update(found)
            time.sleep(0.25)
        exit_s = time.time() - driver_start_s
    return proc.returncode, seen, snapshots, exit_s


def _print_cpu(seen: dict[int, tuple[float, str]]) -> None:
    print(f"CPU seconds per process (load average {os.getloadavg()[0]:.1f}):")
    for cpu_s, command in sorted(seen.values(), reverse=True):
        if cpu_s >= 0.2:
            print(f"  {cpu_s:6.2f}  {command[:110]}")
    print(f"  {sum(c for c, _ in seen.values()):6.2f}  in all ({len(seen)} processes)")


def main() -> None:
    """Run the traced driver, poll its processes' CPU time, print both."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1, help="policy and generation workers (DP size)")
    parser.add_argument(
        "--ray-only",
        action="store_true",
        help="profile only Ray's start, one empty actor and the exit (what Ray costs a run)",
    )
    parser.add_argument("--traced-driver", action="store_true", help=argparse.SUPPRESS)
    args, extra = parser.parse_known_args()
    if args.traced_driver:
        _traced_driver(extra)
        return
    with tempfile.TemporaryDirectory(prefix="startup_profile_") as tmp:
        if args.ray_only:
            command = [sys.executable, "-c", _RAY_ONLY]
        else:
            overrides = grpo_overrides(8, 8, 32, args.threads, 2, Path(tmp) / "logs")
            command = [
                sys.executable,
                __file__,
                "--traced-driver",
                "--config",
                str(CONFIG),
                *overrides,
                *extra,
            ]
        returncode, seen, snapshots, exit_s = _run_polled(command, Path(tmp) / "run.log")
        text = (Path(tmp) / "run.log").read_text()
    if returncode != 0:
        raise SystemExit(f"the run failed (exit {returncode}):\n{text[-4000:]}")
    print("\n".join(line for line in text.splitlines() if line.startswith("[startup ")))
    print(f"[startup {exit_s:7.2f} s] driver exited (to within 0.25 s)")
    _print_cpu(seen)
    _print_phase_cpu(text, snapshots, seen)


def _print_phase_cpu(
    log: str, snapshots: list[tuple[float, dict[int, float]]], seen: dict[int, tuple[float, str]]
) -> None:
    """CPU seconds each process spent before the actors were created, while the workers started, and after.

    Read from the polls nearest each mark (every 0.25 s), so each figure is good to about 0.25 s of a core.
    """
    marks = {}
    for line in log.splitlines():
        if line.startswith("[startup "):
            marks[line.split("] ", 1)[1]] = float(line.split()[1])
    if "all worker actors created" not in marks or "all workers up" not in marks or not snapshots:
        return

    def cpu_at(when_s: float, pid: int) -> float:
        before = [cpus.get(pid, 0.0) for t, cpus in snapshots if t <= when_s]
        return before[-1] if before else 0.0

    created_s, up_s = marks["all worker actors created"], marks["all workers up"]
    print(
        f"CPU seconds per process: to the actors' creation ({created_s:.1f} s), to all workers up "
        f"({up_s:.1f} s), after"
    )
    rows = []
    for pid, (total_s, command) in seen.items():
        first, second = cpu_at(created_s, pid), cpu_at(up_s, pid)
        rows.append((second - first, first, total_s - second, command))
    for during, before, after, command in sorted(rows, reverse=True):
        if before + during + after >= 0.2:
            print(f"  {before:6.2f} {during:6.2f} {after:6.2f}  {command[:90]}")
    print(
        f"  {sum(r[1] for r in rows):6.2f} {sum(r[0] for r in rows):6.2f} {sum(r[2] for r in rows):6.2f}  in all"
    )


if __name__ == "__main__":
    main()
