"""Both refit transports end to end inside one process: senders and receivers run in threads.

Multi-process layouts (FSDP2, tensor parallel, Ray actors, a worker killed mid-refit) are covered in
tests/distributed/test_refit_*.py; these tests pin the protocol itself quickly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import pytest
import torch

import nemo_rl.weight_sync.collective as collective_module
import nemo_rl.weight_sync.shm as shm_module
import nemo_rl.weight_sync.shm_segments as shm_segments
from nemo_rl.weight_sync import (
    CollectiveTransport,
    RefitConfig,
    RefitError,
    RefitIntegrityError,
    SharedMemoryTransport,
    TransferStats,
    TransportSettings,
    WeightManifest,
    build_refit_transport,
    close_refit_groups,
    create_refit_transport,
    generation_dtype,
    tp_shard_fn,
)
from nemo_rl.weight_sync.buckets import pack_buckets
from nemo_rl.weight_sync.interfaces import RefitTransport, TransportKind
from nemo_rl.weight_sync.shm_segments import SEGMENT_NAME_PREFIX, SHM_DIR

TIMEOUT_S = 30.0
BUCKET_BYTES = 2048  # smaller than the embedding and lm_head below, larger than the rest


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    names_shapes = {
        "model.embed_tokens.weight": (40, 16),
        "model.layers.0.self_attn.q_proj.weight": (16, 16),
        "model.layers.0.self_attn.q_proj.bias": (16,),
        "model.layers.0.mlp.down_proj.weight": (16, 8),
        "model.layers.0.input_layernorm.weight": (16,),
        "model.norm.weight": (16,),
        "lm_head.weight": (40, 16),
    }
    return {name: torch.randn(shape, generator=gen) for name, shape in names_shapes.items()}


class Sink:
    """A loader keeping a copy of every tensor it is given."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, stream) -> None:
        for name, tensor in stream:
            assert name not in self.tensors
            self.tensors[name] = tensor.clone()


class Workers:
    """One long-lived thread per endpoint, as each endpoint is one long-lived worker process in real use
    (a process keeps its refit group and store client between refits)."""

    def __init__(self, num_workers: int) -> None:
        self._pools = [ThreadPoolExecutor(max_workers=1) for _ in range(num_workers)]

    def run(self, jobs: list[Callable[[], Any]]) -> list[Any]:
        """Run job ``i`` on worker ``i``; return the results in order or raise the first job's error."""
        assert len(jobs) <= len(self._pools)
        futures = [pool.submit(job) for pool, job in zip(self._pools, jobs, strict=False)]
        _, pending = wait(futures, timeout=TIMEOUT_S + 30)
        assert not pending, "a refit endpoint hung"
        return [future.result() for future in futures]

    def close(self) -> None:
        """Drop each thread's refit group, then stop the threads."""
        for pool in self._pools:
            pool.submit(close_refit_groups).result(timeout=TIMEOUT_S)
            pool.shutdown()


def _make_transport(
    kind: TransportKind, num_senders: int, num_receivers: int, dtype: torch.dtype
) -> RefitTransport:
    return build_refit_transport(
        kind,
        TransportSettings(dtype, BUCKET_BYTES, TIMEOUT_S, "127.0.0.1"),
        policy_node_ids=["node-a"] * num_senders,
        generation_node_ids=["node-a"] * num_receivers,
    )


def _refit(
    workers: Workers,
    transport: RefitTransport,
    weights: dict[str, torch.Tensor],
    manifest: WeightManifest,
    sinks: list[Sink],
    refit_id: str = "r0",
    shard_fns: list[Any] | None = None,
) -> list[TransferStats]:
    senders, receivers = transport.endpoints(refit_id)
    jobs: list[Callable[[], Any]] = [lambda s=s: s.send(iter(weights.items())) for s in senders]
    for j, receiver in enumerate(receivers):
        shard_fn = shard_fns[j] if shard_fns else None
        jobs.append(lambda r=receiver, sink=sinks[j], f=shard_fn: r.receive(sink, manifest, f))
    return workers.run(jobs)


def _segments_left(transport: RefitTransport) -> list[str]:
    """The transport's segments (other runs on the machine may hold their own)."""
    uid = getattr(transport, "_uid", "")
    return [p.name for p in SHM_DIR.glob(f"{SEGMENT_NAME_PREFIX}{uid}_*")] if uid else []


