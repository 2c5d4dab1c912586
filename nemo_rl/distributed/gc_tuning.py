"""The garbage collector's thresholds in the processes a run starts.

Importing torch and transformers creates about a million long-lived objects, and with Python's default
thresholds (700, 10, 10) the collector runs about a thousand young collections and several full ones over
them while they are imported, a sizeable share of a policy worker's start-up CPU; with a first threshold of
10,000 the same imports collect far less and no full collection runs (benchmarks/README.md, "What runs while
the policy workers start; garbage collection during imports", has the measurements). Every Ray worker process of the job (through Ray's
``worker_process_setup_hook``, which runs before the actor's module is imported) and the example scripts'
drivers use these thresholds for their whole life: cyclic garbage is still collected, after 10,000 container
allocations instead of 700, a difference of kilobytes.
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (10_000, 10, 10)
"""``gc.set_threshold`` arguments: young collections every 10,000 net container allocations (Python's
default is 700), the older generations' defaults."""

WORKER_PROCESS_SETUP_HOOK = f"{__name__}.use_gc_thresholds"
"""The job's ``runtime_env["worker_process_setup_hook"]``: every Ray worker process calls it when it starts."""


def use_gc_thresholds() -> None:
    """Set this process's collector thresholds to :data:`GC_THRESHOLDS`."""
    gc.set_threshold(*GC_THRESHOLDS)
