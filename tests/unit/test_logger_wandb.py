"""The W&B backend in offline mode: the run written under log_dir holds the logged history and config."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from nemo_rl.config.logger import LoggerConfig, WandbConfig
from nemo_rl.utils.logger import Logger

# A .wandb file is a LevelDB-style log: a 7-byte file header, then 32 KiB blocks of chunks, each with a
# 7-byte header (crc32, length, type); a record too long for a block is split FIRST/MIDDLE/LAST.
_BLOCK_BYTES = 32 * 1024
_HEADER_BYTES = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _read_wandb_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    offset = _HEADER_BYTES
    records: list[Any] = []
    pending = b""
    while offset + _HEADER_BYTES <= len(data):
        room = _BLOCK_BYTES - offset % _BLOCK_BYTES
        if room < _HEADER_BYTES:  # block trailer padding
            offset += room
            continue
        checksum, length, kind = struct.unpack("<IHB", data[offset : offset + _HEADER_BYTES])
        if kind == 0:  # zero padding at the end of a block
            offset += room
            continue
        if offset + _HEADER_BYTES + length > len(data):  # the writer is mid-record
            break
        payload = data[offset + _HEADER_BYTES : offset + _HEADER_BYTES + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum
        offset += _HEADER_BYTES + length
        pending = payload if kind in (_FULL, _FIRST) else pending + payload
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run_holds_history_and_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No network and no credentials: offline mode must not try to reach the server.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)  # anything W&B writes outside log_dir would show up here
    cfg = LoggerConfig(
        log_dir=str(tmp_path / "logs"),
        wandb_enabled=True,
        wandb=WandbConfig(project="unit", name="offline-check"),
        console_enabled=False,
        monitor_gpus=False,
        progress_bar=False,
    )
    logger = Logger(cfg)
    logger.log_hyperparams({"grpo": {"num_generations_per_prompt": 4}})
    for step, loss in [(1, 1.5), (2, 0.75)]:
        logger.log_metrics({"loss": loss}, step, prefix="train")
    logger.log_metrics({"accuracy": 0.5}, 2, prefix="validation")
    logger.close()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    run_dirs = list((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, f"expected one offline run under log_dir, found {run_dirs}"
    (run_file,) = run_dirs[0].glob("run-*.wandb")
    # W&B's writer runs in its own service process and may still be flushing when finish() returns;
    # the run is complete once its "exit" record is on disk.
    deadline = time.monotonic() + 60
    records = _read_wandb_records(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = _read_wandb_records(run_file)

    history = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.append(row)
    logged = [(row["_step"], row.get("train/loss"), row.get("validation/accuracy")) for row in history]
    assert logged == [(1, 1.5, None), (2, 0.75, 0.5)]

    configs = [r.config for r in records if r.WhichOneof("record_type") == "config"]
    config_items = {item.key: json.loads(item.value_json) for c in configs for item in c.update}
    assert config_items["grpo"] == {"num_generations_per_prompt": 4}
