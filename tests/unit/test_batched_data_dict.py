"""BatchedDataDict: concatenation, sharding (with length balancing), reordering and slicing helpers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict


def make_batch(n: int = 8) -> BatchedDataDict[Any]:
    """``n`` samples: ``ids`` [n, 3] with row i = i, ``idx`` [n], ``text`` list."""
    return BatchedDataDict(
        {
            "ids": torch.arange(n).repeat_interleave(3).reshape(n, 3),
            "idx": torch.arange(n),
            "text": [f"s{i}" for i in range(n)],
        }
    )


def test_size_and_value_checks() -> None:
    assert make_batch(5).size == 5
    assert BatchedDataDict().size == 0
    with pytest.raises(ValueError, match="different batch sizes"):
        _ = BatchedDataDict({"a": torch.zeros(3), "b": [1, 2]}).size
    with pytest.raises(TypeError, match="0-dim tensor"):
        _ = BatchedDataDict({"a": torch.tensor(1.0)}).size
    with pytest.raises(TypeError, match="must be torch tensors"):
        _ = BatchedDataDict({"a": "abc"}).size


def test_generic_in_value_type() -> None:
    data: BatchedDataDict[torch.Tensor] = BatchedDataDict[torch.Tensor]({"x": torch.ones(2)})
    assert isinstance(data, dict)
    assert data.size == 2


def test_from_batches_pads_dim1_per_key() -> None:
    first = {"input_ids": torch.tensor([[1, 2, 3]]), "mask": torch.tensor([[1, 1, 1]]), "text": ["a"]}
    second = {"input_ids": torch.tensor([[4], [5]]), "mask": torch.tensor([[1], [1]]), "text": ["b", "c"]}
    merged = BatchedDataDict.from_batches([first, second], pad_value_dict={"input_ids": -1})
    assert merged.size == 3
    assert torch.equal(merged["input_ids"], torch.tensor([[1, 2, 3], [4, -1, -1], [5, -1, -1]]))
    assert torch.equal(merged["mask"], torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0]]))
    assert merged["text"] == ["a", "b", "c"]
    # 1-D tensors are concatenated as they are.
    lengths = BatchedDataDict.from_batches([{"n": torch.tensor([1])}, {"n": torch.tensor([2, 3])}])
    assert torch.equal(lengths["n"], torch.tensor([1, 2, 3]))


def test_from_batches_rejects_mismatched_batches() -> None:
    with pytest.raises(ValueError, match="same keys"):
        BatchedDataDict.from_batches([{"a": [1]}, {"b": [1]}])
    with pytest.raises(TypeError, match="mixes value types"):
        BatchedDataDict.from_batches([{"a": [1]}, {"a": torch.tensor([1])}])
    with pytest.raises(ValueError, match="at least one batch"):
        BatchedDataDict.from_batches([])


def test_shard_contiguous_and_by_global_batch() -> None:
    data = make_batch(8)
    shards = data.shard_by_batch_size(2)
    assert [s["idx"].tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shards[1]["text"] == ["s4", "s5", "s6", "s7"]
    # With global batches of 4, each shard holds its half of every global batch, in order.
    shards = data.shard_by_batch_size(2, batch_size=4)
    assert [s["idx"].tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert torch.equal(shards[1]["ids"][:, 0], torch.tensor([2, 3, 6, 7]))


def test_shard_uneven_errors_and_allowed() -> None:
    data = make_batch(8)
    with pytest.raises(ValueError, match=r"8 samples\) into 3 equal shards.*allow_uneven_shards=True"):
        data.shard_by_batch_size(3)
    with pytest.raises(ValueError, match="global batches of 3"):
        data.shard_by_batch_size(1, batch_size=3)
    with pytest.raises(ValueError, match="each global batch of 4"):
        data.shard_by_batch_size(3, batch_size=4)
    shards = data.shard_by_batch_size(3, allow_uneven_shards=True)
    assert [s["idx"].tolist() for s in shards] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    shards = make_batch(2).shard_by_batch_size(3, allow_uneven_shards=True)
    assert [s.size for s in shards] == [1, 1, 0]
    assert shards[2]["ids"].shape == (0, 3)


def test_balance_by_length_evens_token_counts_and_round_trips() -> None:
    skewed: BatchedDataDict[Any] = BatchedDataDict(
        {"input_lengths": torch.tensor([10, 9, 8, 7, 1, 2, 3, 4]), "idx": torch.arange(8)}
    )
    assert [int(s["input_lengths"].sum()) for s in skewed.shard_by_batch_size(2)] == [34, 10]
    indices = skewed.shard_indices(2, balance_by_length_key="input_lengths")
    balanced = skewed.shard_by_batch_size(2, balance_by_length_key="input_lengths")
    sums = [int(s["input_lengths"].sum()) for s in balanced]
    assert abs(sums[0] - sums[1]) <= 2 and sum(sums) == 44
    assert [s.size for s in balanced] == [4, 4]
    # Each shard keeps its samples in their original relative order, and the indices describe them.
    for shard, shard_idx in zip(balanced, indices, strict=True):
        assert shard["idx"].tolist() == shard_idx == sorted(shard_idx)

    # Results computed per shard go back to the original order.
    results = [
        BatchedDataDict({"out": s["idx"] * 10, "tag": [f"t{i}" for i in s["idx"].tolist()]}) for s in balanced
    ]
    merged = BatchedDataDict.from_shards(results, indices)
    assert merged["out"].tolist() == [i * 10 for i in range(8)]
    assert merged["tag"] == [f"t{i}" for i in range(8)]


def test_balance_within_each_global_batch() -> None:
    lengths = [5, 50, 6, 60, 7, 70, 8, 80]
    data = BatchedDataDict({"len": lengths, "idx": list(range(8))})
    indices = data.shard_indices(2, batch_size=4, balance_by_length_key="len")
    for shard in indices:
        # First half of each shard comes from global batch 0, second half from global batch 1.
        assert all(i < 4 for i in shard[:2]) and all(i >= 4 for i in shard[2:])
    per_batch_tokens = [
        [sum(lengths[i] for i in shard[g * 2 : g * 2 + 2]) for shard in indices] for g in range(2)
    ]
    # The best split of each global batch (contiguous halves would give [55, 66] and [75, 88]).
    assert per_batch_tokens == [[65, 56], [87, 78]]
    with pytest.raises(KeyError, match="not in the batch"):
        data.shard_indices(2, balance_by_length_key="missing")


def test_reorder_data_round_trip_and_validation() -> None:
    data = make_batch(5)
    permutation = [3, 0, 4, 1, 2]
    shuffled = data.select_indices(permutation)
    shuffled.reorder_data(permutation)
    assert torch.equal(shuffled["ids"], data["ids"])
    assert shuffled["text"] == data["text"]
    with pytest.raises(ValueError, match="permutation of range"):
        shuffled.reorder_data([0, 0, 1, 2, 3])


def test_chunk_is_contiguous_and_near_even() -> None:
    data = make_batch(7)
    chunks = [data.chunk(rank, 3)["idx"].tolist() for rank in range(3)]
    assert chunks == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="0 <= rank < chunks"):
        data.chunk(3, 3)


def test_microbatches_slice_get_batch() -> None:
    data = make_batch(5)
    sizes = [mb.size for mb in data.make_microbatch_iterator(2)]
    assert sizes == [2, 2, 1]
    assert data.slice(1, 3)["text"] == ["s1", "s2"]
    with pytest.raises(IndexError):
        data.slice(2, 6)
    assert data.get_batch(1, 2)["idx"].tolist() == [2, 3]
    assert data.get_batch(2, 2)["idx"].tolist() == [4]
    with pytest.raises(IndexError):
        data.get_batch(3, 2)
    with pytest.raises(ValueError):
        next(data.make_microbatch_iterator(0))


def test_select_indices() -> None:
    data = make_batch(4)
    picked = data.select_indices(torch.tensor([3, 1, 1]))
    assert picked["idx"].tolist() == [3, 1, 1]
    assert picked["text"] == ["s3", "s1", "s1"]
    with pytest.raises(IndexError, match="outside a batch of 4"):
        data.select_indices([4])


def test_repeat_interleave_deep_copies_list_entries() -> None:
    data: BatchedDataDict[Any] = BatchedDataDict(
        {"x": torch.tensor([[1, 2], [3, 4]]), "log": [[{"role": "user"}], [{"role": "system"}]]}
    )
    repeated = data.repeat_interleave(3)
    assert repeated.size == 6
    assert repeated["x"][:, 0].tolist() == [1, 1, 1, 3, 3, 3]
    assert [entry[0]["role"] for entry in repeated["log"]] == ["user"] * 3 + ["system"] * 3
    repeated["log"][0].append({"role": "assistant"})
    assert len(repeated["log"][1]) == 1 and len(data["log"][0]) == 1


def test_to_and_copy() -> None:
    data = make_batch(2)
    assert data.to("cpu") is data
    assert data.to(torch.device("cpu"))["ids"].device.type == "cpu"
    shallow = data.copy()
    assert isinstance(shallow, BatchedDataDict) and shallow is not data
    assert shallow["ids"] is data["ids"]
    shallow["extra"] = [0, 1]
    assert "extra" not in data


def test_groups_of_consecutive_samples_stay_whole() -> None:
    # Four (chosen, rejected) pairs; balancing by length must deal whole pairs and keep each pair in order.
    data = BatchedDataDict({"x": torch.arange(8), "input_lengths": torch.tensor([9, 1, 2, 2, 8, 8, 1, 1])})
    indices = data.shard_indices(2, batch_size=8, balance_by_length_key="input_lengths", group_size=2)
    assert sorted(i for shard in indices for i in shard) == list(range(8))
    for shard in indices:
        assert all(shard[k] % 2 == 0 and shard[k + 1] == shard[k] + 1 for k in range(0, len(shard), 2))
    # Pair lengths 10, 4, 16, 2: the balanced deal puts the longest pair with the shortest.
    assert sorted(indices) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    shards = data.shard_by_batch_size(2, batch_size=4, group_size=2)
    assert [s["x"].tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="group_size=2"):
        data.slice(0, 7).shard_indices(1, group_size=2)
    with pytest.raises(ValueError, match="groups of 2 samples"):
        data.shard_indices(3, batch_size=8, group_size=2)
