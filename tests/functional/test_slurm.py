"""`sbatch ray.sub` on a real SLURM (Debian's slurmctld/slurmd, two slurmd on this host as two nodes).

`tools/slurm/local_cluster.sh` starts the daemons, a cluster of this module's own; this module needs root and
SLURM's Debian packages (`tools/slurm/local_cluster.sh install`, which CI runs) and skips otherwise. Every job runs from a fresh clone of this checkout (plus its uncommitted changes) with
its own `uv sync --locked` environment, as a user would submit it:

- batch mode: tiny GRPO for 2 steps across both nodes, its metrics, checkpoint and per-node logs;
- attach mode, two one-node jobs at once (their own ports): a driver started through
  `<jobid>-attach.sh` attaches with the job's token, starts actors that map refit-style shared-memory
  segments, and trains with nemo_rl's stop check (the one GRPO and SFT use). In one job the time-limit
  warning (`scancel --batch --signal=USR1`) reaches it: it stops after its step and the job ends by
  itself. The other is cancelled with a plain `scancel`, after a driver without the token was refused.

After each job: no process whose environment carries the job id, no Ray temp directory, no segment.
(That SIGTERM makes GRPO save a checkpoint after its step is checked by tests/unit/test_timer.py and
the GRPO loop's use of the same check.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
LOCAL_CLUSTER = ROOT / "tools" / "slurm" / "local_cluster.sh"
JOB_TIMEOUT_S = 600

GRPO = (
    "uv run python examples/run_grpo_math.py --config examples/configs/grpo_math_tiny.yaml "
    "grpo.num_prompts_per_step=4 grpo.num_generations_per_prompt=4 grpo.val_at_start=false grpo.val_period=0 "
    "policy.train_global_batch_size=16 policy.train_micro_batch_size=8 policy.logprob_batch_size=8 "
    "logger.progress_bar=false cluster.gpus_per_node=1"
)


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kwargs.pop("timeout", 120), **kwargs)


def _free_port_run(length: int) -> int:
    """The first of ``length`` consecutive TCP ports that are free now (slurmctld's, then one per slurmd)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("", 0))
            first = probe.getsockname()[1]
        if first + length > 65535:
            continue
        try:
            with contextlib.ExitStack() as bound:
                for port in range(first, first + length):
                    bound.enter_context(socket.socket()).bind(("", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {length} consecutive free TCP ports")


def _own_slurm_env(tmp: Path, munge_dir: Path) -> dict[str, str]:
    """Where this module's SLURM lives: its own config, state, munged and ports, beside any other SLURM."""
    ctld_port = _free_port_run(3)
    return {
        "SLURM_CONF": str(tmp / "etc" / "slurm.conf"),
        "SLURM_LOCAL_DIR": str(tmp / "state"),
        "SLURM_LOCAL_CTLD_PORT": str(ctld_port),
        "SLURM_LOCAL_PORT": str(ctld_port + 1),
        "SLURM_LOCAL_MUNGE_DIR": str(munge_dir),
        # Job ids name the jobs' Ray temp directories and ports (ray.sub): apart from another cluster's 1, 2, ...
        "SLURM_LOCAL_FIRST_JOB_ID": str(ctld_port * 10),
    }


@pytest.fixture(scope="module")
def slurm_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A two-node SLURM of this module's own (:func:`_own_slurm_env`), whatever else runs on the machine; its
    clients find it through ``SLURM_CONF``, set in this process's environment while the module runs. Its
    daemons, munged included, are stopped at the end, also when they failed to start."""
    if os.geteuid() != 0:
        pytest.skip("starting SLURM daemons needs root (tools/slurm/local_cluster.sh)")
    missing = [name for name in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(name) is None]
    if missing:
        # The suite installs no system packages; CI's extras lane does (docs/testing.md).
        pytest.skip(
            f"SLURM is not installed ({', '.join(missing)} missing): tools/slurm/local_cluster.sh install"
        )
    # munged runs as the munge user, which cannot enter pytest's private temporary folders.
    munge_dir = Path(tempfile.mkdtemp(prefix="nemo_rl_munge_", dir="/run" if os.path.isdir("/run") else None))
    env = _own_slurm_env(tmp_path_factory.mktemp("slurm_cluster"), munge_dir)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        up = _run(["bash", str(LOCAL_CLUSTER), "start", "--nodes", "2"], timeout=600)
        assert up.returncode == 0, f"local SLURM did not start:\n{up.stdout}\n{up.stderr}"
        nodes = _run(["sinfo", "-h", "-N", "-o", "%N"]).stdout.split()
        yield sorted(set(nodes))
    finally:
        stop = _run(["bash", str(LOCAL_CLUSTER), "stop"])
        shutil.rmtree(munge_dir, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        assert stop.returncode == 0, f"local SLURM did not stop:\n{stop.stdout}\n{stop.stderr}"


# What the jobs' processes import: the driver, Ray's workers, the policy, generation and environment actors.
WARM_IMPORTS = (
    "import ray._private.workers.default_worker, nemo_rl.algorithms.grpo, nemo_rl.models.policy.dtensor_worker, "
    "nemo_rl.models.generation.embedded.worker, nemo_rl.environments.math_environment"
)


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh clone of this checkout, with its uncommitted changes, and its own locked environment."""
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    dest = tmp_path_factory.mktemp("slurm") / "repo"
    assert _run(["git", "clone", "--quiet", str(ROOT), str(dest)]).returncode == 0
    diff = _run(["git", "diff", "HEAD", "--binary"], cwd=ROOT).stdout
    if diff:
        applied = subprocess.run(["git", "apply", "--allow-empty", "-"], cwd=dest, input=diff, text=True)
        assert applied.returncode == 0
    untracked = _run(["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT).stdout.split()
    for name in untracked:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    # Without the project's [tool.uv] compile-bytecode: compiling all of site-packages takes about a minute
    # on two cores, while the jobs need the bytecode of a few modules only, written here by importing them
    # once (_job_env keeps the jobs' `uv run` from syncing, and so compiling, again). CI's own sync compiles
    # as a user's does.
    sync = _run(
        [uv, "sync", "--locked", "--quiet", "--no-compile-bytecode"], cwd=dest, env=_job_env(), timeout=900
    )
    assert sync.returncode == 0, sync.stderr[-3000:]
    warm = _run([str(dest / ".venv" / "bin" / "python"), "-c", WARM_IMPORTS], cwd=dest, env=_job_env())
    assert warm.returncode == 0, warm.stderr[-3000:]
    return dest


def _job_env(**extra: str) -> dict[str, str]:
    """The submitting shell: this process's environment without its own virtual environment, Ray session,
    PYTHONDONTWRITEBYTECODE or UV_COMPILE_BYTECODE (CI exports it, and uv refuses it beside the clone's
    `--no-compile-bytecode`)."""
    skip = ("VIRTUAL_ENV", "RAY_ADDRESS", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "UV_COMPILE_BYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in skip}
    venv_bin = str(Path(sys.prefix) / "bin")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv:
        path.insert(0, str(Path(uv).parent))
    env["PATH"] = os.pathsep.join(path)
    env.update(
        PYTHONUNBUFFERED="1",
        # The clone's environment is synced (the fixture) and compiles its bytecode lazily.
        UV_NO_SYNC="1",
        INCLUDE_DASHBOARD="0",
        RAY_NUM_CPUS="4",
        # Ray's raylet gives its agents a fixed 15 s to start, which a busy 2-core machine can miss: retry.
        NUM_RETRIES="8",
        WORKER_NUM_RETRIES="10",
        CLUSTER_READY_TIMEOUT_S="600",
    )
    env.update(extra)
    return env


def _sbatch(clone: Path, nodes: int, **env: str) -> str:
    result = _run(
        ["sbatch", "--parsable", f"--nodes={nodes}", f"--chdir={clone}", str(clone / "ray.sub")],
        cwd=clone,
        env=_job_env(**env),
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def _job(job_id: str) -> dict[str, str]:
    line = _run(["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(re.findall(r"(\w+)=(\S*)", line))


def _wait_until_ended(job_id: str, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = _job(job_id)
        if info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None):
            return info
        _skip_if_ray_cannot_start(Path(info.get("WorkDir", ".")), job_id, ended=False)
        time.sleep(0.5)
    _run(["scancel", job_id])
    pytest.fail(f"job {job_id} still running after {timeout_s:.0f} s")


def _agent_timeouts(clone: Path, job_id: str) -> list[Path]:
    """Ray start attempts of the job whose raylet gave up on its agents after Ray's fixed 15 s."""
    logs = (clone / f"{job_id}-logs" / "ray").glob("*/raylet.out")
    return [p for p in logs if "Timed out waiting for file" in p.read_text(errors="replace")]


def _skip_if_ray_cannot_start(clone: Path, job_id: str, ended: bool) -> None:
    """Skip (not fail) when Ray keeps failing on its fixed 15 s wait for its agents: a machine too busy.

    Three such attempts while the cluster is still coming up are enough to tell (each takes a minute then);
    after the job ended, its start error plus such attempts. Any other reason a node did not come up, and
    anything after the cluster is up, is a failure.
    """
    timeouts = _agent_timeouts(clone, job_id)
    out_file = clone / f"ray-{job_id}.out"
    out = out_file.read_text() if out_file.exists() else ""
    start_error = "Ray did not start on the head node" in out or "nodes joined the Ray cluster within" in out
    cluster_up = "joined the Ray cluster at" in out
    if (ended and start_error and timeouts) or (not ended and not cluster_up and len(timeouts) >= 3):
        _run(["scancel", job_id])
        _TOO_BUSY.append(
            f"job {job_id}: Ray's raylet gave up on its agents after its fixed 15 s in {len(timeouts)} start "
            f"attempts (this machine is too busy to start Ray); see {timeouts[0]}"
        )
        pytest.skip(_TOO_BUSY[-1])


# Set once a job found the machine too busy to start Ray: the later jobs would only repeat the wait.
_TOO_BUSY: list[str] = []


@pytest.fixture(autouse=True)
def _skip_when_too_busy() -> None:
    if _TOO_BUSY:
        pytest.skip(_TOO_BUSY[0])


def _wait_for(predicate: Any, what: str, job_id: str, timeout_s: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        clone = Path(_job(job_id).get("WorkDir", "."))
        if _job(job_id).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            _skip_if_ray_cannot_start(clone, job_id, ended=True)
            pytest.fail(f"job {job_id} ended before {what}")
        _skip_if_ray_cannot_start(clone, job_id, ended=False)
        if time.monotonic() > deadline:
            _run(["scancel", job_id])
            pytest.fail(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.3)


def _metrics(log_dir: Path) -> dict[int, dict[str, Any]]:
    by_step: dict[int, dict[str, Any]] = {}
    path = log_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_step.setdefault(record["step"], {}).update(record)
    return by_step


def _processes_of(job_id: str) -> list[str]:
    """Live processes started by the job (SLURM exports SLURM_JOB_ID to every step; Ray keeps its environment)."""
    marks = (f"SLURM_JOB_ID={job_id}".encode(), f"RAY_SUB_NODE={job_id}.".encode())
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(entry == marks[0] or entry.startswith(marks[1]) for entry in environ):
            found.append(f"{proc.name}: {cmdline[:160]}")
    return found


def _assert_nothing_left(job_id: str) -> None:
    # The node's stop gives Ray RAY_STOP_GRACE_S, then SIGKILLs; the watchdog repeats it if SLURM killed the
    # node script first. A minute covers both on a busy machine.
    deadline = time.monotonic() + 60
    while (left := _processes_of(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"job {job_id} left processes behind:\n" + "\n".join(left)
    assert not list(Path("/tmp").glob(f"ray-{job_id}-*")), "Ray temp directories were left in /tmp"


def test_batch_mode_runs_tiny_grpo_on_two_nodes(slurm_nodes: list[str], clone: Path) -> None:
    run_dir = clone / "runs" / "batch"
    command = (
        f"{GRPO} grpo.max_num_steps=2 cluster.num_nodes={len(slurm_nodes)} "
        f"logger.log_dir={run_dir / 'logs'} checkpointing.checkpoint_dir={run_dir / 'ckpt'}"
    )
    job_id = _sbatch(clone, len(slurm_nodes), COMMAND=command)
    info = _wait_until_ended(job_id)
    out = (clone / f"ray-{job_id}.out").read_text()
    logs = clone / f"{job_id}-logs"
    driver = (logs / "ray-driver.log").read_text() if (logs / "ray-driver.log").exists() else ""
    if info["JobState"] != "COMPLETED":
        _skip_if_ray_cannot_start(clone, job_id, ended=True)
    assert info["JobState"] == "COMPLETED", f"{info}\n{out[-3000:]}\n{driver[-5000:]}"
    assert (
        f"all {len(slurm_nodes)} nodes joined the Ray cluster" in out
        and "COMMAND exited with status 0" in out
    )
    assert "GRPO finished at step 2" in driver, driver[-3000:]

    metrics = _metrics(run_dir / "logs")
    for step in (1, 2):
        for name in ("train/loss", "train/reward", "timing/train/total_step_time"):
            assert name in metrics[step], f"{name} missing at step {step}: {sorted(metrics[step])}"
    assert metrics[2]["refit/bytes"] > 0
    assert (run_dir / "ckpt" / "step_2" / "training_info.json").exists()

    # One log per node; the token is the job's own, readable by its owner only.
    assert (logs / "ray-head.log").exists() and len(list(logs.glob("ray-worker-*.log"))) == len(
        slurm_nodes
    ) - 1
    token = logs / "ray_auth_token"
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    assert f"RAY_AUTH_TOKEN_PATH={token}" in (logs / "ray-env.sh").read_text()
    assert "Ray is up" in (logs / "ray-head.log").read_text()
    _assert_nothing_left(job_id)


def _ports(offset: int) -> dict[str, str]:
    """All of ray.sub's port variables, moved by ``offset`` so two jobs can share a host."""
    defaults = {
        "PORT": 1200,
        "RAY_CLIENT_SERVER_PORT": 1201,
        "DASHBOARD_PORT": 8265,
        "NODE_MANAGER_PORT": 1301,
        "OBJECT_MANAGER_PORT": 1303,
        "RUNTIME_ENV_AGENT_PORT": 1305,
        "DASHBOARD_AGENT_GRPC_PORT": 1307,
        "METRICS_EXPORT_PORT": 1309,
        "DASHBOARD_AGENT_LISTEN_PORT": 1311,
        "MIN_WORKER_PORT": 2000,
        "MAX_WORKER_PORT": 2999,
    }
    return {name: str(port + offset) for name, port in defaults.items()}


# An attached driver: Ray actors that map shared-memory segments named like the refit's, then a training
# loop that stops the way GRPO's does (TimeoutChecker.stop_on_signals).
DRIVER = """
import mmap, os, sys, time
import ray
from nemo_rl.distributed.ray_start import init_ray
from nemo_rl.utils.timer import TimeoutChecker

init_ray()
print("cpus", int(ray.cluster_resources()["CPU"]), flush=True)

@ray.remote(num_cpus=1)
class Holder:
    def hold(self, name):
        fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 1 << 20)
        self.segment = mmap.mmap(fd, 1 << 20)
        return os.getpid()

holders = [Holder.remote() for _ in range(2)]
pids = ray.get([h.hold.remote(f"nemo_rl_refit_test{JOB}_{i}") for i, h in enumerate(holders)], timeout=300)
checker = TimeoutChecker(None, fit_last_save_time=True)
checker.stop_on_signals()
step = 0
print("training", pids, flush=True)
while not checker.check_save():
    step += 1
    time.sleep(0.2)
print(f"{checker.stop_reason}: stopping after step {step}", flush=True)
"""


@pytest.fixture(scope="module")
def attached(slurm_nodes: list[str], clone: Path) -> Iterator[dict[str, tuple[str, subprocess.Popen[str]]]]:
    """Two attach-mode jobs, one per node, each running DRIVER through its attach script."""
    if _TOO_BUSY:
        pytest.skip(_TOO_BUSY[0])
    jobs: dict[str, str] = {}
    drivers: dict[str, tuple[str, subprocess.Popen[str]]] = {}
    try:
        # One after the other: a Ray start is the slow part on a busy machine, the rest overlaps.
        for name, node, offset in (("usr1", slurm_nodes[0], 3000), ("scancel", slurm_nodes[-1], 4000)):
            result = _run(
                [
                    "sbatch",
                    "--parsable",
                    "--nodes=1",
                    f"--nodelist={node}",
                    f"--chdir={clone}",
                    str(clone / "ray.sub"),
                ],
                cwd=clone,
                env=_job_env(**_ports(offset)),
            )
            assert result.returncode == 0, result.stderr
            job_id = jobs[name] = result.stdout.strip().split(";")[0]
            attach = clone / f"{job_id}-attach.sh"
            _wait_for(attach.exists, "attach script", job_id)
            script = clone / f"driver_{job_id}.py"
            script.write_text(DRIVER.replace("{JOB}", job_id))
            proc = subprocess.Popen(
                ["bash", str(attach)],
                cwd=clone,
                env=_job_env(COMMAND=f"python {script}"),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            drivers[name] = (job_id, proc)
        for job_id in jobs.values():
            segments = _segments(job_id)
            _wait_for(
                lambda s=segments: all(p.exists() for p in s), "segments of the attached driver", job_id
            )
        yield drivers
    finally:
        for _, proc in drivers.values():
            proc.kill()
        for job_id in jobs.values():
            _run(["scancel", job_id])


def _segments(job_id: str) -> list[Path]:
    return [Path(f"/dev/shm/nemo_rl_refit_test{job_id}_{i}") for i in range(2)]


def test_time_limit_warning_stops_the_attached_driver_after_its_step(
    attached: dict[str, tuple[str, subprocess.Popen[str]]], clone: Path
) -> None:
    job_id, driver = attached["usr1"]
    # What SLURM sends ray.sub 300 s before the time limit (#SBATCH --signal=B:USR1@300).
    assert _run(["scancel", "--batch", "--signal=USR1", job_id]).returncode == 0
    output, _ = driver.communicate(timeout=180)
    assert driver.returncode == 0, output[-3000:]
    assert "cpus 4" in output  # attached to this job's cluster (RAY_NUM_CPUS) with the job's token
    assert re.search(r"SIGTERM received: stopping after step \d+", output), output[-3000:]
    info = _wait_until_ended(job_id, timeout_s=120)
    assert info["JobState"] == "COMPLETED", info
    out = (clone / f"ray-{job_id}.out").read_text()
    assert "received SIGUSR1" in out and f"driver steps ended: {job_id}." in out, out[-2000:]
    _assert_nothing_left(job_id)
    assert not [s for s in _segments(job_id) if s.exists()], "the job left shared-memory segments"


def test_scancel_leaves_no_process_directory_or_segment(
    attached: dict[str, tuple[str, subprocess.Popen[str]]], clone: Path
) -> None:
    job_id, driver = attached["scancel"]
    address = re.search(r"RAY_ADDRESS=(\S+)", (clone / f"{job_id}-logs" / "ray-env.sh").read_text())
    assert address
    # Without the job's token the cluster refuses a driver, which says how to fix it.
    refused = _run(
        [
            str(clone / ".venv" / "bin" / "python"),
            "-c",
            "from nemo_rl.config.cli import run_cli; from nemo_rl.distributed.ray_start import init_ray; "
            "run_cli(init_ray)",
        ],
        cwd=clone,
        env={**_job_env(), "RAY_ADDRESS": address.group(1)},
        timeout=180,
    )
    assert refused.returncode == 2 and "RAY_AUTH_MODE=token" in refused.stderr, refused.stderr[-3000:]

    assert _run(["scancel", job_id]).returncode == 0
    _wait_until_ended(job_id, timeout_s=120)
    driver.wait(timeout=60)
    _assert_nothing_left(job_id)
    assert not [s for s in _segments(job_id) if s.exists()], "the cancelled job left shared-memory segments"
