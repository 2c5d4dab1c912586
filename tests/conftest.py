"""Shared pytest fixtures.

``ray_cluster`` (session scope): one local Ray instance for the whole test session, started on first use with
``RAY_CLUSTER_NUM_CPUS`` (8) logical CPUs and the machine's GPUs (none on CI, where every
``cluster.gpus_per_node`` up to 7 fits as CPU worker slots, leaving room for driver-side actors), and shut down
when the session ends. Request it in any test (or fixture) that creates actors,
a ``RayVirtualCluster`` or a ``RayWorkerGroup``; tests must release what they reserve (``shutdown()`` worker
groups and clusters, ideally in a ``finally`` or a fixture) so later tests find the slots free. It ignores
``RAY_ADDRESS``: tests never attach to a real cluster. Worker processes see the driver's test directories on
their ``PYTHONPATH``, so worker classes defined in test modules unpickle in the actors. The fixture yields the
``ray.cluster_resources()`` dict it started with.

``tiny_assets`` (module scope): the tiny character-level tokenizer and the random tiny Qwen2 checkpoint of
:mod:`nemo_rl.data.tiny` (seed 0), built in a temporary folder; yields ``(model_dir, tokenizer)``.

The session ends with a check that it left nothing behind (:mod:`leftovers`): a process it started still
running fails the session, and so, where ``NEMO_RL_LEFTOVER_CHECK=all`` (CI), does a ``/dev/shm`` segment or
``/tmp`` entry it made. ``--record-skipped PATH`` writes the node ids of the tests (and modules) that skipped,
one a line: CI's lane with the optional extras runs those again (docs/testing.md).
"""

from __future__ import annotations

import atexit
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

# Before Ray is imported (it reads this once): under `uv run pytest`, Ray's uv hook would start every worker
# with `uv run` in an uploaded copy of the checkout, building another environment there (nemo_rl/__init__.py
# sets the same default, but this file imports Ray first).
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import pytest
import ray
import torch
from leftovers import CHECK_ENV, SESSION_ENV, Snapshot, find_leftovers
from transformers import PreTrainedTokenizerBase

from nemo_rl.distributed.ray_reaper import start_reaper
from nemo_rl.distributed.ray_start import default_ray_temp_dir, job_runtime_env

RAY_CLUSTER_NUM_CPUS = 8

# Ray's start-up waits for its agents to register; on a busy 2-core machine they can be late, and the raylet
# then exits. Tests (and the scripts they start, which inherit this environment) allow Ray more time.
os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
# The scripts and Ray workers the tests start cache the bytecode they compile: with PYTHONDONTWRITEBYTECODE
# inherited, each of those processes would compile whatever the install did not precompile again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# In-process reference computations get one torch thread, like every worker: on a shared 2-core machine two
# threads contend with the test's own Ray workers (a reference that takes 0.5 s on one thread took 14 s on two).
torch.set_num_threads(1)

# The two xdist workers each take whole files (`--dist loadfile`) in collection order
# (`--no-loadscope-reorder`; xdist's default order, most tests first, left the few-but-long end-to-end files
# for last, and one worker ran them alone). Files expected to run longest are collected first, so the many
# short unit files fill in at the end and both workers finish together.
_HEAVY_FIRST = ("tests/functional/", "tests/distributed/", "tests/faults/")


def _collection_rank(nodeid: str) -> int:
    return next(
        (rank for rank, prefix in enumerate(_HEAVY_FIRST) if nodeid.startswith(prefix)), len(_HEAVY_FIRST)
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the collected tests heavy directories first (a stable sort: files keep their order within)."""
    items.sort(key=lambda item: _collection_rank(item.nodeid))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-skipped",
        metavar="PATH",
        help="write the node ids of skipped tests and modules to PATH, one a line (CI reruns them with extras)",
    )


class _SessionRecords:
    """In the session's main process: what skipped, and at the end what the session left behind."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.snapshot = Snapshot.take()
        self.skipped: set[str] = set()

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Also a module skipped when collected (``pytest.importorskip`` at its top); xdist forwards these."""
        self._record(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped.add(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """After the session's fixtures are torn down: write the skipped ids, then fail the session for what
        it left behind (the terminal summary follows)."""
        path = self.config.getoption("record_skipped")
        if path:
            Path(path).write_text("".join(f"{nodeid}\n" for nodeid in sorted(self.skipped)))
        check = os.environ.get(CHECK_ENV, "processes")
        problems = find_leftovers(os.environ[SESSION_ENV], self.snapshot, check)
        if problems:
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            reporter.write_sep("=", f"left behind by this session ({CHECK_ENV}={check})", red=True)
            for problem in problems:
                reporter.write_line(problem, red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    """In the main process (not an xdist worker), before xdist starts its workers (they inherit the mark):
    mark the session's processes and start recording (see the module docstring)."""
    if not hasattr(config, "workerinput"):
        os.environ[SESSION_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config.pluginmanager.register(_SessionRecords(config), "nemo_rl_session_records")


def pytest_unconfigure(config: pytest.Config) -> None:
    """In an xdist worker, run the exit handlers now: execnet ends its worker processes without them, and they
    are what removes the temporary folders libraries make when imported (wandb's media and artifact folders,
    multiprocessing's ``pymp-*``), which the main process's leftover check would then find in ``/tmp``."""
    if hasattr(config, "workerinput"):
        atexit._run_exitfuncs()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[dict[str, float]]:
    """A local Ray shared by the whole session (see the module docstring)."""
    if ray.is_initialized():
        ray.shutdown()
    temp_dir = os.environ.get("NEMO_RL_RAY_TEMP_DIR") or default_ray_temp_dir()
    ray.init(
        address="local",
        num_cpus=RAY_CLUSTER_NUM_CPUS,
        include_dashboard=False,
        _temp_dir=temp_dir,
        # One thread per worker process: the test machine's cores are shared by all workers.
        runtime_env=job_runtime_env(OMP_NUM_THREADS="1"),
        log_to_driver=True,
    )
    # A SIGKILLed pytest would otherwise leave Ray's agents running for a minute.
    start_reaper(temp_dir)
    try:
        yield ray.cluster_resources()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedTokenizerBase]:
    """The tiny tokenizer and tiny Qwen2 checkpoint, built once per test module (see the module docstring)."""
    from nemo_rl.data.tiny import build_tiny_model, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    build_tiny_model(root / "model", root / "tokenizer", seed=0)
    return root / "model", tokenizer
