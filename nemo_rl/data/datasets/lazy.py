"""The base of the datasets that make each item when it is read (raw rows converted, records processed)."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import TypeVar, overload

_T = TypeVar("_T")


class LazySequence(Sequence[_T]):
    """A sequence whose items are made on access by :meth:`_item`, so a large dataset is never converted or
    tokenized ahead of use. Indexing takes negative indices and slices (a slice makes its items at once);
    iteration makes one item at a time."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def _item(self, i: int) -> _T:
        """Make item ``i`` (``0 <= i < len(self)``)."""

    @overload
    def __getitem__(self, i: int) -> _T: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[_T]: ...

    def __getitem__(self, i: int | slice) -> _T | Sequence[_T]:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a dataset of {len(self)}")
        return self._item(i % len(self))

    def __iter__(self) -> Iterator[_T]:
        for i in range(len(self)):
            yield self._item(i)
