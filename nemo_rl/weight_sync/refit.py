"""The driver's refit call: run one refit across the policy and generation workers and report metrics.

Policy workers expose ``refit_send(sender, scope) -> TransferStats`` and generation workers
``refit_receive(receiver, scope) -> TransferStats`` (see :mod:`nemo_rl.weight_sync.interfaces`; ``scope`` is
the :data:`~nemo_rl.weight_sync.scope.RefitScope` the driver chose, the same for both ends); :func:`refit`
calls them all at once, waits with the transport's timeout, and on any failure aborts the other workers,
sweeps what the refit left behind and raises :class:`RefitError` naming the worker that failed.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from nemo_rl.weight_sync.errors import RefitError
from nemo_rl.weight_sync.interfaces import RefitTransport, TransferStats
from nemo_rl.weight_sync.scope import RefitScope, check_scope

SEND_METHOD = "refit_send"
"""Policy-worker method taking a :class:`WeightSender` and a :data:`RefitScope`, returning :class:`TransferStats`."""

RECEIVE_METHOD = "refit_receive"
"""Generation-worker method taking a :class:`WeightReceiver` and a :data:`RefitScope`, returning
:class:`TransferStats`."""

# After a failure, how long surviving workers get to notice the abort and release their segments before
# the driver sweeps: they wake at once from the store queue they wait on.
_ABORT_GRACE_S = 10.0
# The driver waits a little longer than the workers so their own (more precise) timeout error wins.
_DRIVER_TIMEOUT_MARGIN_S = 5.0

_refit_counter = itertools.count()


def new_refit_id() -> str:
    """A refit id unique to this driver process (letters, digits and dashes)."""
    return f"r{next(_refit_counter)}-{uuid.uuid4().hex[:8]}"


def refit(
    policy_workers: Sequence[Any],
    generation_workers: Sequence[Any],
    transport: RefitTransport,
    *,
    timeout_s: float,
    scope: RefitScope = "full",
    send_method: str = SEND_METHOD,
    receive_method: str = RECEIVE_METHOD,
) -> dict[str, float]:
    """:func:`refit_with_stats`'s ``refit/*`` metrics."""
    metrics, _ = refit_with_stats(
        policy_workers,
        generation_workers,
        transport,
        timeout_s=timeout_s,
        scope=scope,
        send_method=send_method,
        receive_method=receive_method,
    )
    return metrics


def refit_with_stats(
    policy_workers: Sequence[Any],
    generation_workers: Sequence[Any],
    transport: RefitTransport,
    *,
    timeout_s: float,
    scope: RefitScope = "full",
    send_method: str = SEND_METHOD,
    receive_method: str = RECEIVE_METHOD,
) -> tuple[dict[str, float], list[TransferStats]]:
    """Move the policy's weights into the generation workers; returns ``refit/*`` metrics.

    ``policy_workers`` / ``generation_workers`` are Ray actor handles in rank order (e.g. a
    ``RayWorkerGroup``'s ``workers``), matching the transport's placement. ``timeout_s`` bounds the whole
    refit (pass the ``RefitConfig.timeout_s`` the transport was built with); ``scope`` says what moves
    (:mod:`nemo_rl.weight_sync.scope`) and is passed to every sender and receiver. Metrics: ``refit/bytes``
    (payload bytes of one copy of the weights, in the generation dtype), ``refit/time_s`` (wall time seen by
    the driver), ``refit/gbps`` (``refit/bytes`` per second, in GB/s of 1e9 bytes), ``refit/num_buckets``
    and ``refit/bytes_received`` (summed over generation workers). Also returns the receivers' stats, in rank
    order (the refit guard reads their checksums).
    """
    if len(policy_workers) != transport.num_senders or len(generation_workers) != transport.num_receivers:
        raise ValueError(
            f"the transport was built for {transport.num_senders} policy and {transport.num_receivers} "
            f"generation workers, got {len(policy_workers)} and {len(generation_workers)}"
        )
    check_scope(scope)
    refit_id = new_refit_id()
    senders, receivers = transport.endpoints(refit_id)
    start_s = time.perf_counter()
    labels: dict[ray.ObjectRef, str] = {}
    for rank, (worker, sender) in enumerate(zip(policy_workers, senders, strict=True)):
        labels[getattr(worker, send_method).remote(sender, scope)] = f"policy worker {rank}"
    for index, (worker, receiver) in enumerate(zip(generation_workers, receivers, strict=True)):
        labels[getattr(worker, receive_method).remote(receiver, scope)] = f"generation worker {index}"
    failed = True
    try:
        results = _wait_all(labels, refit_id, time.monotonic() + timeout_s + _DRIVER_TIMEOUT_MARGIN_S)
        failed = False
    except BaseException:
        transport.abort(refit_id)
        _wait_quietly(list(labels), _ABORT_GRACE_S)
        raise
    finally:
        if failed:
            transport.cleanup(refit_id)
    time_s = time.perf_counter() - start_s
    metrics = _refit_metrics(
        results, len(senders), len(receivers), time_s, refit_id, send_method, receive_method
    )
    return metrics, results[len(senders) :]


