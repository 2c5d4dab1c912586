"""Tensors sent through Ray as numpy arrays arrive equal to what was sent, and writable (the speed is measured
by benchmarks/bench_grpo_vs_trl.py)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import ray
import torch

from nemo_rl.distributed.serialization import _payload_from_tensor, _tensor_from_payload


def _round_trip(tensor: torch.Tensor) -> torch.Tensor:
    payload = pickle.loads(pickle.dumps(_payload_from_tensor(tensor), protocol=5))
    return _tensor_from_payload(payload)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.long).reshape(3, 4),
        torch.randn(5, 7),
        torch.randn(4, 6).to(torch.bfloat16),
        torch.randn(3, dtype=torch.float64),
        torch.tensor([True, False, True]),
        torch.tensor(2.5),
        torch.empty(0, 3),
        torch.randn(6, 8)[1:5:2, ::3],  # a strided view of a larger storage
        torch.randn(4, 1).expand(4, 5),  # stride 0
        torch.randn(3, 2, requires_grad=True),  # torch's own pickling
        torch.randn(3, dtype=torch.complex64).conj(),  # conjugate bit: torch's own pickling
    ],
    ids=lambda t: f"{t.dtype}-{tuple(t.shape)}-{t.requires_grad}-{t.is_conj()}",
)
def test_round_trip_keeps_dtype_shape_values(tensor: torch.Tensor) -> None:
    back = _round_trip(tensor)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert back.requires_grad == tensor.requires_grad
    torch.testing.assert_close(back.detach().resolve_conj(), tensor.detach().resolve_conj(), rtol=0, atol=0)


def test_a_view_sends_only_its_own_elements() -> None:
    big = torch.zeros(1_000_000)
    view_bytes = len(pickle.dumps(_payload_from_tensor(big[:10]), protocol=5))
    assert view_bytes < 1_000  # torch's own pickling would send the whole 4 MB storage


def test_through_ray_tensors_arrive_equal_and_writable(ray_cluster: dict[str, float]) -> None:
    # Large enough for Ray's shared-memory store, whose buffers it hands out read-only.
    batch: dict[str, Any] = {
        "input_ids": torch.arange(512 * 80).reshape(512, 80),
        "logprobs": torch.randn(512, 80),
        "log": [{"token_ids": torch.arange(n), "content": "x"} for n in range(1, 300)],
    }
    back = ray.get(ray.put(batch), timeout=60)
    assert torch.equal(back["input_ids"], batch["input_ids"])
    assert torch.equal(back["logprobs"], batch["logprobs"])
    assert all(
        torch.equal(a["token_ids"], b["token_ids"]) for a, b in zip(back["log"], batch["log"], strict=True)
    )
    back["input_ids"][0, 0] = -1  # writable, and a copy: the stored object is unchanged
    assert int(ray.get(ray.put(batch), timeout=60)["input_ids"][0, 0]) == 0
