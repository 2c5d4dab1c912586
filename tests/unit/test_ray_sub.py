"""ray.sub's logic with stand-in SLURM commands: what each step is launched with, bad input, token, signals.

The stand-ins (``srun``, ``scontrol``, ``squeue``, ``scancel``) record their arguments; a Ray node step
"starts" by writing the file ``ray.sub`` waits for and then waits for SIGTERM, so the script runs end to
end in a second, without SLURM, Ray or pyxis. This is where container mode (which needs pyxis) is checked;
tests/functional/test_slurm.py runs the script under a real SLURM.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_SRUN = r"""#!/bin/bash
# Records its arguments; plays the step named by -J.
printf '%s\t' "$@" >> "$FAKE_CALLS"; echo >> "$FAKE_CALLS"
name=""; prev=""
for a in "$@"; do [[ $prev == -J ]] && name=$a; prev=$a; done
case $name in
  ray-head) touch "$LOG_DIR/ray-up-0" "$LOG_DIR/STARTED_RAY_HEAD"; echo "4242.0 ray-head $$" >> "$FAKE_STEPS" ;;
  ray-worker) n=$(wc -w <<< "$FAKE_NODES"); for ((i = 1; i < n; i++)); do touch "$LOG_DIR/ray-up-$i"; done
              echo "4242.1 ray-worker $$" >> "$FAKE_STEPS" ;;
  driver) exit "${FAKE_DRIVER_STATUS:-0}" ;;
  *) exit 0 ;;
esac
trap 'echo "$name stopped" >> "$FAKE_CALLS"; exit 0' TERM
while :; do sleep 0.05; done
"""

FAKE_SCONTROL = r"""#!/bin/bash
if [[ $1 == show && $2 == hostnames ]]; then tr ' ' '\n' <<< "$FAKE_NODES"; exit 0; fi
if [[ $1 == show && $2 == node ]]; then
  echo "NodeName=$3 CPUTot=${FAKE_CPUS:-16} Gres=${FAKE_GRES:-(null)} NodeAddr=$3 State=IDLE"; exit 0
fi
exit 1
"""

# Running steps, one "<step id> <name> [pid]" line each; a step with a pid is listed while that process lives.
FAKE_SQUEUE = r"""#!/bin/bash
[[ -f $FAKE_STEPS ]] || exit 0
while read -r id name pid; do
  if [[ -z $pid ]] || kill -0 "$pid" 2>/dev/null; then echo "$id $name"; fi
done < "$FAKE_STEPS"
"""

# scancel --signal=TERM STEP: SIGTERM to that step's process, and the step is gone.
FAKE_SCANCEL = r"""#!/bin/bash
printf 'scancel\t%s\n' "$*" >> "$FAKE_CALLS"
step=${!#}
pid=$(awk -v s="$step" '$1 == s {print $3}' "$FAKE_STEPS")
if [[ -n $pid ]]; then kill -TERM "$pid"; fi
awk -v s="$step" '$1 != s' "$FAKE_STEPS" > "$FAKE_STEPS.new" && mv "$FAKE_STEPS.new" "$FAKE_STEPS"
exit 0
"""


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """Environment of a 2-node job with stand-in SLURM commands first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (
        ("srun", FAKE_SRUN),
        ("scontrol", FAKE_SCONTROL),
        ("squeue", FAKE_SQUEUE),
        ("scancel", FAKE_SCANCEL),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    submit = tmp_path / "submit"
    (submit / ".venv" / "bin").mkdir(parents=True)
    ray = submit / ".venv" / "bin" / "ray"
    ray.write_text("#!/bin/sh\n")
    ray.chmod(0o755)
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "UV_PROJECT"))}
    return {
        **keep,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[1-2]",
        "SLURM_SUBMIT_DIR": str(submit),
        "FAKE_NODES": "gpu1 gpu2",
        "FAKE_CALLS": str(tmp_path / "calls"),
        "FAKE_STEPS": str(tmp_path / "steps"),
    }