@pytest.fixture
def workers() -> Iterator[Workers]:
    pool = Workers(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("kind", ["shared_memory", "collective"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_receiver_gets_every_weight_bit_for_bit(
    workers: Workers, kind: TransportKind, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = _weights()
    transport = _make_transport(kind, num_senders=2, num_receivers=2, dtype=dtype)
    manifest = WeightManifest.from_named_tensors(weights.items(), dtype)
    created: list[str] = []
    create = shm_segments.Segment.create
    monkeypatch.setattr(
        shm_segments.Segment,
        "create",
        staticmethod(lambda name, nbytes, **kw: created.append(name) or create(name, nbytes, **kw)),
    )
    sinks = [Sink(), Sink()]
    stats = _refit(workers, transport, weights, manifest, sinks)
    kept = set(_segments_left(transport))  # the bucket segments
    for sink in sinks:
        assert sink.tensors.keys() == weights.keys()
        for name, tensor in weights.items():
            assert sink.tensors[name].dtype == dtype
            assert torch.equal(sink.tensors[name], tensor.to(dtype)), name
    sent, helper, *received = stats
    assert sent.wire_bytes >= manifest.nbytes and helper.wire_bytes == 0
    assert sent.num_buckets >= 2  # 2 KiB buckets: the weights do not fit in one
    assert all(r.wire_bytes == sent.wire_bytes and r.num_tensors == len(weights) for r in received)
    # A second refit on the same transport (the collective reuses its group) sees new weights.
    new_weights = _weights(seed=1)
    sinks = [Sink(), Sink()]
    _refit(workers, transport, new_weights, manifest, sinks, refit_id="r1")
    assert all(torch.equal(s.tensors[n], t.to(dtype)) for s in sinks for n, t in new_weights.items())
    if kind == "shared_memory":
        # The writer's bucket segments outlive a refit and carry the next one under the same names; only the
        # tensors larger than a bucket get segments of their own, for one refit.
        assert kept and kept == set(_segments_left(transport)) == {
            name for name in created if "_slot" in name
        }
        assert all(name.endswith("_b0") or name.endswith("_b2") for name in created if name not in kept)
    transport.shutdown()
    assert not _segments_left(transport)


@pytest.mark.parametrize("kind", ["shared_memory", "collective"])
def test_tensor_parallel_receivers_keep_their_slices(workers: Workers, kind: TransportKind) -> None:
    weights = _weights()
    transport = _make_transport(kind, num_senders=1, num_receivers=2, dtype=torch.float32)
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)

    def split_dim(name: str) -> int | None:
        if "q_proj" in name or name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0  # column parallel: output rows
        return 1 if "down_proj" in name else None  # row parallel: input columns

    sinks = [Sink(), Sink()]
    _refit(
        workers,
        transport,
        weights,
        manifest,
        sinks,
        shard_fns=[tp_shard_fn(r, 2, split_dim) for r in range(2)],
    )
    for rank, sink in enumerate(sinks):
        for name, full in weights.items():
            dim = split_dim(name)
            expected = full if dim is None else full.chunk(2, dim=dim)[rank]
            assert torch.equal(sink.tensors[name], expected), (rank, name)
    transport.shutdown()


def _corrupt_bucket(index: int):
    """A pack_buckets that flips one payload byte of bucket ``index`` after its checksum was taken."""

    def corrupting_pack(*args: Any, **kwargs: Any):
        for header, payload in pack_buckets(*args, **kwargs):
            if header.index == index:
                payload[3] ^= 0xFF
            yield header, payload

    return corrupting_pack


@pytest.mark.parametrize("module", [shm_module, collective_module], ids=["shared_memory", "collective"])
def test_corrupted_bucket_fails_the_refit_naming_its_weights(
    workers: Workers, module: Any, monkeypatch
) -> None:
    kind: TransportKind = "shared_memory" if module is shm_module else "collective"
    weights = _weights()
    transport = _make_transport(kind, num_senders=1, num_receivers=2, dtype=torch.float32)
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)
    monkeypatch.setattr(module, "pack_buckets", _corrupt_bucket(1))
    with pytest.raises(RefitIntegrityError, match="bucket 1 is corrupt") as info:
        _refit(workers, transport, weights, manifest, [Sink(), Sink()])
    assert "model.layers.0.self_attn.q_proj.weight" in str(info.value)
    transport.shutdown()
    assert not _segments_left(transport)


def test_lost_bucket_fails_naming_the_weights_that_never_arrived(workers: Workers, monkeypatch) -> None:
    weights = _weights()
    transport = _make_transport("collective", num_senders=1, num_receivers=1, dtype=torch.float32)
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)

    def lossy_pack(*args: Any, **kwargs: Any):
        for header, payload in pack_buckets(*args, **kwargs):
            if header.index != 1:
                yield header, payload

    monkeypatch.setattr(collective_module, "pack_buckets", lossy_pack)
    with pytest.raises(RefitIntegrityError, match="bucket 2 arrived when bucket 1 was expected") as info:
        _refit(workers, transport, weights, manifest, [Sink()])
    never_arrived = str(info.value).split("weights that never arrived: ")[1]
    assert "model.layers.0.self_attn.q_proj.bias" in never_arrived
    assert "lm_head.weight" not in never_arrived


@pytest.mark.parametrize("kind", ["shared_memory", "collective"])
def test_missing_and_unexpected_weights_fail_by_name(workers: Workers, kind: TransportKind) -> None:
    weights = _weights()
    transport = _make_transport(kind, num_senders=1, num_receivers=1, dtype=torch.float32)
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)
    offered = dict(weights)
    del offered["model.norm.weight"]
    offered["model.rogue.weight"] = torch.zeros(4)
    with pytest.raises(RefitIntegrityError) as info:
        _refit(workers, transport, offered, manifest, [Sink()])
    message = str(info.value)
    assert "unexpected weights: model.rogue.weight" in message
    assert "weights that never arrived: model.norm.weight" in message
    # The failed refit did not leave the transport unusable.
    sinks = [Sink()]
    _refit(workers, transport, weights, manifest, sinks, refit_id="r1")
    assert sinks[0].tensors.keys() == weights.keys()
    transport.shutdown()
    assert not _segments_left(transport)


