"""The stateful data loader: seeded epochs, drop_last, and exact resumption from a saved state."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from nemo_rl.config.data import DataConfig
from nemo_rl.data.collate_fn import rl_collate_fn
from nemo_rl.data.dataloader import StatefulDataLoader
from nemo_rl.data.datasets import ProcessedDataset, load_dataset_splits, prompt_groups
from nemo_rl.data.interfaces import DatumSpec, Record, TaskDataSpec
from nemo_rl.distributed.batched_data_dict import BatchedDataDict


def _loader(num: int = 10, **overrides: object) -> StatefulDataLoader[int, list[int]]:
    kwargs: dict[str, object] = {
        "batch_size": 3,
        "shuffle": True,
        "seed": 0,
        "drop_last": False,
        "collate_fn": list,
    }
    kwargs.update(overrides)
    return StatefulDataLoader(list(range(num)), **kwargs)  # type: ignore[arg-type]


def _take(loader: StatefulDataLoader[int, list[int]], num_batches: int) -> list[list[int]]:
    """The next ``num_batches`` batches, crossing epochs like a training loop over epochs does."""
    batches: list[list[int]] = []
    while len(batches) < num_batches:
        for batch in loader:
            batches.append(batch)
            if len(batches) == num_batches:
                break
    return batches


def test_epochs_cover_the_dataset_in_seeded_orders() -> None:
    loader = _loader()
    assert len(loader) == 4
    first = list(loader)
    assert [len(b) for b in first] == [3, 3, 3, 1]
    assert sorted(itertools.chain(*first)) == list(range(10))
    assert loader.epoch == 1 and loader.batch_index == 0
    second = list(loader)
    assert sorted(itertools.chain(*second)) == list(range(10)) and second != first
    assert list(_loader()) == first  # same seed, same order
    assert list(_loader(seed=1)) != first
    assert list(_loader(shuffle=False)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_drop_last() -> None:
    loader = _loader(drop_last=True)
    assert len(loader) == 3
    batches = list(loader)
    assert [len(b) for b in batches] == [3, 3, 3]
    with pytest.raises(ValueError, match="fewer than one batch"):
        _loader(num=2, drop_last=True)
    with pytest.raises(ValueError, match="holds no samples"):
        _loader(num=0)


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 5, 9])
def test_resume_gives_the_same_next_batches(stop_after: int) -> None:
    reference = _take(_loader(), stop_after + 6)
    interrupted = _loader()
    assert _take(interrupted, stop_after) == reference[:stop_after]
    state = interrupted.state_dict()
    resumed = _loader()
    resumed.load_state_dict(state)
    assert _take(resumed, 6) == reference[stop_after:]


def test_state_is_taken_after_the_batch_in_hand() -> None:
    loader = _loader()
    iterator = iter(loader)
    next(iterator)
    # Saved while the first batch is being trained on: resuming starts with the second.
    assert loader.state_dict()["batch_index"] == 1
    next(iterator), next(iterator), next(iterator)
    # The last batch of the epoch was handed out: the state already points at the next epoch.
    state = loader.state_dict()
    assert (state["epoch"], state["batch_index"]) == (1, 0)


def test_mismatched_state_is_refused() -> None:
    state = _loader().state_dict()
    with pytest.raises(ValueError, match="same data, batch size"):
        _loader(num=11).load_state_dict(state)
    with pytest.raises(ValueError, match="same data, batch size"):
        _loader(seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="outside an epoch"):
        _loader().load_state_dict({**state, "batch_index": 9})


def test_groups_stay_together_in_seeded_orders() -> None:
    groups = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9]]
    loader = _loader(groups=groups, batch_size=4)
    for epoch in range(3):
        order = loader.epoch_order(epoch)
        assert sorted(order) == list(range(10))
        # Each group's samples are consecutive and in their own order.
        assert all(order[order.index(g[0]) : order.index(g[0]) + len(g)] == g for g in groups)
    assert loader.epoch_order(0) != loader.epoch_order(1)
    state = _loader(groups=groups).state_dict()
    with pytest.raises(ValueError, match="grouping"):
        _loader().load_state_dict(state)
    with pytest.raises(ValueError, match="exactly once"):
        _loader(groups=[[0, 1], [1, 2]])


def test_prompt_groups_cut_each_prompts_pairs() -> None:
    def pair(prompt: str, answer: str) -> Record:
        user = {"role": "user", "content": prompt}
        return {
            "messages": [user, {"role": "assistant", "content": answer}],
            "rejected_messages": [user, {"role": "assistant", "content": "no"}],
        }

    records = [pair("a", "1"), pair("b", "1"), pair("a", "2"), pair("a", "3"), pair("b", "2")]
    dataset = ProcessedDataset(records, None, None, None, 0)  # type: ignore[arg-type]  # records only
    assert prompt_groups(dataset, 2) == [[0, 2], [3], [1, 4]]
    assert prompt_groups(dataset, 5) == [[0, 2, 3], [1, 4]]


def test_resume_with_processed_dataset_and_rl_collate() -> None:
    splits = load_dataset_splits(DataConfig(num_train_samples=12, num_val_samples=0))

    def processor(
        record: Record, spec: TaskDataSpec, tokenizer: object, max_seq_length: int, idx: int
    ) -> DatumSpec:
        # Tokenization is not under test here: carry the record through with its index.
        return DatumSpec(
            message_log=[],
            length=0,
            extra_env_info={"ground_truth": record.get("expected_answer")},
            loss_multiplier=1.0,
            idx=idx,
            task_name=spec.task_name,
        )

    spec = TaskDataSpec(
        task_name="math",
        prompt=None,
        system_prompt=None,
        add_bos=True,
        add_eos=True,
        add_generation_prompt=True,
    )
    dataset = ProcessedDataset(splits.train, processor, spec, None, 64)  # type: ignore[arg-type]

    def make() -> StatefulDataLoader[DatumSpec, BatchedDataDict[Any]]:
        return StatefulDataLoader(
            dataset, batch_size=4, shuffle=True, seed=7, drop_last=True, collate_fn=rl_collate_fn
        )

    reference = [b["idx"].tolist() for b in make()]
    first = make()
    taken = [b["idx"].tolist() for b in itertools.islice(first, 2)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    rest = [b["idx"].tolist() for b in resumed]
    assert taken + rest == reference
    assert sorted(itertools.chain(*reference)) == list(range(12))
