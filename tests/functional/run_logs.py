"""Reading what a script under test logged: its ``metrics.jsonl``, possibly while the run still writes it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_records(log_dir: Path, *, while_written: bool = False) -> list[dict[str, Any]]:
    """Every line of ``log_dir/metrics.jsonl``; ``while_written`` skips a last line still being written."""
    lines = [line for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if not (while_written and i == len(lines) - 1):
                raise
    return records