@pytest.mark.parametrize("kind", ["shared_memory", "collective"])
def test_sender_failure_reaches_the_receivers(workers: Workers, kind: TransportKind) -> None:
    weights = _weights()
    transport = _make_transport(kind, num_senders=1, num_receivers=1, dtype=torch.float32)
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)
    senders, receivers = transport.endpoints("r0")

    def failing_weights():
        yield from list(weights.items())[:3]
        raise RuntimeError("gather failed")

    errors: dict[str, BaseException] = {}

    def send() -> None:
        try:
            senders[0].send(failing_weights())
        except RuntimeError as err:
            errors["sender"] = err

    def receive() -> None:
        try:
            receivers[0].receive(Sink(), manifest)
        except RefitIntegrityError as err:
            errors["receiver"] = err

    workers.run([send, receive])
    assert "gather failed" in str(errors["sender"])
    assert "aborted the refit" in str(errors["receiver"]) and "gather failed" in str(errors["receiver"])
    transport.shutdown()
    assert not _segments_left(transport)


def test_factory_picks_the_transport_from_placement_and_config() -> None:
    from nemo_rl.config.policy import PolicyConfig

    colocated = PolicyConfig(model_name="tiny", refit_buffer_size_mb=1)
    assert generation_dtype(colocated) == torch.float32
    shm = create_refit_transport(
        colocated, RefitConfig(), policy_node_ids=["a", "b"], generation_node_ids=["b"]
    )
    assert isinstance(shm, SharedMemoryTransport)
    spread = create_refit_transport(
        colocated, RefitConfig(), policy_node_ids=["a"], generation_node_ids=["a", "c"]
    )
    assert isinstance(spread, CollectiveTransport)
    separate = PolicyConfig.model_validate(
        {"model_name": "tiny", "generation": {"colocated": {"enabled": False}, "backend": "vllm"}}
    )
    assert generation_dtype(separate) == torch.bfloat16
    assert isinstance(
        create_refit_transport(separate, RefitConfig(), policy_node_ids=["a"], generation_node_ids=["a"]),
        CollectiveTransport,
    )
    forced = create_refit_transport(
        separate, RefitConfig(transport="shared_memory"), policy_node_ids=["a"], generation_node_ids=["a"]
    )
    assert forced.kind == "shared_memory"
    with pytest.raises(ValueError, match="nodes \\['c'\\] lack streams \\[0\\]"):
        create_refit_transport(
            colocated,
            RefitConfig(transport="shared_memory"),
            policy_node_ids=["a"],
            generation_node_ids=["c"],
        )
    for transport in (shm, spread, forced):
        transport.shutdown()


