"""Starting Ray, or attaching to a running cluster, for a driver.

:func:`init_ray` starts a local Ray (or attaches through ``RAY_ADDRESS``); :func:`start_ray_in_background`
begins that start on a thread of its own so that it overlaps the driver's imports, and
:func:`exit_at_once_on_user_error` / :func:`ray_starting_in_background` end a driver at once, stopping the
half-started Ray, when it fails before setup takes the start over. :func:`job_runtime_env` is what every Ray
worker process inherits. This module stays free of torch so that Ray can start while the driver imports it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator

import psutil
import ray
from ray.exceptions import AuthenticationError

from nemo_rl.config.cli import USER_ERROR_EXIT_CODE, report_user_error
from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.errors import UserError
from nemo_rl.distributed.gc_tuning import WORKER_PROCESS_SETUP_HOOK
from nemo_rl.distributed.ray_reaper import start_reaper

logger = logging.getLogger(__name__)

# Logical CPUs a local Ray gets on top of the worker slots, for driver-side actors (environments, loggers,
# dataloader helpers) that must not wait for a slot.
DRIVER_SIDE_CPUS = 8


class _BackgroundStart:
    """An :func:`init_ray` running on a thread of its own, and what it raised."""

    def __init__(self, cluster_cfg: ClusterConfig | None) -> None:
        self.error: BaseException | None = None
        self.done = threading.Event()
        # What abandon() must leave alone: this process's children from before the start, and a Ray temp dir
        # that was already there (a local start adds a session folder named after this process's pid to it).
        self._children_before = {child.pid for child in psutil.Process().children(recursive=True)}
        self._temp_dir = None if os.environ.get("RAY_ADDRESS") else ray_temp_dir()
        self._temp_dir_existed = self._temp_dir is not None and os.path.isdir(self._temp_dir)
        # A daemon: a driver that fails before it needs Ray (bad data, a backend this machine lacks) does not
        # wait for it; exit_at_once_on_user_error stops the processes it started so far.
        self._thread = threading.Thread(
            target=self._run, args=(cluster_cfg,), name="nemo-rl-ray-start", daemon=True
        )
        self._thread.start()

    def _run(self, cluster_cfg: ClusterConfig | None) -> None:
        ray_worker_logger = logging.getLogger("ray._private.worker")
        ray_worker_logger.addFilter(_drop_sigterm_warning)
        try:
            _init_ray_now(cluster_cfg)
        except BaseException as err:  # re-raised on the caller's thread by init_ray
            self.error = err
            return
        finally:
            ray_worker_logger.removeFilter(_drop_sigterm_warning)
            self.done.set()
        # Ray starts its processes with PR_SET_PDEATHSIG, which kills them when the *thread* that started them
        # ends, not the process: this thread lives as long as the driver.
        threading.Event().wait()

    def abandon(self) -> None:
        """Stop every process this start began (finished or not) and remove the session folder it wrote.

        Ray's processes are this process's children (GCS, raylet, monitors) and the raylet's (its agents, which
        ignore SIGTERM and outlive a killed raylet): the whole tree is stopped first, so that nothing forks while
        it is killed, then killed; the children are reaped.
        """
        me = psutil.Process()
        frozen: dict[int, psutil.Process] = {}
        while new := [
            child
            for child in me.children(recursive=True)
            if child.pid not in self._children_before and child.pid not in frozen
        ]:
            for child in new:
                with contextlib.suppress(psutil.Error):
                    child.suspend()
                frozen[child.pid] = child
        mine = [child for child in me.children() if child.pid in frozen]
        for child in frozen.values():
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(mine, timeout=5)
        if self._temp_dir is None or not os.path.isdir(self._temp_dir):
            return
        latest = os.path.join(self._temp_dir, "session_latest")
        for entry in os.listdir(self._temp_dir):
            path = os.path.join(self._temp_dir, entry)
            if entry.startswith("session_") and entry.endswith(f"_{os.getpid()}"):
                shutil.rmtree(path, ignore_errors=True)
        if os.path.islink(latest) and not os.path.exists(latest):
            os.unlink(latest)
        if not self._temp_dir_existed and not os.listdir(self._temp_dir):
            os.rmdir(self._temp_dir)


_background_start: _BackgroundStart | None = None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Ray's SIGTERM handler for drivers: exit, so that its atexit hook stops a local cluster."""
    sys.exit(signum)


def _drop_sigterm_warning(record: logging.LogRecord) -> bool:
    """Drop Ray's warning that ray.init off the main thread set no SIGTERM handler: the caller set it."""
    return not record.getMessage().startswith("SIGTERM handler is not set")


