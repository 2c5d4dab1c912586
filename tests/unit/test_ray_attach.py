"""Attaching to a running Ray cluster through RAY_ADDRESS: a refused token is a user error that says the fix."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from ray.exceptions import AuthenticationError

from nemo_rl.config.errors import UserError
from nemo_rl.distributed import ray_start, virtual_cluster
from nemo_rl.distributed.ray_start import RayAuthenticationError, init_ray
from nemo_rl.distributed.virtual_cluster import free_port


def test_refused_token_names_the_variables_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    def refuse(**kwargs: Any) -> None:
        calls.append(kwargs)
        raise AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing or incorrect")

    monkeypatch.setattr(ray_start.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_start.ray, "init", refuse)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:1200")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(RayAuthenticationError) as info:
        init_ray()
    assert isinstance(info.value, UserError)
    message = str(info.value)
    assert "10.0.0.1:1200" in message and "RAY_AUTH_MODE=unset" in message
    for fix in ("RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN_PATH", "ray.sub"):
        assert fix in message
    assert "\n" not in message
    # The driver attached to the given address, passing its import path to the workers.
    assert calls[0]["address"] == "10.0.0.1:1200" and "PYTHONPATH" in calls[0]["runtime_env"]["env_vars"]


def _gcs_refusal() -> ConnectionError:
    """What ray.init raises when the GCS client's retry loop saw the refusal: a ConnectionError whose cause
    only quotes the AuthenticationError in its text."""
    try:
        try:
            raise RuntimeError(
                "Failed to connect to GCS. Last connection error: ... ray.exceptions.AuthenticationError: "
                "RPC error: InvalidAuthToken: Authentication token is missing or incorrect."
            )
        except RuntimeError as inner:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:1200") from inner
    except ConnectionError as outer:
        return outer


@pytest.mark.parametrize(
    ("error", "refused"),
    [
        (_gcs_refusal(), True),
        (ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:1200"), False),
    ],
)
def test_a_refusal_quoted_by_the_gcs_client_is_a_user_error_and_others_pass_through(
    monkeypatch: pytest.MonkeyPatch, error: Exception, refused: bool
) -> None:
    def fail(**kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(ray_start.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_start.ray, "init", fail)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:1200")
    with pytest.raises(RayAuthenticationError if refused else ConnectionError) as info:
        init_ray()
    assert isinstance(info.value, RayAuthenticationError) == refused


def test_free_port_is_below_the_kernels_automatic_ports_and_bindable() -> None:
    """A rendezvous port must not be one a connection can be given automatically between choice and bind."""
    start = virtual_cluster._ephemeral_port_start()
    ports = {free_port() for _ in range(8)}
    for port in ports:
        if start > virtual_cluster._FREE_PORT_LOW:
            assert virtual_cluster._FREE_PORT_LOW <= port < start
        with socket.socket() as sock:
            sock.bind(("", port))


def test_a_background_start_is_waited_for_and_its_error_raised_on_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """start_ray_in_background runs ray.init off the main thread; init_ray waits for it and raises its error."""
    import signal
    import threading

    release = threading.Event()
    calls: list[str] = []

    def refuse_after_release(**kwargs: Any) -> None:
        calls.append(threading.current_thread().name)
        release.wait(timeout=30)
        raise AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing or incorrect")

    monkeypatch.setattr(ray_start.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_start.ray, "init", refuse_after_release)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:1200")
    monkeypatch.setattr(ray_start, "_background_start", None)
    previous_handler = signal.getsignal(signal.SIGTERM)
    try:
        ray_start.start_ray_in_background()
        # The caller goes on while ray.init runs on another thread; Ray's SIGTERM handler (exit, so that
        # atexit stops the cluster) is installed on the main thread, where only it can be.
        assert signal.getsignal(signal.SIGTERM) is ray_start._exit_on_sigterm
        ray_start.start_ray_in_background()  # a second request while one runs is a no-op
        release.set()
        with pytest.raises(RayAuthenticationError, match=r"10\.0\.0\.1:1200"):
            init_ray()
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    assert calls == ["nemo-rl-ray-start"]
    assert ray_start._background_start is None


def test_the_driver_keeps_one_torch_thread_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """init_ray leaves the driver one intra-op thread (its small per-step tensors would otherwise start parallel
    regions waiting for cores the workers hold); NEMO_RL_DRIVER_TORCH_THREADS sets another count."""
    import torch

    monkeypatch.setattr(ray_start.ray, "is_initialized", lambda: True)  # Ray already up: nothing started
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("NEMO_RL_DRIVER_TORCH_THREADS", raising=False)
        init_ray()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("NEMO_RL_DRIVER_TORCH_THREADS", "2")
        init_ray()
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("NEMO_RL_DRIVER_TORCH_THREADS", "two")
        with pytest.raises(UserError, match=r"NEMO_RL_DRIVER_TORCH_THREADS='two': give a whole number"):
            init_ray()
    finally:
        torch.set_num_threads(before)
