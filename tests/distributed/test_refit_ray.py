"""Refit across Ray actors: FSDP2 (dp=2) and TP=2 senders over gloo, replicated and TP=2 receivers.

The senders hold a tiny Qwen2-shaped torch model under Hugging Face names, sharded with FSDP2 or with a
tensor-parallel plan on their own default gloo group; ``refit`` streams the parameters as DTensors and the
transport gathers them. Every received weight must equal the sender's full weight bit for bit (after the
cast to the generation dtype), and the policy's default process group must still work afterwards.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
import torch.distributed as dist
from torch import nn

from nemo_rl.distributed.device import configure_worker_threads
from nemo_rl.distributed.virtual_cluster import free_port
from nemo_rl.weight_sync import (
    RefitError,
    TransferStats,
    TransportSettings,
    WeightManifest,
    WeightReceiver,
    WeightSender,
    build_refit_transport,
    refit,
    tp_shard_fn,
)
from nemo_rl.weight_sync.interfaces import RefitTransport, TransportKind
from nemo_rl.weight_sync.shm_segments import SEGMENT_NAME_PREFIX, SHM_DIR

TIMEOUT_S = 120.0
BUCKET_BYTES = 4096  # the embedding and lm_head (8 KiB in fp32) are larger than a bucket
HIDDEN, VOCAB, FFN = 16, 128, 32


class TinyDecoder(nn.Module):
    """Qwen2-shaped parameters under Hugging Face names (``model.layers.0.self_attn.q_proj.weight``...)."""

    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.model.layers = nn.ModuleList()
        for _ in range(num_layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.q_proj = nn.Linear(HIDDEN, HIDDEN)
            layer.self_attn.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
            layer.mlp = nn.Module()
            layer.mlp.up_proj = nn.Linear(HIDDEN, FFN, bias=False)
            layer.mlp.down_proj = nn.Linear(FFN, HIDDEN, bias=False)
            layer.input_layernorm = nn.Module()
            layer.input_layernorm.weight = nn.Parameter(torch.ones(HIDDEN))
            self.model.layers.append(layer)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)


def tp_split_dim(name: str) -> int | None:
    """The TP plan of the test model: q/up column-parallel (dim 0), o/down row-parallel (dim 1)."""
    if name.endswith(("q_proj.weight", "q_proj.bias", "up_proj.weight")):
        return 0
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    return None


class PolicySender:
    """One policy rank: the same seeded model, sharded with FSDP2 (dp=2) and, separately, with TP=2."""

    def __init__(self, rank: int, world_size: int, master_port: int, seed: int) -> None:
        configure_worker_threads()
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port)
        )
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        torch.manual_seed(seed)
        reference = TinyDecoder()
        self.full = {name: p.detach().clone() for name, p in reference.named_parameters()}
        mesh = init_device_mesh("cpu", (world_size,))
        self.fsdp = TinyDecoder()
        self.fsdp.load_state_dict(reference.state_dict())
        for layer in self.fsdp.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.fsdp, mesh=mesh)
        self.tp = TinyDecoder()
        self.tp.load_state_dict(reference.state_dict())
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in self.tp.model.layers:
            parallelize_module(layer, mesh, plan)  # type: ignore[arg-type]
        self.delay_s = 0.0

    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.full

    def perturb(self, delta: float) -> None:
        """Change every weight (in the sharded models and the reference alike) between refits."""
        with torch.no_grad():
            for model in (self.fsdp, self.tp):
                for p in model.parameters():
                    p.add_(delta)
            for tensor in self.full.values():
                tensor.add_(delta)

    def set_delay(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def _stream(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in model.named_parameters():
            time.sleep(self.delay_s)
            yield name, param.detach()  # DTensors: the transport gathers them

    def refit_send_fsdp(self, sender: WeightSender, scope: str = "full") -> TransferStats:
        return sender.send(self._stream(self.fsdp))

    def refit_send_tp(self, sender: WeightSender, scope: str = "full") -> TransferStats:
        return sender.send(self._stream(self.tp))

    def default_group_all_reduce(self) -> tuple[int, float]:
        """The training group is untouched by refit: same size, collectives still work."""
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return dist.get_world_size(), float(value.item())


class GenerationReceiver:
    """A generation worker: a plain replicated module, or one tensor-parallel rank keeping its slices."""

    def __init__(self) -> None:
        configure_worker_threads()
        self.dtype = torch.float32
        self.tp: tuple[int, int] | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.manifest = WeightManifest({})

    def configure(self, dtype: torch.dtype, tp: tuple[int, int] | None) -> None:
        self.dtype, self.tp = dtype, tp
        torch.manual_seed(1234)  # different from the policy: stale weights would show
        model = TinyDecoder().to(dtype)
        self.manifest = WeightManifest.from_named_tensors(model.named_parameters(), dtype)
        self.weights = {}
        for name, param in model.named_parameters():
            dim = tp_split_dim(name) if tp else None
            self.weights[name] = (
                param.detach().chunk(tp[1], dim)[tp[0]].clone()
                if tp and dim is not None
                else param.detach().clone()
            )

    def _load(self, stream: Any) -> None:
        for name, tensor in stream:
            self.weights[name].copy_(tensor)

    def refit_receive(self, receiver: WeightReceiver, scope: str = "full") -> TransferStats:
        shard_fn = tp_shard_fn(self.tp[0], self.tp[1], tp_split_dim) if self.tp else None
        return receiver.receive(self._load, self.manifest, shard_fn)

    def state(self) -> dict[str, torch.Tensor]:
        return self.weights


def _start_senders(world_size: int, seed: int) -> list[Any]:
    port = free_port()
    actor = ray.remote(num_cpus=0.5)(PolicySender)
    senders = [actor.remote(rank, world_size, port, seed) for rank in range(world_size)]
    ray.get([s.full_weights.remote() for s in senders], timeout=TIMEOUT_S)
    return senders


@pytest.fixture(scope="module")
def senders(ray_cluster: dict[str, float]) -> Iterator[list[Any]]:
    actors = _start_senders(world_size=2, seed=7)
    yield actors
    for actor in actors:
        ray.kill(actor)


@pytest.fixture(scope="module")
def receivers(ray_cluster: dict[str, float]) -> Iterator[list[Any]]:
    actor = ray.remote(num_cpus=0.5)(GenerationReceiver)
    actors = [actor.remote() for _ in range(2)]
    yield actors
    for a in actors:
        ray.kill(a)


def _transport(
    kind: TransportKind, num_senders: int, num_receivers: int, dtype: torch.dtype
) -> RefitTransport:
    node = ray.get_runtime_context().get_node_id()
    return build_refit_transport(
        kind,
        TransportSettings(dtype, BUCKET_BYTES, TIMEOUT_S, "127.0.0.1"),
        policy_node_ids=[node] * num_senders,
        generation_node_ids=[node] * num_receivers,
    )


def _segments(prefix: str) -> list[str]:
    return [path.name for path in SHM_DIR.glob(f"{prefix}*")]


def _segments_of(transport: RefitTransport) -> list[str]:
    """The transport's segments on this node (other runs on the machine may hold their own)."""
    return _segments(f"{SEGMENT_NAME_PREFIX}{transport._uid}_") if hasattr(transport, "_uid") else []