def start_ray_in_background(cluster_cfg: ClusterConfig | None = None) -> None:
    """Begin :func:`init_ray` on a background thread and return at once; the next :func:`init_ray` waits for it.

    Starting a local Ray takes seconds in which the caller only waits for Ray's own processes (GCS, raylet,
    dashboard, agents) to start, while a driver's imports (torch, transformers) and data loading are its own
    CPU: a driver that knows its cluster config calls this first, so the two overlap. Attaching through
    ``RAY_ADDRESS`` runs on the thread the same way. Whatever the start raises, the next :func:`init_ray`
    (``setup`` calls it) raises. A no-op when Ray is initialised or a start is under way.
    """
    global _background_start
    if _background_start is not None or ray.is_initialized():
        return
    if threading.current_thread() is threading.main_thread():
        # ray.init installs this handler only when it runs on the main thread.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _background_start = _BackgroundStart(cluster_cfg)


@contextlib.contextmanager
def exit_at_once_on_user_error() -> Iterator[None]:
    """Like :func:`nemo_rl.config.cli.exit_on_user_error`, for the part of a driver that runs while
    :func:`start_ray_in_background`'s start is still this process's own (before ``init_ray`` takes it over).

    A :class:`UserError` raised in the block is reported on stderr as one line; then every process that start
    began is stopped, the Ray session folder it wrote is removed, and the process ends with status 2 at once:
    ``os._exit``, because an interpreter that exits normally waits for Ray's half-started client to give up
    (seconds) and leaves the raylet's agents running. Any other exception (a bug, Ctrl-C) prints its traceback
    and ends the process the same way with status 1 (130 for Ctrl-C). Without a background start (or once
    ``init_ray`` has taken it over) exceptions propagate unchanged, and Ray's own exit hook stops a started
    cluster.
    """
    try:
        yield
    except (Exception, KeyboardInterrupt) as err:
        started = _background_start
        if started is None:
            raise
        if isinstance(err, UserError):
            report_user_error(err)
            status = USER_ERROR_EXIT_CODE
        else:
            traceback.print_exc()
            status = 130 if isinstance(err, KeyboardInterrupt) else 1
        started.abandon()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


@contextlib.contextmanager
def ray_starting_in_background(cluster_cfg: ClusterConfig, *, start: bool = True) -> Iterator[None]:
    """A driver's opening: :func:`start_ray_in_background` (unless ``start`` is false), then the block (the
    driver's heavy imports, data loading and setup, which overlap Ray's start) under
    :func:`exit_at_once_on_user_error`, so that a mistake found before setup takes the start over exits 2 at
    once and stops the Ray processes started so far."""
    if start:
        start_ray_in_background(cluster_cfg)
    with exit_at_once_on_user_error():
        yield


def init_ray(cluster_cfg: ClusterConfig | None = None) -> None:
    """Start or attach to Ray; a no-op when Ray is already initialised in this process.

    With ``RAY_ADDRESS`` set, attach to that cluster (e.g. the one ``ray.sub`` starts on SLURM), presenting the
    token Ray's ``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN(_PATH)`` name; a refused token raises
    :class:`RayAuthenticationError`, which says how to fix it. Otherwise start
    a local Ray with ``max(os.cpu_count(), slots + DRIVER_SIDE_CPUS)`` logical CPUs, ``slots`` being
    ``cluster_cfg.world_size`` (0 without a config): worker processes use one thread each, so logical CPUs may
    outnumber cores. Ray's session files and logs go to ``$NEMO_RL_RAY_TEMP_DIR`` or a per-user temp dir.

    After :func:`start_ray_in_background`, waits for that start instead and raises what it raised. The
    calling (driver) process is left with one torch intra-op thread (see
    :func:`~nemo_rl.distributed.device.configure_driver_threads`).
    """
    global _background_start
    # Imported here: this module stays free of torch so that Ray can start while the driver imports it.
    from nemo_rl.distributed.device import configure_driver_threads

    configure_driver_threads()
    if _background_start is not None:
        started, _background_start = _background_start, None
        started.done.wait()
        if started.error is not None:
            raise started.error
    _init_ray_now(cluster_cfg)


def uncached_bytecode_warning(package: str = "torch") -> str | None:
    """A warning when this interpreter neither caches bytecode nor finds ``package``'s cached, else None.

    Under ``PYTHONDONTWRITEBYTECODE`` Python never writes ``.pyc`` files, so unless the environment was
    installed with its bytecode compiled, every process (the driver and each Ray worker) compiles torch,
    transformers and Ray from source at every start (benchmarks/README.md has the cost). The project's
    ``[tool.uv] compile-bytecode`` makes ``uv sync`` / ``uv run`` compile it; an environment installed some
    other way may lack it.
    """
    if not sys.flags.dont_write_bytecode:
        return None
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None or os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    return (
        f"PYTHONDONTWRITEBYTECODE is set and {package} has no compiled bytecode, so every worker compiles it "
        "from source at start-up (seconds of CPU each): run `uv sync` in the project (its [tool.uv] "
        "compile-bytecode setting compiles the whole environment), or `python -m compileall -q` over "
        "site-packages once for an environment installed otherwise"
    )


