"""Refit wire format: bucket packing, checksums, the manifest and the receiver-side checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_rl.weight_sync.buckets import (
    ALIGN_BYTES,
    BucketReader,
    StreamAbort,
    StreamEnd,
    decode_message,
    encode_message,
    feed_loader,
    pack_buckets,
    payload_checksum,
)
from nemo_rl.weight_sync.errors import RefitError, RefitIntegrityError
from nemo_rl.weight_sync.manifest import TensorSpec, WeightManifest, dtype_from_name
from nemo_rl.weight_sync.resharding import tp_shard_fn


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=gen),  # 4096 bytes in fp32
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=gen),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, generator=gen),
        "model.norm.weight": torch.randn(16, generator=gen),
        "model.odd": torch.randn(3, generator=gen).to(torch.bfloat16),  # 6 bytes: not a word multiple
        "lm_head.weight": torch.randn(64, 16, generator=gen),
        "model.scalar": torch.tensor(2.5),
        "model.empty": torch.zeros(0, 4),
        "model.position_ids": torch.arange(5),  # an integer buffer keeps its dtype
    }


def _pack(weights: dict[str, torch.Tensor], dtype: torch.dtype, bucket_size_bytes: int, in_place: bool):
    def acquire(index: int, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # a fresh buffer per bucket

    return [
        (header, payload.clone())
        for header, payload in pack_buckets(
            weights.items(),
            dtype=dtype,
            bucket_size_bytes=bucket_size_bytes,
            acquire=acquire,
            send_oversized_in_place=in_place,
            wire_device=torch.device("cpu"),
        )
    ]


def _read(buckets, manifest: WeightManifest, shard_fn=None) -> dict[str, torch.Tensor]:
    reader = BucketReader(manifest, shard_fn)
    received: dict[str, torch.Tensor] = {}
    for header, payload in buckets:
        if reader.admit(header, payload.numel()):
            received.update((name, t.clone()) for name, t in reader.unpack(header, payload))
    reader.end(StreamEnd(len(buckets), sum(h.nbytes for h, _ in buckets)))
    reader.raise_if_failed("the test receiver")
    return received


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_then_read_round_trips_bit_for_bit(dtype: torch.dtype, in_place: bool) -> None:
    weights = _weights()
    buckets = _pack(weights, dtype, bucket_size_bytes=1500, in_place=in_place)
    manifest = WeightManifest.from_named_tensors(
        ((n, t.to(dtype) if t.is_floating_point() else t) for n, t in weights.items()), None
    )
    received = _read(buckets, manifest)
    assert received.keys() == weights.keys()
    for name, tensor in weights.items():
        expected = tensor.to(dtype) if tensor.is_floating_point() else tensor
        assert received[name].dtype == expected.dtype
        assert torch.equal(received[name], expected), name


def test_buckets_respect_the_size_and_oversized_tensors_travel_alone() -> None:
    weights = _weights()
    bucket_size = 1500
    buckets = _pack(weights, torch.float32, bucket_size_bytes=bucket_size, in_place=False)
    capacity = -(-bucket_size // ALIGN_BYTES) * ALIGN_BYTES
    assert [h.index for h, _ in buckets] == list(range(len(buckets)))
    for header, payload in buckets:
        assert payload.numel() == header.nbytes
        assert all(e.offset % ALIGN_BYTES == 0 for e in header.entries)
        if header.nbytes > capacity:
            assert len(header.entries) == 1  # larger than a bucket: alone
        else:
            assert sum(e.nbytes for e in header.entries) <= capacity
    oversized = {h.entries[0].name for h, _ in buckets if h.nbytes > capacity}
    assert oversized == {"model.embed_tokens.weight", "lm_head.weight"}
    # Order on the wire is the order of the stream.
    assert [e.name for h, _ in buckets for e in h.entries] == list(weights)


def test_checksum_sees_flips_swaps_and_truncation() -> None:
    payload = torch.randint(
        0, 256, (64 * 1024 + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    reference = payload_checksum(payload)
    assert payload_checksum(payload.clone()) == reference
    flipped = payload.clone()
    flipped[12345] ^= 0x10
    assert payload_checksum(flipped) != reference
    tail_flipped = payload.clone()
    tail_flipped[-1] ^= 0x01
    assert payload_checksum(tail_flipped) != reference
    swapped = payload.clone()
    swapped[:4096], swapped[4096:8192] = payload[4096:8192].clone(), payload[:4096].clone()
    assert payload_checksum(swapped) != reference
    assert payload_checksum(payload[:-8]) != reference


def test_messages_round_trip_and_garbage_is_rejected() -> None:
    buckets = _pack(_weights(), torch.bfloat16, bucket_size_bytes=1500, in_place=False)
    header = buckets[0][0]
    assert decode_message(encode_message(header)) == header
    assert decode_message(encode_message(StreamEnd(3, 100))) == StreamEnd(3, 100)
    assert decode_message(encode_message(StreamAbort("boom"))) == StreamAbort("boom")
    with pytest.raises(RefitError, match="malformed refit header"):
        decode_message(b"not json")


def test_corrupted_bucket_fails_naming_its_parameters() -> None:
    weights = _weights()
    buckets = _pack(weights, torch.float32, bucket_size_bytes=1500, in_place=False)
    victim_header, victim_payload = buckets[1]
    victim_payload[7] ^= 0xFF
    with pytest.raises(RefitIntegrityError, match="checksum") as info:
        _read(buckets, WeightManifest.from_named_tensors(weights.items(), torch.float32))
    for name in victim_header.names:
        assert name in str(info.value)


def test_truncated_bucket_fails_with_its_size() -> None:
    weights = _weights()
    buckets = _pack(weights, torch.float32, bucket_size_bytes=1500, in_place=False)
    header, payload = buckets[1]
    buckets[1] = (header, payload[:-64])
    with pytest.raises(
        RefitIntegrityError, match=f"bucket 1 is {header.nbytes - 64} bytes but its header says"
    ):
        _read(buckets, WeightManifest.from_named_tensors(weights.items(), torch.float32))


def test_missing_bucket_fails_naming_the_weights_that_never_arrived() -> None:
    weights = _weights()
    buckets = _pack(weights, torch.float32, bucket_size_bytes=1500, in_place=False)
    lost = buckets.pop(1)[0]
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)
    reader = BucketReader(manifest, None)
    for header, payload in buckets:
        reader.admit(header, payload.numel())
    reader.end(StreamEnd(len(buckets) + 1, 0))
    with pytest.raises(RefitIntegrityError) as info:
        reader.raise_if_failed("the test receiver")
    message = str(info.value)
    assert "bucket 2 arrived when bucket 1 was expected" in message
    assert f"sent {len(buckets) + 1} buckets but {len(buckets)} arrived" in message
    assert "weights that never arrived: " + ", ".join(sorted(lost.names)) in message


def test_manifest_rejects_duplicates_unexpected_and_wrong_shapes() -> None:
    weights = _weights()
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)
    stream = {**weights, "model.extra.weight": torch.zeros(2)}
    stream["model.norm.weight"] = torch.zeros(17)
    buckets = _pack(stream, torch.float32, bucket_size_bytes=1 << 20, in_place=False)
    buckets.append((dataclasses.replace(buckets[0][0], index=1), buckets[0][1]))  # the same bucket again
    reader = BucketReader(manifest, None)
    for header, payload in buckets:
        reader.admit(header, payload.numel())
    reader.end(StreamEnd(2, 0))
    with pytest.raises(RefitIntegrityError) as info:
        reader.raise_if_failed("the test receiver")
    message = str(info.value)
    assert "unexpected weights: model.extra.weight" in message
    assert "weights received twice: " in message and "lm_head.weight" in message
    assert "model.norm.weight (expected float32[16], got float32[17])" in message


def test_wrong_dtype_is_reported() -> None:
    weights = _weights()
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.bfloat16)
    buckets = _pack(weights, torch.float32, bucket_size_bytes=1 << 20, in_place=False)
    with pytest.raises(RefitIntegrityError, match=r"expected bfloat16\[16\], got float32\[16\]"):
        _read(buckets, manifest)


def test_manifest_comparison_names_differences() -> None:
    expected = WeightManifest({"a": TensorSpec((2, 3), torch.float32), "b": TensorSpec((4,), torch.float32)})
    offered = WeightManifest({"a": TensorSpec((3, 2), torch.float32), "c": TensorSpec((4,), torch.float32)})
    with pytest.raises(RefitIntegrityError) as info:
        expected.check_matches(offered, "the policy")
    message = str(info.value)
    assert "missing: b" in message and "unexpected: c" in message
    assert "a (expected float32[2, 3], got float32[3, 2])" in message
    expected.check_matches(WeightManifest(dict(expected)), "the policy")
    assert expected.nbytes == (6 + 4) * 4
    with pytest.raises(ValueError, match="appears twice"):
        WeightManifest.from_named_tensors([("a", torch.zeros(1)), ("a", torch.zeros(1))], None)
    with pytest.raises(ValueError, match="not a torch dtype"):
        dtype_from_name("float33")


def test_shard_fn_keeps_the_tensor_parallel_slice() -> None:
    weights = _weights()
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)
    buckets = _pack(weights, torch.float32, bucket_size_bytes=1500, in_place=False)

    def split_dim(name: str) -> int | None:
        if name.endswith("q_proj.weight"):
            return 0
        return 1 if name == "lm_head.weight" else None

    for rank in range(2):
        received = _read(buckets, manifest, tp_shard_fn(rank, 2, split_dim))
        q = weights["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(received["model.layers.0.self_attn.q_proj.weight"], q[rank * 8 : (rank + 1) * 8])
        assert torch.equal(
            received["lm_head.weight"], weights["lm_head.weight"][:, rank * 8 : (rank + 1) * 8]
        )
        assert torch.equal(received["model.norm.weight"], weights["model.norm.weight"])
    with pytest.raises(ValueError, match="tensor-parallel size that divides"):
        tp_shard_fn(0, 3, split_dim)("lm_head.weight", weights["lm_head.weight"])


def test_loader_that_stops_early_is_an_error() -> None:
    def lazy_loader(stream) -> None:
        next(iter(stream))

    with pytest.raises(RefitError, match="2 tensors of the stream were not loaded"):
        feed_loader(lazy_loader, iter([("a", torch.zeros(1)), ("b", torch.zeros(1)), ("c", torch.zeros(1))]))


def test_manifest_accepts_the_workers_plain_dicts() -> None:
    from_names = WeightManifest({"a": ((2, 3), "bfloat16"), "b": ([4], torch.float32)})
    assert from_names["a"] == TensorSpec((2, 3), torch.bfloat16)
    assert from_names["b"] == TensorSpec((4,), torch.float32)
    assert WeightManifest.coerce(from_names) is from_names
    assert WeightManifest.coerce({"a": ((2, 3), torch.bfloat16)})["a"] == from_names["a"]
    with pytest.raises(TypeError, match="expected \\(shape, dtype\\)"):
        WeightManifest({"a": ((2,), 7)})  # type: ignore[dict-item]
