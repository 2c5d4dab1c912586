"""``grpo.setup`` starts vLLM before the policy and, when colocated, puts it to sleep first (the order
``nemo_rl.models.generation.factory.start_policy_and_generation`` decides).

vLLM refuses to start unless ``gpu_memory_utilization`` of the GPU is free, so a policy holding a large part
of the GPU (an 8B model with its optimizer) must load after the engines have started and slept. The embedded
engine has no such constraint: its workers and the policy's start together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nemo_rl.algorithms.grpo as grpo
import nemo_rl.algorithms.run_build as run_build
import nemo_rl.models.generation.factory as factory
from nemo_rl.config.master import GRPOMasterConfig


class _PolicyStarted(Exception):
    """Stops setup once the policy would start: nothing after it matters here."""


@pytest.mark.parametrize("backend", ["vllm", "embedded"])
@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "not_colocated"])
def test_generation_starts_first_and_sleeps_when_colocated(
    colocated: bool, backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    events = _setup_events(monkeypatch, tmp_path, backend, colocated, in_policy=False)
    if colocated and backend == "vllm":
        assert events == ["generation on [0, 1]", "generation sleeps", "policy on [0, 1]"]
    elif colocated:
        # The embedded engine sleeps once both groups are up (here the policy's start ends the test first).
        assert events == ["generation on [0, 1]", "policy on [0, 1]"]
    else:
        assert events == ["generation on [1]", "policy on [0]"]


def test_engines_in_the_policy_workers_start_no_generation_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert _setup_events(monkeypatch, tmp_path, "embedded", True, in_policy=True) == ["policy on [0, 1]"]


def _setup_events(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, backend: str, colocated: bool, *, in_policy: bool
) -> list[str]:
    """What ``grpo.setup`` starts, in order, up to the policy's start."""
    events: list[str] = []

    class FakeGeneration:
        def finish_generation(self) -> None:
            events.append("generation sleeps")

    def create_generation(*args: Any, bundle_indices: list[int], **kwargs: Any) -> FakeGeneration:
        events.append(f"generation on {bundle_indices}")
        return FakeGeneration()

    def policy(*args: Any, bundle_indices: list[int], **kwargs: Any) -> None:
        events.append(f"policy on {bundle_indices}")
        raise _PolicyStarted

    # Groups that start together are waited for when the block ends; the fakes have nothing to wait for.
    started_together: list[bool] = []

    @contextlib.contextmanager
    def start_together(enabled: bool = True) -> Iterator[None]:
        started_together.append(enabled)
        yield

    monkeypatch.setattr(run_build, "init_ray", lambda cluster_cfg: None)
    monkeypatch.setattr(run_build, "RayVirtualCluster", lambda *args, **kwargs: object())
    monkeypatch.setattr(factory, "create_generation", create_generation)
    monkeypatch.setattr(run_build, "Policy", policy)
    monkeypatch.setattr(factory, "start_together", start_together)
    placement: dict[str, Any] = (
        {"enabled": True} if colocated else {"enabled": False, "resources": {"gpus_per_node": 1}}
    )
    config = GRPOMasterConfig.model_validate(
        {
            "grpo": {"num_prompts_per_step": 1, "num_generations_per_prompt": 2},
            "policy": {
                "model_name": "m",
                "train_global_batch_size": 2,
                "train_micro_batch_size": 1,
                "generation": {
                    "backend": backend,
                    "colocated": placement,
                    "embedded_cfg": {"in_policy_workers": in_policy},
                },
            },
            "checkpointing": {"enabled": False, "checkpoint_dir": str(tmp_path / "ckpt")},
            "logger": {"log_dir": str(tmp_path / "logs")},
            "cluster": {"gpus_per_node": 2},
        }
    )
    with pytest.raises(_PolicyStarted):
        grpo.setup(config, None, [{"prompt": "x", "task_name": "math"}], None, task_to_env={"math": object()})  # type: ignore[arg-type]
    # vLLM starts alone and first; the embedded workers start together with the policy.
    assert started_together == ([True] if backend == "embedded" else [])
    return events
