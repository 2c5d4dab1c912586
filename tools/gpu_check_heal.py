"""The healing stage of ``tools/gpu_check.sh``: a GRPO run on one GPU whose generation worker is SIGKILLed after
step 1 must replace it (on the GPU its predecessor held), refit it, and finish with exit 0.

``embedded``: the embedded engine in a worker of its own, colocated with the policy on the GPU. ``vllm``: vLLM,
colocated (the replacement builds its engine, with its share of the GPU's memory, while the policy sleeps).
``--cpu`` runs ``embedded`` on two CPU worker slots (generation on a slot of its own), to try the script on any
machine.

Exit status: 0 when the run healed and finished, 77 when it cannot run here (the reason on the last line), 1
when it failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = 77
STEPS = 4
TIMEOUT_S = 400.0
WORKER_TITLES = {"embedded": "ray::EmbeddedGenerationWorker", "vllm": "ray::VllmGenerationWorker"}


def _command(backend: str, out: Path, cpu: bool) -> list[str]:
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo_math.py"),
        "--config",
        str(ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"),
        f"grpo.max_num_steps={STEPS}",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        f"logger.log_dir={out / 'logs'}",
        "logger.progress_bar=false",
        "logger.plot_metrics=[]",
        f"policy.generation.backend={backend}",
        "policy.generation.embedded_cfg.in_policy_workers=false",
        "policy.generation.vllm_cfg.precision=float32",
        "cluster.single_process=false",
    ]
    if cpu:
        cmd += [
            "cluster.gpus_per_node=2",
            "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.gpus_per_node=1",
        ]
    else:
        cmd += ["cluster.gpus_per_node=1"]
    return cmd


def _worker_pids(ray_dir: Path, title: str) -> list[int]:
    pids = []
    for log in (ray_dir / "session_latest" / "logs").glob("python-core-worker-*_*.log"):
        pid = int(log.stem.rpartition("_")[2])
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().startswith(title):
                pids.append(pid)
        except FileNotFoundError:
            continue
    return pids


def _step_logged(log_dir: Path, step: int) -> bool:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step") == step and "train/loss" in record:
            return True
    return False


def check(backend: str, cpu: bool) -> int:
    out = Path(tempfile.mkdtemp(prefix=f"gpu_check_heal_{backend}_"))
    ray_dir = Path(tempfile.mkdtemp(prefix="ray_heal_"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NEMO_RL_RAY_TEMP_DIR": str(ray_dir)}
    proc = subprocess.Popen(
        _command(backend, out, cpu), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not _step_logged(out / "logs", 1):
            if proc.poll() is not None or time.monotonic() > deadline:
                print((proc.communicate()[0] or b"").decode()[-4000:])
                print("the run ended (or timed out) before step 1 was logged")
                return 1
            time.sleep(0.1)
        pids = _worker_pids(ray_dir, WORKER_TITLES[backend])
        if len(pids) != 1:
            print(f"expected one {WORKER_TITLES[backend]} process, found {pids}")
            return 1
        os.kill(pids[0], signal.SIGKILL)
        text = proc.communicate(timeout=TIMEOUT_S)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(ray_dir, ignore_errors=True)
    print(text[-4000:])
    steps = {}
    for line in (out / "logs" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record)
    replaced = sum(m.get("train/generation/replaced_workers", 0.0) for m in steps.values())
    trained = sorted(s for s, m in steps.items() if "train/loss" in m)
    if (
        proc.returncode != 0
        or "replaced on its slot and refitted" not in text
        or trained != list(range(1, STEPS + 1))
    ):
        print(f"exit {proc.returncode}, steps trained {trained}, replaced {replaced}: the run did not heal")
        return 1
    print(f"{backend}: generation worker killed after step 1, replaced and refitted; {STEPS} steps, exit 0")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=sorted(WORKER_TITLES))
    parser.add_argument("--cpu", action="store_true", help="two CPU worker slots, no GPU")
    args = parser.parse_args()
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA GPU (torch.cuda.is_available() is False)")
            return SKIP
    if args.cpu and args.backend != "embedded":
        print("--cpu runs the embedded backend only")
        return SKIP
    return check(args.backend, args.cpu)


if __name__ == "__main__":
    sys.exit(main())
