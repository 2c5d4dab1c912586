"""Choosing the generation backend: the vLLM backend fails with the fix spelled out where it cannot run."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.generation.factory import check_backend_available, create_generation


def cfg(backend: str) -> PolicyConfig:
    return PolicyConfig.model_validate({"model_name": "unused", "generation": {"backend": backend}})


def test_embedded_backend_runs_anywhere() -> None:
    check_backend_available(cfg("embedded"), cluster_has_gpus=False)
    check_backend_available(cfg("embedded"), cluster_has_gpus=True)


def test_vllm_without_gpus_names_the_override() -> None:
    with pytest.raises(
        UserError, match=r"needs CUDA GPUs.*policy\.generation\.backend=embedded.*grpo_math_tiny\.yaml"
    ):
        check_backend_available(cfg("vllm"), cluster_has_gpus=False)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_not_installed_names_the_extra_and_the_override() -> None:
    with pytest.raises(UserError, match=r"--extra vllm.*policy\.generation\.backend=embedded"):
        check_backend_available(cfg("vllm"), cluster_has_gpus=True)


def test_create_generation_checks_before_starting_workers() -> None:
    class CpuCluster:
        use_gpus = False

    cluster: Any = CpuCluster()
    with pytest.raises(UserError, match="backend=embedded"):
        create_generation(cluster, cfg("vllm"), tokenizer=None, seed=0)  # type: ignore[arg-type]