@pytest.mark.parametrize("kind", ["shared_memory", "collective"])
def test_refit_from_fsdp_dp2_sender_is_bit_exact(
    kind: TransportKind, senders: list[Any], receivers: list[Any]
) -> None:
    receiver = receivers[:1]
    ray.get(receiver[0].configure.remote(torch.float32, None), timeout=TIMEOUT_S)
    transport = _transport(kind, 2, 1, torch.float32)
    try:
        for step in range(2):
            metrics = refit(senders, receiver, transport, timeout_s=TIMEOUT_S, send_method="refit_send_fsdp")
            full = ray.get(senders[0].full_weights.remote(), timeout=TIMEOUT_S)
            got = ray.get(receiver[0].state.remote(), timeout=TIMEOUT_S)
            assert got.keys() == full.keys()
            for name, tensor in full.items():
                assert got[name].dtype == torch.float32 and torch.equal(got[name], tensor), (step, name)
            assert metrics["refit/bytes"] >= sum(t.numel() * 4 for t in full.values())
            assert metrics["refit/num_buckets"] >= 3 and metrics["refit/time_s"] > 0
            assert metrics["refit/gbps"] == pytest.approx(
                metrics["refit/bytes"] / metrics["refit/time_s"] / 1e9
            )
            ray.get([s.perturb.remote(0.5) for s in senders], timeout=TIMEOUT_S)
        groups = ray.get([s.default_group_all_reduce.remote() for s in senders], timeout=TIMEOUT_S)
        assert groups == [(2, 3.0), (2, 3.0)]
    finally:
        transport.shutdown()
    assert not _segments_of(transport)


