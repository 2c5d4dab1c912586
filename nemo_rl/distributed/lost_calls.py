"""Worker calls that failed after the driver's last wait for them, kept until the run's workers shut down.

A call sent without waiting (:meth:`~nemo_rl.distributed.worker_groups.RayWorkerGroup.run_all_workers_deferred`)
raises its error at the next wait on its group. When there is no next wait, the group's ``shutdown`` reports
the failure here and the cluster's ``shutdown`` raises it, so that no worker error goes unseen.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


class LostCallError(RuntimeError):
    """Worker calls failed that the driver never waited for; one line per failure: the call, the worker and the
    error."""


class LostCalls:
    """The failures reported for one cluster, raised together by :meth:`raise_reported`."""

    def __init__(self) -> None:
        self._failures: list[str] = []

    def report(self, failure: str) -> None:
        """Log ``failure`` (one line: the call, the worker, the error) at once and keep it for :meth:`raise_reported`."""
        logger.error("%s", failure)
        self._failures.append(failure)

    def raise_reported(self) -> None:
        """Raise :class:`LostCallError` with the failures reported so far (once; nothing when there are none).

        Called while an exception propagates (from a ``finally`` or ``except`` block), it adds them to that
        exception as a note instead, so that the run's first error stays the one raised.
        """
        failures, self._failures = self._failures, []
        if not failures:
            return
        error = LostCallError(
            f"worker calls failed after the driver's last wait for them ({len(failures)}):\n"
            + "\n".join(failures)
        )
        in_flight = sys.exc_info()[1]
        if in_flight is None:
            raise error
        in_flight.add_note(str(error))
