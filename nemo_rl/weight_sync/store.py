"""The refit rendezvous: a TCP key-value store hosted by the driver, reached by every refit endpoint.

It carries the shared-memory transport's bucket announcements and acknowledgements (blocking queues, so no
one polls) and the collective transport's process-group rendezvous. It is separate from the training
job's own store, so refit never touches the policy's default process group.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from nemo_rl.weight_sync.errors import RefitError


@dataclass(frozen=True)
class StoreAddress:
    """Where the refit store listens."""

    host: str
    port: int


class StoreServer:
    """The driver-side store: hosts the key-value server for the transport's lifetime."""

    def __init__(self, host: str, timeout_s: float) -> None:
        # Port 0 lets the OS pick a free port; clients learn it from :attr:`address`.
        self._store = dist.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.address = StoreAddress(host, self._store.port)

    @property
    def store(self) -> dist.Store:
        """The driver's own handle on the store."""
        return self._store


_clients: dict[tuple[str, int, int], dist.TCPStore] = {}


def connect_store(address: StoreAddress, timeout_s: float) -> dist.TCPStore:
    """A client of the refit store, reused for the life of the process (one per thread).

    A TCPStore client serialises its requests on one socket, so a thread blocked in a queue pop would
    stall another thread's requests: threads (only in single-process tests) get their own client.
    """
    key = (address.host, address.port, threading.get_ident())
    client = _clients.get(key)
    if client is None:
        client = dist.TCPStore(
            address.host,
            address.port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        _clients[key] = client
    return client


def close_store_clients() -> None:
    """Drop this process's store clients (worker shutdown)."""
    _clients.clear()


def pop_message(store: dist.Store, queue: str, deadline: float, waiting_for: str) -> bytes:
    """Pop the next message of ``queue``, blocking until ``deadline`` (a ``time.monotonic`` value).

    Raises :class:`RefitError` saying what was awaited when the deadline passes.
    """
    remaining_s = deadline - time.monotonic()
    if remaining_s <= 0:
        raise RefitError(f"refit timed out waiting for {waiting_for}")
    store.set_timeout(datetime.timedelta(seconds=remaining_s))
    try:
        return store.queue_pop(queue, block=True)
    except dist.DistStoreError as err:
        raise RefitError(f"refit timed out waiting for {waiting_for}: {err}") from err