def _run(env: dict[str, str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "ray.sub")],
        cwd=env["SLURM_SUBMIT_DIR"],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _calls(env: dict[str, str]) -> list[list[str]]:
    return [
        line.split("\t")[:-1] for line in Path(env["FAKE_CALLS"]).read_text().splitlines() if "\t" in line
    ]


def _step(calls: list[list[str]], name: str) -> list[str]:
    (call,) = [c for c in calls if "-J" in c and c[c.index("-J") + 1] == name]
    return call


def test_container_batch_mode_launches_every_step_in_the_image(slurm: dict[str, str]) -> None:
    result = _run(
        slurm,
        COMMAND="python examples/run_grpo_math.py",
        CONTAINER="registry/nemo-rl:latest",
        MOUNTS="/shared:/shared",
        FAKE_GRES="gpu:h100:8(S:0-1)",
        FAKE_DRIVER_STATUS="3",
    )
    assert result.returncode == 3, result.stderr  # the driver's status
    log_dir = Path(slurm["SLURM_SUBMIT_DIR"]) / "4242-logs"
    calls = _calls(slurm)
    head, worker, driver = _step(calls, "ray-head"), _step(calls, "ray-worker"), _step(calls, "driver")
    for call, container in ((head, "ray-head"), (worker, "ray-worker"), (driver, "ray-head")):
        assert "--container-image=registry/nemo-rl:latest" in call
        assert f"--container-mounts=/shared:/shared,{log_dir}:{log_dir}" in call
        assert f"--container-name={container}" in call and "--no-container-mount-home" in call
    # GPUs from the node's GRES, CPUs from CPUTot; the head on the first node, the workers elsewhere.
    for call in (head, worker):
        assert "--gres=gpu:8" in call and "--cpus-per-task=16" in call
    assert head[head.index("-w") + 1] == "gpu1" and "--exclude=gpu1" in worker
    assert "--overlap" in driver and driver[driver.index("-w") + 1] == "gpu1"
    node_env = (log_dir / "ray-env.sh").read_text()
    assert "RAY_ADDRESS=gpu1:1200" in node_env and "VIRTUAL_ENV" not in node_env  # the image's environment
    # Both Ray steps were stopped when the driver ended.
    text = Path(slurm["FAKE_CALLS"]).read_text()
    assert "ray-head stopped" in text and "ray-worker stopped" in text


def test_no_container_mode_uses_the_submit_dirs_environment_and_a_private_token(
    slurm: dict[str, str],
) -> None:
    result = _run(slurm, COMMAND="true", GPUS_PER_NODE="0", RAY_NUM_CPUS="8")
    assert result.returncode == 0, result.stderr
    log_dir = Path(slurm["SLURM_SUBMIT_DIR"]) / "4242-logs"
    calls = _calls(slurm)
    assert not any(a.startswith("--container") for c in calls for a in c)
    assert not any(a.startswith("--gres") for c in calls for a in c)
    token = log_dir / "ray_auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and re.fullmatch(r"[0-9a-f]{64}", token.read_text())
    node_env = (log_dir / "ray-env.sh").read_text()
    venv = Path(slurm["SLURM_SUBMIT_DIR"]) / ".venv"
    assert f"VIRTUAL_ENV={venv}" in node_env and f"RAY_AUTH_TOKEN_PATH={token}" in node_env
    assert "RAY_AUTH_MODE=token" in node_env
    # The node script gets the job's settings through the environment srun passes on.
    node_script = (log_dir / "ray-node.sh").read_text()
    assert "--num-cpus=" in node_script and "ray start" in node_script


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"PORT": "12x"}, "PORT must be a whole number"),
        ({"MOUNTS": "/a:/a"}, "MOUNTS is set but CONTAINER is not"),
        ({"RAY_AUTH_MODE": "none"}, "RAY_AUTH_MODE must be 'token' or 'disabled'"),
        ({"VENV_DIR": "/nonexistent"}, "no Python environment with Ray at /nonexistent"),
        ({"INCLUDE_DASHBOARD": "yes"}, "INCLUDE_DASHBOARD must be 0 or 1"),
    ],
)
def test_bad_settings_fail_at_once_with_the_fix(
    slurm: dict[str, str], settings: dict[str, str], message: str
) -> None:
    result = _run(slurm, COMMAND="true", **settings)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not Path(slurm["FAKE_CALLS"]).exists(), "no step may start after a settings error"