@pytest.mark.parametrize(
    ("device_keys", "backend"),
    [
        (["cuda:GPU-aaaa", "cuda:GPU-bbbb", "cuda:GPU-cccc"], "nccl"),
        # Colocated: the policy root and a generation worker on one GPU; NCCL would refuse the group.
        (["cuda:GPU-aaaa", "cuda:GPU-aaaa"], "gloo"),
        (["cuda:GPU-aaaa", "cuda:GPU-bbbb", "cuda:GPU-aaaa"], "gloo"),
        (["cuda:GPU-aaaa", "cpu"], "gloo"),
        (["cpu", "cpu"], "gloo"),
    ],
)
def test_refit_group_uses_nccl_only_with_one_gpu_per_member(device_keys: list[str], backend: str) -> None:
    assert collective_module.choose_group_backend(device_keys) == backend


def test_refit_group_of_two_ranks_on_one_gpu_is_built_on_gloo(workers: Workers, monkeypatch) -> None:
    """Members exchange their GPU UUIDs through the refit store; a shared GPU puts the group on gloo."""
    monkeypatch.setattr(collective_module, "local_device_key", lambda: "cuda:GPU-0000-shared")
    transport = _make_transport("collective", 1, 1, torch.float32)
    weights = _weights()
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)
    sinks = [Sink()]
    _refit(workers, transport, weights, manifest, sinks)
    assert all(torch.equal(sinks[0].tensors[name], tensor) for name, tensor in weights.items())
    spec = transport.endpoints("r1")[1][0].groups[0]  # type: ignore[attr-defined]
    backends = workers.run([lambda r=r: collective_module.connect_group(spec, r).backend for r in (0, 1)])
    assert backends == ["gloo", "gloo"]
    transport.shutdown()


