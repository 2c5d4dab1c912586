"""Shared-memory refit segments: swept when a killed run left them, and a clear error when ``/dev/shm``
cannot hold them. In one process, no Ray."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import torch

import nemo_rl.weight_sync.shm_segments as shm
from nemo_rl.weight_sync import RefitError, TransportSettings, WeightManifest, build_refit_transport
from nemo_rl.weight_sync.buckets import align_up


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_leftovers_of_dead_writers_are_swept_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    tag = uuid.uuid4().hex[:8]
    dead = tmp_path / f"{shm.SEGMENT_NAME_PREFIX}{tag}_r0_w0_p{_dead_pid()}_slot0_0"
    live = tmp_path / f"{shm.SEGMENT_NAME_PREFIX}{tag}_r0_w0_p{os.getpid()}_slot0_0"
    unnamed = tmp_path / f"{shm.SEGMENT_NAME_PREFIX}{tag}_r0_w0_slot0"  # no writer pid: not ours to judge
    for path in (dead, live, unnamed):
        path.write_bytes(b"x")
    transport = build_refit_transport(
        "shared_memory",
        TransportSettings(torch.float32, 1 << 20, 30.0, "127.0.0.1"),
        policy_node_ids=["n"],
        generation_node_ids=["n"],
    )
    try:
        assert not dead.exists() and live.exists() and unnamed.exists()
    finally:
        transport.shutdown()


def test_one_segment_for_weights_in_one_bucket_and_a_full_dev_shm_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weights = {"a": torch.randn(64, 16), "b": torch.randn(16)}
    manifest = WeightManifest.from_named_tensors(weights.items(), torch.float32)
    transport = build_refit_transport(
        "shared_memory",
        TransportSettings(torch.float32, 1 << 20, 30.0, "127.0.0.1"),
        policy_node_ids=["n"],
        generation_node_ids=["n"],
    )
    sizes: list[int] = []
    created: list[shm.Segment] = []
    create = shm.Segment.create

    def recording_create(name: str, nbytes: int, **kwargs: bool) -> shm.Segment:
        sizes.append(nbytes)
        created.append(create(name, nbytes, **kwargs))
        return created[-1]

    monkeypatch.setattr(shm.Segment, "create", staticmethod(recording_create))
    received: dict[str, torch.Tensor] = {}

    def load(stream: object) -> None:
        for name, tensor in stream:  # type: ignore[attr-defined]
            received[name] = tensor.clone()

    try:
        (sender,), (receiver,) = transport.endpoints("r0")
        reader = threading.Thread(target=receiver.receive, args=(load, manifest))
        reader.start()
        sender.send(iter(weights.items()))
        reader.join(timeout=60)
        assert received.keys() == weights.keys()
        assert sizes == [align_up(1 << 20)]  # one bucket holds the weights: the second slot is never made
        # Memory backs what was sent (4,160 bytes: two 4 KiB pages), not the 1 MiB bucket.
        assert created[0].path.stat().st_blocks * 512 <= 2 * 4096 < (1 << 20)

        def no_space(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(shm.os, "posix_fallocate", no_space)
        with pytest.raises(RefitError, match=r"/dev/shm cannot hold 1.0 MiB of a refit segment .*--shm-size"):
            shm.Segment.create(f"{shm.SEGMENT_NAME_PREFIX}{uuid.uuid4().hex[:8]}_test", 1 << 20)
        # A bucket segment is reserved as it fills: the error comes before the copy that would not fit.
        with pytest.raises(RefitError, match=r"cannot hold 0.0 MiB of a refit segment"):
            created[0].reserve(created[0].reserved + 8)
    finally:
        transport.shutdown()