def _refit_metrics(
    results: list[Any],
    num_senders: int,
    num_receivers: int,
    time_s: float,
    refit_id: str,
    send_method: str,
    receive_method: str,
) -> dict[str, float]:
    """``refit/*`` metrics (see :func:`refit`) from the senders' results, then the receivers'; a result that
    is not :class:`TransferStats` means a refit method broke the contract."""
    sent = [stats for stats in results[:num_senders] if isinstance(stats, TransferStats)]
    received = [stats for stats in results[num_senders:] if isinstance(stats, TransferStats)]
    if len(sent) != num_senders or len(received) != num_receivers:
        raise RefitError(
            f"refit {refit_id}: the workers' refit methods must return TransferStats "
            f"(check {send_method!r} and {receive_method!r})"
        )
    # One copy of the weights: each stream's largest sender (several nodes may send the same stream).
    streams = {stats.stream for stats in sent}
    wire_bytes = sum(max(s.wire_bytes for s in sent if s.stream == stream) for stream in streams)
    num_buckets = sum(max(s.num_buckets for s in sent if s.stream == stream) for stream in streams)
    return {
        "refit/bytes": float(wire_bytes),
        "refit/time_s": time_s,
        "refit/gbps": wire_bytes / time_s / 1e9,
        "refit/num_buckets": float(num_buckets),
        "refit/bytes_received": float(sum(stats.wire_bytes for stats in received)),
    }


_PEER_DEATH_WAIT_S = 5.0
"""Seconds a refit that failed on one worker waits for the others' outcome, to name a dead one."""


def _wait_all(labels: dict[ray.ObjectRef, str], refit_id: str, deadline: float) -> list[Any]:
    """Results of every ref in order; raises :class:`RefitError` naming the first worker that failed."""
    pending = list(labels)
    results: dict[ray.ObjectRef, Any] = {}
    while pending:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            waiting = ", ".join(labels[ref] for ref in pending)
            raise RefitError(f"refit {refit_id} timed out waiting for {waiting}")
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining_s)
        for ref in ready:
            try:
                results[ref] = ray.get(ref, timeout=remaining_s)
            except RayActorError as err:
                raise RefitError(f"{labels[ref]} died during refit {refit_id}: {err}") from err
            except GetTimeoutError as err:
                raise RefitError(f"refit {refit_id} timed out waiting for {labels[ref]}") from err
            except Exception as err:
                # A collective fails on every surviving rank when one peer dies: name the dead one if it is.
                _raise_if_a_peer_died([r for r in labels if r not in results and r != ref], labels, refit_id)
                raise RefitError(f"{labels[ref]} failed during refit {refit_id}: {err}") from err
    return [results[ref] for ref in labels]


def _raise_if_a_peer_died(refs: list[ray.ObjectRef], labels: dict[ray.ObjectRef, str], refit_id: str) -> None:
    """Raise :class:`RefitError` naming a worker of ``refs`` that died (waiting up to a few seconds for Ray to
    see the death), so the error names the cause rather than a survivor's broken connection."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_PEER_DEATH_WAIT_S) if refs else ([], [])
    for ref in ready:
        try:
            ray.get(ref, timeout=_PEER_DEATH_WAIT_S)
        except RayActorError as err:
            raise RefitError(f"{labels[ref]} died during refit {refit_id}: {err}") from err
        except Exception:  # another survivor's consequence of the same failure
            continue


def _wait_quietly(refs: list[ray.ObjectRef], timeout_s: float) -> None:
    """Give the surviving workers ``timeout_s`` to finish after an abort; their errors are consequences."""
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