@pytest.mark.parametrize("kind", ["shared_memory", "collective"])
def test_refit_from_tp2_sender_into_tp2_receivers_with_cast(
    kind: TransportKind, senders: list[Any], receivers: list[Any]
) -> None:
    ray.get([r.configure.remote(torch.bfloat16, (i, 2)) for i, r in enumerate(receivers)], timeout=TIMEOUT_S)
    transport = _transport(kind, 2, 2, torch.bfloat16)
    try:
        metrics = refit(senders, receivers, transport, timeout_s=TIMEOUT_S, send_method="refit_send_tp")
    finally:
        transport.shutdown()
    full = ray.get(senders[0].full_weights.remote(), timeout=TIMEOUT_S)
    assert metrics["refit/bytes_received"] == 2 * metrics["refit/bytes"]
    for tp_rank, receiver in enumerate(receivers):
        got = ray.get(receiver.state.remote(), timeout=TIMEOUT_S)
        for name, tensor in full.items():
            dim = tp_split_dim(name)
            expected = tensor.to(torch.bfloat16)
            if dim is not None:
                expected = expected.chunk(2, dim)[tp_rank]
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], expected), (tp_rank, name)
    assert not _segments_of(transport)


def test_mismatched_manifest_fails_naming_the_weight(senders: list[Any], receivers: list[Any]) -> None:
    # The receiver expects bfloat16 but the transport casts to float32: every weight is reported.
    ray.get(receivers[0].configure.remote(torch.bfloat16, None), timeout=TIMEOUT_S)
    transport = _transport("shared_memory", 2, 1, torch.float32)
    try:
        with pytest.raises(RefitError, match=r"generation worker 0 failed.*model.norm|wrong shape or dtype"):
            refit(senders, receivers[:1], transport, timeout_s=TIMEOUT_S, send_method="refit_send_fsdp")
    finally:
        transport.shutdown()
    assert not _segments_of(transport)


def test_killed_sender_leaves_no_shared_memory_behind(receivers: list[Any]) -> None:
    sender = _start_senders(world_size=1, seed=3)[0]
    receiver = receivers[0]
    ray.get([receiver.configure.remote(torch.float32, None), sender.set_delay.remote(0.3)], timeout=TIMEOUT_S)
    transport = _transport("shared_memory", 1, 1, torch.float32)
    prefix = f"{SEGMENT_NAME_PREFIX}{transport._uid}_"  # this transport's segments only
    errors: list[BaseException] = []

    def run_refit() -> None:
        try:
            refit([sender], [receiver], transport, timeout_s=TIMEOUT_S, send_method="refit_send_fsdp")
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=run_refit, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not _segments(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _segments(prefix), "the sender never created a segment"
    ray.kill(sender)  # dies mid-refit, holding its segments
    thread.join(timeout=TIMEOUT_S)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RefitError)
    assert "policy worker 0 died during refit" in str(errors[0])
    assert not _segments(prefix)
    # The receiver was woken by the abort (not left waiting for the dead sender) and is usable again.
    assert ray.get(receiver.state.remote(), timeout=10)
    transport.shutdown()