def test_driver_abort_wakes_waiting_shm_endpoints_and_unlinks(workers: Workers) -> None:
    """A dead peer never acknowledges or announces: the driver's abort must wake the survivors."""
    weights = _weights()
    transport = _make_transport("shared_memory", num_senders=1, num_receivers=2, dtype=torch.float32)
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)
    senders, receivers = transport.endpoints("r0")
    prefix = senders[0].segment_prefix  # type: ignore[attr-defined]
    # Receiver 1 stands for a dead generation worker: it never reads, so the writer blocks on its acks.
    futures = [
        workers._pools[0].submit(senders[0].send, iter(weights.items())),
        workers._pools[1].submit(receivers[0].receive, Sink(), manifest),
    ]
    deadline = time.monotonic() + TIMEOUT_S
    while not list(SHM_DIR.glob(f"{prefix}*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # let the writer fill both buffers and block waiting for the missing reader
    assert not futures[0].done()
    transport.abort("r0")
    with pytest.raises(RefitError, match="aborted by the driver"):
        futures[0].result(timeout=TIMEOUT_S)
    with pytest.raises(RefitIntegrityError, match="aborted the refit"):
        futures[1].result(timeout=TIMEOUT_S)
    assert not list(SHM_DIR.glob(f"{prefix}*"))  # the writer unlinked its segments on the way out
    transport.cleanup("r0")
    transport.shutdown()


def test_shm_assigns_one_writer_per_node_with_readers() -> None:
    transport = SharedMemoryTransport(
        TransportSettings(torch.float32, BUCKET_BYTES, TIMEOUT_S, "127.0.0.1"),
        policy_node_ids=["a", "a", "b", "b", "c"],
        generation_node_ids=["b", "a", "b"],
    )
    senders, receivers = transport.endpoints("r0")
    roles = [(s.writer, s.readers) for s in senders]  # type: ignore[attr-defined]
    # Writers are numbered by generation node (b first, then a); node c has no generation worker.
    assert roles == [(1, (1,)), (None, ()), (0, (0, 2)), (None, ()), (None, ())]
    assert [r.writers for r in receivers] == [(0,), (1,), (0,)]  # type: ignore[attr-defined]
    transport.shutdown()


def test_shm_has_one_writer_per_node_and_stream() -> None:
    transport = SharedMemoryTransport(
        TransportSettings(torch.float32, BUCKET_BYTES, TIMEOUT_S, "127.0.0.1"),
        policy_node_ids=["a", "a", "a", "a", "b", "b"],
        generation_node_ids=["a", "a"],
        policy_streams=[0, 0, 1, 1, 0, 1],
    )
    senders, receivers = transport.endpoints("r0")
    assert [s.writer for s in senders] == [0, None, 1, None, None, None]  # type: ignore[attr-defined]
    assert [s.stream for s in senders] == [0, 0, 1, 1, 0, 1]  # type: ignore[attr-defined]
    assert [r.writers for r in receivers] == [(0, 1), (0, 1)]  # type: ignore[attr-defined]
    assert transport.num_streams == 2
    transport.shutdown()
    # A generation node without a rank of stream 1 cannot be served from shared memory.
    assert not SharedMemoryTransport.supports(["a", "b"], ["a", "b"], [0, 1])
    with pytest.raises(ValueError, match=r"numbered 0\.\.S-1"):
        SharedMemoryTransport.supports(["a", "a"], ["a"], [0, 2])


@pytest.mark.parametrize("kind", ["shared_memory", "collective"])
def test_pipeline_stages_each_send_their_own_stream(kind: TransportKind) -> None:
    weights = _weights()
    stage_of = {name: 0 if i < 3 else 1 for i, name in enumerate(weights)}
    streams = [0, 0, 1, 1]  # two ranks per stage (e.g. tensor-parallel peers), one of each sends
    transport = build_refit_transport(
        kind,
        TransportSettings(torch.bfloat16, BUCKET_BYTES, TIMEOUT_S, "127.0.0.1"),
        policy_node_ids=["node-a"] * 4,
        generation_node_ids=["node-a"] * 2,
        policy_streams=streams,
    )
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.bfloat16)
    sinks = [Sink(), Sink()]
    senders, receivers = transport.endpoints("r0")
    jobs: list[Callable[[], Any]] = [
        lambda s=s, stage=stage: s.send((n, t) for n, t in weights.items() if stage_of[n] == stage)
        for s, stage in zip(senders, streams, strict=True)
    ]
    jobs += [
        lambda r=r, sink=sink: r.receive(sink, manifest) for r, sink in zip(receivers, sinks, strict=True)
    ]
    pool = Workers(6)
    try:
        stats = pool.run(jobs)
        for sink in sinks:
            assert set(sink.tensors) == set(weights)
            assert all(torch.equal(sink.tensors[n], t.to(torch.bfloat16)) for n, t in weights.items())
        assert [st.stream for st in stats[:4]] == streams
        assert [st.wire_bytes > 0 for st in stats[:4]] == [True, False, True, False]
        assert stats[4].num_tensors == len(weights)
        # A stage that leaves out one of its weights fails every receiver, naming it.
        senders, receivers = transport.endpoints("r1")
        short = [
            lambda s=s, stage=stage: s.send(
                (n, t) for n, t in weights.items() if stage_of[n] == stage and n != "model.norm.weight"
            )
            for s, stage in zip(senders, streams, strict=True)
        ]
        futures = [pool._pools[i].submit(job) for i, job in enumerate(short)]
        futures += [
            pool._pools[4 + j].submit(lambda r=r: r.receive(Sink(), manifest))
            for j, r in enumerate(receivers)
        ]
        for future in futures[4:]:
            with pytest.raises(RefitIntegrityError, match=r"never arrived: model\.norm\.weight"):
                future.result(timeout=TIMEOUT_S)
        for future in futures[:4]:
            future.result(timeout=TIMEOUT_S)
    finally:
        pool.close()
        transport.shutdown()
    assert not _segments_left(transport)


def test_shm_two_nodes_each_reader_follows_its_own_writer(workers: Workers) -> None:
    weights = _weights()
    transport = SharedMemoryTransport(
        TransportSettings(torch.bfloat16, BUCKET_BYTES, TIMEOUT_S, "127.0.0.1"),
        policy_node_ids=["a", "b"],
        generation_node_ids=["b", "a"],
    )
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.bfloat16)
    sinks = [Sink(), Sink()]
    sent_a, sent_b, *_ = _refit(workers, transport, weights, manifest, sinks)
    assert sent_a.wire_bytes == sent_b.wire_bytes > 0  # both nodes' writers sent everything
    for sink in sinks:
        assert all(torch.equal(sink.tensors[n], t.to(torch.bfloat16)) for n, t in weights.items())
    transport.shutdown()
    assert not _segments_left(transport)