def _init_ray_now(cluster_cfg: ClusterConfig | None) -> None:
    if ray.is_initialized():
        return
    if (warning := uncached_bytecode_warning()) is not None:
        logger.warning(warning)
    address = os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("attaching to the Ray cluster at %s", address)
        try:
            ray.init(address=address, runtime_env=job_runtime_env())
        except (AuthenticationError, ConnectionError, RuntimeError) as err:
            if _refused_for_auth(err):
                raise RayAuthenticationError(address) from err
            raise
        return
    slots = cluster_cfg.world_size if cluster_cfg is not None else 0
    num_cpus = max(os.cpu_count() or 1, slots + DRIVER_SIDE_CPUS)
    temp_dir = ray_temp_dir()
    _quiet_local_token_notices()
    logger.info("starting a local Ray with %d logical CPUs, logs in %s", num_cpus, temp_dir)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        _temp_dir=temp_dir,
        # Ray prestarts one idle Python worker per logical CPU for the first driver. Every actor here gets a
        # process of its own (its own runtime environment), so those idle workers are never used and only
        # compete with the real workers' start-up for the cores.
        _system_config={"prestart_worker_first_driver": False},
        runtime_env=job_runtime_env(),
    )
    # Ray's agents can outlive a killed driver by a minute (see nemo_rl.distributed.ray_reaper).
    start_reaper(temp_dir)


# Ray's notices when a local ray.init() turns token authentication on (its default) and, the first time on a
# machine, writes the token to ~/.ray/auth_token. Nothing is asked of the user for a Ray this process starts;
# docs/cluster.md ("Ray token authentication") explains them, and where a token matters (attaching to a
# cluster) a refusal raises RayAuthenticationError instead.
_LOCAL_TOKEN_NOTICES = (
    "Token authentication is enabled for this Ray cluster",
    "Generated new authentication token",
)
_RAY_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DropLocalTokenNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_LOCAL_TOKEN_NOTICES)


def _quiet_local_token_notices() -> None:
    token_logger = logging.getLogger(_RAY_TOKEN_LOGGER)
    if not any(isinstance(f, _DropLocalTokenNotices) for f in token_logger.filters):
        token_logger.addFilter(_DropLocalTokenNotices())


def _refused_for_auth(err: BaseException) -> bool:
    """Whether ``err`` or an error it chains was the cluster refusing this process's token.

    Depending on where the connection fails, Ray raises :class:`AuthenticationError` itself or a
    ``ConnectionError`` whose cause only quotes it in its message (the GCS client's retry loop), so both count.
    """
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, AuthenticationError) or "InvalidAuthToken" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class RayAuthenticationError(UserError):
    """The Ray cluster at ``RAY_ADDRESS`` asks for an authentication token this process does not present."""

    def __init__(self, address: str) -> None:
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        super().__init__(
            f"the Ray cluster at {address} refused this driver's authentication token (RAY_AUTH_MODE={mode}): "
            "export RAY_AUTH_MODE=token and the cluster's token as RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH "
            "(ray.sub does this for every step of its job; a cluster started with `ray start` on a host uses "
            "that host's ~/.ray/auth_token), or start the cluster with RAY_AUTH_MODE=disabled"
        )


def ray_temp_dir() -> str:
    """Where a local Ray started here keeps its sessions: ``$NEMO_RL_RAY_TEMP_DIR`` or :func:`default_ray_temp_dir`."""
    return os.environ.get("NEMO_RL_RAY_TEMP_DIR") or default_ray_temp_dir()


def default_ray_temp_dir() -> str:
    """A short per-user temp dir for Ray's sessions (Ray's socket paths must stay under ~100 characters)."""
    return os.path.join(tempfile.gettempdir(), f"ray_nemo_rl_{os.getuid()}")


def job_runtime_env(**env_vars: str) -> dict[str, object]:
    """The job-level ``runtime_env`` of ``ray.init``: the workers' ``PYTHONPATH`` (:func:`worker_pythonpath`),
    no Hugging Face progress bars in workers (unless the driver's environment asks for them) and
    ``env_vars``, and the collector thresholds of :mod:`nemo_rl.distributed.gc_tuning`, set in every worker
    process before it imports its actor's module."""
    # A worker's "Loading weights" bar reaches the driver's console through Ray's log forwarding as lines
    # full of terminal escapes, one set per worker and model load.
    hub_bars = {"HF_HUB_DISABLE_PROGRESS_BARS": os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1")}
    return {
        "env_vars": {"PYTHONPATH": worker_pythonpath(), **hub_bars, **env_vars},
        "worker_process_setup_hook": WORKER_PROCESS_SETUP_HOOK,
    }


def worker_pythonpath() -> str:
    """``PYTHONPATH`` for Ray workers: the driver's own, plus its ``sys.path`` entries outside the interpreter.

    Ray workers start from the same interpreter but only see the driver's script and working directories;
    modules found through other ``sys.path`` entries (a source checkout, pytest's test directories) would not
    unpickle in workers without this.
    """
    prefixes = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in sys.path:
        path = os.path.realpath(entry or os.curdir)
        if os.path.isdir(path) and not path.startswith(prefixes) and path not in entries:
            entries.append(path)
    return os.pathsep.join(entries)
