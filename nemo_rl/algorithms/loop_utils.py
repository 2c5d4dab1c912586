"""Small pieces shared by the algorithm loops."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

B = TypeVar("B")


def batches_until(loader: Iterable[B], steps_done: Callable[[], int], total_steps: int) -> Iterator[B]:
    """Batches of ``loader``, epoch after epoch, until ``steps_done()`` reaches ``total_steps``.

    ``steps_done`` is read before each batch, so the caller advances it as it trains; a resumed loader
    continues from its saved position.
    """
    while steps_done() < total_steps:
        for batch in loader:
            if steps_done() >= total_steps:
                return
            yield batch
