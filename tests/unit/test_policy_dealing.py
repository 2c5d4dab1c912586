"""How the driver-side Policy deals rows to the data-parallel ranks when prompts are shared."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.lm_policy import Policy


def _grouped_batch(num_prompts: int, group: int, prompt_len: int = 4) -> BatchedDataDict[Any]:
    """``group`` consecutive rows per prompt; responses of different lengths so length balancing would
    otherwise separate a prompt's rows."""
    rows, masks, lengths = [], [], []
    for p in range(num_prompts):
        prompt = [10 + p] * prompt_len
        for s in range(group):
            response = [50 + s] * (1 + (s * 3 + p) % 7)
            ids = prompt + response
            rows.append(ids + [0] * (16 - len(ids)))
            masks.append([0] * prompt_len + [1] * len(response) + [0] * (16 - len(ids)))
            lengths.append(len(ids))
    return BatchedDataDict(
        {
            "input_ids": torch.tensor(rows),
            "token_mask": torch.tensor(masks),
            "input_lengths": torch.tensor(lengths),
        }
    )


def _policy(shared: bool, dp_size: int = 2) -> Any:
    return SimpleNamespace(
        cfg=SimpleNamespace(shared_prefix=SimpleNamespace(enabled=shared)), dp_size=dp_size
    )


def test_runs_of_a_shared_prompt_are_dealt_whole() -> None:
    data = _grouped_batch(num_prompts=4, group=4)
    run = Policy._prompt_run_length(_policy(shared=True), data, rows_per_shard=8)
    assert run == 4
    shards = data.shard_by_batch_size(2, batch_size=16, balance_by_length_key="input_lengths", group_size=run)
    for shard in shards:
        prompts = {tuple(row[:4]) for row in shard["input_ids"].tolist()}
        assert len(prompts) * 4 == shard.size  # every prompt on a rank brings all four of its rows


def test_rows_are_dealt_one_by_one_when_nothing_is_shared_or_runs_do_not_fit() -> None:
    data = _grouped_batch(num_prompts=4, group=4)
    assert Policy._prompt_run_length(_policy(shared=False), data, rows_per_shard=8) == 1
    assert Policy._prompt_run_length(_policy(shared=True, dp_size=1), data, rows_per_shard=16) == 1
    # A shard of 6 rows cannot hold whole runs of 4.
    assert Policy._prompt_run_length(_policy(shared=True), data, rows_per_shard=6) == 1
    # Runs of unequal length (a prompt with one extra row) are dealt row by row.
    uneven = data.select_indices([*range(16), 15])
    assert Policy._prompt_run_length(_policy(shared=True), uneven, rows_per_shard=17) == 1
    # Every prompt different: no runs.
    assert Policy._prompt_run_length(_policy(shared=True), _grouped_batch(8, 1), rows_per_shard=4) == 1
