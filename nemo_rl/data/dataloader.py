"""A seeded, shuffling, resumable data loader for the driver process.

The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so the loader's whole state is
``(epoch, batches already taken in it)``: :meth:`StatefulDataLoader.state_dict` saves that pair with a
checkpoint and :meth:`StatefulDataLoader.load_state_dict` makes the next batch exactly the one that would
have come next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from nemo_rl.data.errors import DataError

T = TypeVar("T")
B = TypeVar("B")


class StatefulDataLoader(Generic[T, B]):
    """Batches of ``batch_size`` samples of ``dataset`` passed through ``collate_fn``.

    Iterating yields the rest of the current epoch, then moves to the next one; ``for batch in loader``
    in a loop over epochs therefore runs each epoch once, and resuming from a :meth:`state_dict` taken
    mid-epoch continues that epoch.

    Args:
        dataset: Any indexable sized collection of samples.
        batch_size: Samples per batch.
        shuffle: Draw a new seeded order every epoch; otherwise keep the dataset's order.
        seed: Seed of the shuffling.
        drop_last: Drop the last batch of an epoch when it is smaller than ``batch_size``.
        collate_fn: Turns a list of samples into a batch.
        batch_size_key: The config key that sets ``batch_size``, named in the error for data smaller than
            one batch.
        groups: Sample indices that are served together (for example the preference pairs of one prompt):
            shuffling then permutes the groups and keeps each group's samples consecutive, in order, so a
            batch holds whole groups (and pieces of at most two more at its ends). ``None`` shuffles samples.
        data_name: How errors name the data (e.g. ``"the training data (train.jsonl)"``).
    """

    def __init__(
        self,
        dataset: Sequence[T],
        *,
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        collate_fn: Callable[[list[T]], B],
        batch_size_key: str = "batch_size",
        groups: Sequence[Sequence[int]] | None = None,
        data_name: str = "the data",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        # The data's own defects are the user's to fix: DataError ends a script with one line (exit 2).
        if len(dataset) == 0:
            raise DataError(f"{data_name} holds no samples: check the data section of the config")
        if drop_last and len(dataset) < batch_size:
            raise DataError(
                f"{data_name} has {len(dataset)} samples, fewer than one batch ({batch_size_key}={batch_size}): "
                f"lower {batch_size_key} or give more data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.groups = [list(g) for g in groups] if groups is not None else None
        if self.groups is not None and sorted(i for g in self.groups for i in g) != list(range(len(dataset))):
            raise ValueError("groups must hold every sample index of the dataset exactly once")
        self._epoch = 0
        self._batch_index = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return len(self.dataset) // self.batch_size
        return -(-len(self.dataset) // self.batch_size)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        self._roll_over()
        return self._epoch

    @property
    def batch_index(self) -> int:
        """Batches already taken from the current epoch."""
        self._roll_over()
        return self._batch_index

    def epoch_order(self, epoch: int) -> list[int]:
        """Sample indices of ``epoch`` in the order they are served."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        rng = np.random.default_rng((self.seed, epoch))
        if self.groups is None:
            return rng.permutation(len(self.dataset)).tolist()
        return [i for g in rng.permutation(len(self.groups)).tolist() for i in self.groups[g]]

    def __iter__(self) -> Iterator[B]:
        self._roll_over()
        epoch = self._epoch
        order = self.epoch_order(epoch)
        while self._epoch == epoch and self._batch_index < len(self):
            start = self._batch_index * self.batch_size
            indices = order[start : start + self.batch_size]
            # Count the batch as taken before handing it out, so a checkpoint saved while it is being
            # trained on resumes with the one after it.
            self._batch_index += 1
            yield self.collate_fn([self.dataset[i] for i in indices])
        self._roll_over()

    def _roll_over(self) -> None:
        if self._batch_index >= len(self):
            self._epoch += 1
            self._batch_index = 0

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: the epoch and the batches taken from it (plus checks for resuming)."""
        self._roll_over()
        return {
            "epoch": self._epoch,
            "batch_index": self._batch_index,
            "seed": self.seed,
            "num_samples": len(self.dataset),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "grouped": self.groups is not None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next batch is the one that followed when it was saved."""
        # Checkpoints from before grouping existed were ungrouped.
        saved = {k: state.get(k, False) for k in ("seed", "num_samples", "batch_size", "shuffle", "grouped")}
        current = {
            "seed": self.seed,
            "num_samples": len(self.dataset),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "grouped": self.groups is not None,
        }
        if saved != current:
            raise ValueError(
                f"the data loader state was saved with {saved} but this loader has {current}: resume with the "
                "same data, batch size, shuffle, grouping and seed settings, or start without the saved state"
            )
        if not 0 <= state["batch_index"] <= len(self):
            raise ValueError(
                f"saved batch_index {state['batch_index']} is outside an epoch of {len(self)} batches"
            )
        self._epoch = int(state["epoch"])
        self._batch_index = int(state["batch_index"])
        self._roll_over()