def test_outside_slurm_it_says_how_to_submit(slurm: dict[str, str]) -> None:
    env = {k: v for k, v in slurm.items() if k != "SLURM_JOB_ID"}
    result = _run(env)
    assert result.returncode == 2 and "sbatch ray.sub" in result.stderr


def test_attach_mode_writes_the_attach_script_and_a_time_limit_signal_stops_drivers_first(
    slurm: dict[str, str],
) -> None:
    submit = Path(slurm["SLURM_SUBMIT_DIR"])
    proc = subprocess.Popen(
        ["bash", str(ROOT / "ray.sub")],
        cwd=submit,
        env={**slurm, "RAY_AUTH_MODE": "disabled"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    attach = submit / "4242-attach.sh"
    deadline = time.monotonic() + 30
    while not attach.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert attach.exists(), proc.communicate(timeout=10)[0]
    time.sleep(0.3)  # the script is in its idle loop
    text = attach.read_text()
    assert "--jobid=4242" in text and "-J attach" in text and "--pty bash" in text
    assert "RAY_AUTH_TOKEN" not in (submit / "4242-logs" / "ray-env.sh").read_text()
    # An attached driver step runs next to the Ray steps; SLURM's time-limit warning arrives.
    with open(slurm["FAKE_STEPS"], "a") as steps:
        steps.write("4242.3 attach\n4242.batch batch\n")
    proc.send_signal(signal.SIGUSR1)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    calls = Path(slurm["FAKE_CALLS"]).read_text().splitlines()
    # The driver first, then the Ray steps (through SLURM, not by signalling the srun clients).
    assert calls.index("scancel\t--signal=TERM 4242.3") < calls.index("scancel\t--signal=TERM 4242.0")
    assert calls.index("scancel\t--signal=TERM 4242.0") < calls.index("ray-head stopped")
    assert "scancel\t--signal=TERM 4242.1" in calls and "ray-worker stopped" in calls
    assert "received SIGUSR1" in output


def test_node_stop_finds_descendants_whose_environment_lost_the_mark(tmp_path: Path) -> None:
    """Ray's agents rename themselves with setproctitle, which blanks the start of their environment (the
    node's mark included): the node's stop must still find them, as descendants of a marked process."""
    script = (ROOT / "ray.sub").read_text()
    function = re.search(r"^marked_pids\(\) \{\n.*?^\}\n", script, re.S | re.M)
    assert function is not None, "ray.sub's node script no longer defines marked_pids"
    (tmp_path / "marked_pids.sh").write_text(function.group(0))
    # A marked shell whose child and grandchild run with an empty environment (no mark), and an unmarked sleeper.
    tree = subprocess.Popen(
        [
            "env",
            "RAY_SUB_NODE=77.0",
            "bash",
            "-c",
            'env -i bash -c "sleep 60 & wait" & env -i sleep 60 & wait',
        ],
        start_new_session=True,
    )
    outsider = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        expected: set[str] = set()
        # The shell, its two children and one grandchild.
        while len(expected) < 4 and time.monotonic() < deadline:
            expected = _session_members(tree.pid)
        assert len(expected) == 4, expected
        found = subprocess.run(
            ["bash", "-c", f"source {tmp_path / 'marked_pids.sh'}; marked_pids"],
            env={**os.environ, "MARK": "RAY_SUB_NODE=77.0"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert set(found.stdout.split()) == expected
        assert str(outsider.pid) not in found.stdout.split()
    finally:
        os.killpg(tree.pid, signal.SIGKILL)
        outsider.kill()
        tree.wait(timeout=10)
        outsider.wait(timeout=10)


def _session_members(session: int) -> set[str]:
    """Live processes of a session (field 6 of /proc/PID/stat, after the parenthesised command name)."""
    members = set()
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session:
            members.add(stat_file.parent.name)
    return members
