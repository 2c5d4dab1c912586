"""A pool of verifier processes where every answer has its own time limit.

Verifiers such as math-verify can run for ever on adversarial answers (sympy simplifying ``9^{9^{9^9}}``),
and their built-in ``signal.alarm`` timeouts only work in a process's main thread, not inside a Ray actor's
threads. So each answer is checked in a separate *process*: when an answer exceeds ``timeout_s`` its process
is killed (nothing in it can resist SIGKILL), the answer scores 0 and a fresh process takes its place. A
process that crashes is replaced the same way. One answer's deadline starts when it is handed to a ready
process, so a slow replacement start-up never eats another answer's time.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import resource
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger(__name__)

VerifyFn = Callable[[str, str], float | tuple[float, str | None]]
"""``verify(response, ground_truth) -> score`` or ``-> (score, extracted answer)``; must be a module-level
function (it is pickled by name)."""

WORKER_STARTUP_TIMEOUT_S = 300.0
"""Longest a verifier process may take to start (import its libraries) before the pool gives up."""

_READY = "ready"


@dataclass(frozen=True)
class VerifyOutcome:
    """The verdict on one answer."""

    score: float
    """The verifier's score; 0 when it timed out or failed."""

    timed_out: bool = False
    """The verifier exceeded the time limit and was killed."""

    error: str | None = None
    """Why the verifier failed (exception text, or a crashed process), if it did."""

    answer: str | None = None
    """The answer the verifier extracted, when it returns one."""


def _worker_main(
    conn: Connection,
    verify_fn: VerifyFn,
    memory_limit_bytes: int | None,
    warm_up: Sequence[tuple[str, str]] = (),
) -> None:
    """Loop of one verifier process: receive (index, response, ground truth), send (index, score, error,
    answer)."""
    # The parent handles Ctrl-C and kills us; a KeyboardInterrupt traceback per worker is only noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_limit_bytes is not None:
        # An answer that makes the verifier allocate without bound gets a MemoryError (scored 0), not the
        # whole machine: the limit is on this process's address space.
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    # ``verify_fn``'s module (and its heavy imports) was loaded while unpickling the arguments. Its first calls
    # also build parsers and import more lazily (a noticeable pause for math-verify's first fraction or symbol;
    # benchmarks/README.md): done here, before the pool is waited on, not on a training step's answers.
    for response, ground_truth in warm_up:
        verify_fn(response, ground_truth)
    conn.send(_READY)
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        index, response, ground_truth = task
        try:
            result = verify_fn(response, ground_truth)
            score, answer = result if isinstance(result, tuple) else (result, None)
            conn.send((index, float(score), None, answer))
        except Exception as err:  # a verifier bug on one answer must not take the batch down
            conn.send((index, 0.0, f"{type(err).__name__}: {err}", None))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    started_at: float
    ready: bool = False
    task: int | None = None
    deadline: float = 0.0


class VerifierPool:
    """``num_workers`` verifier processes scoring answers in parallel, each answer within ``timeout_s``.

    Args:
        verify_fn: Module-level ``(response, ground_truth) -> score`` run in the worker processes.
        num_workers: Processes to keep alive.
        timeout_s: Time limit per answer; a slower answer scores 0 and its process is replaced.
        memory_limit_mb: Address-space limit of each verifier process (``None``: none); an answer that
            needs more scores 0.
        max_response_chars: Responses longer than this are cut to their last ``max_response_chars``
            characters (where a final answer is) before verifying (``None``: no cap).
        warm_up: ``(response, ground_truth)`` pairs each process verifies once when it starts, results
            discarded, so first-call costs (lazy imports, parser construction) are not paid on real answers.
        preload: Modules the fork server imports, after ``verify_fn``'s, before it forks any verifier
            process: what they import or compute at import time is paid once and shared by every process
            (a module can warm a verifier up there, as ``nemo_rl.environments.math_verifier_warm_up``).
            The fork server is one per process: only the first pool that starts it chooses its modules.
        start_on_first_use: Start the processes (and the fork server) when the first answer arrives, not
            here. For a caller that settles most answers without the verifier: the start's CPU is not
            spent while the rest of a job starts, and is never spent if no answer needs the verifier.
    """

    def __init__(
        self,
        verify_fn: VerifyFn,
        *,
        num_workers: int,
        timeout_s: float,
        memory_limit_mb: int | None = None,
        max_response_chars: int | None = None,
        warm_up: Sequence[tuple[str, str]] = (),
        preload: Sequence[str] = (),
        start_on_first_use: bool = False,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"a verifier pool needs at least one worker, got num_workers={num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"the verification time limit must be positive, got {timeout_s}")
        self._verify_fn = verify_fn
        self._timeout_s = timeout_s
        self._memory_limit_bytes = None if memory_limit_mb is None else memory_limit_mb * 2**20
        self._max_response_chars = max_response_chars
        self._warm_up = list(warm_up)
        # forkserver, not fork: the parent may be a threaded Ray actor, and a child forked from it could
        # inherit locks held by other threads. The fork server is single-threaded and preloads the verifier's
        # module, so replacing a killed worker costs a fork, not a fresh interpreter importing sympy. It also
        # preloads Ray: every process multiprocessing starts re-runs the parent's main script, which in a Ray
        # actor is Ray's worker script, and importing Ray there cost each verifier process CPU (benchmarks/README.md).
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(["ray", verify_fn.__module__, *preload])
        self._num_workers = num_workers
        self._workers: list[_Worker] = []
        if not start_on_first_use:
            self._start_workers()
        self.num_timeouts = 0
        """Answers that exceeded the time limit since the pool started."""
        self.num_restarts = 0
        """Worker processes replaced (after a timeout or a crash) since the pool started."""

    @property
    def started(self) -> bool:
        """Whether the verifier processes have been started."""
        return bool(self._workers)

    def _start_workers(self) -> None:
        self._workers = [self._start_worker() for _ in range(self._num_workers)]

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self._verify_fn, self._memory_limit_bytes, self._warm_up),
            daemon=True,
            name="nemo-rl-verifier",
        )
        process.start()
        child_conn.close()
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    def _replace(self, slot: int) -> None:
        worker = self._workers[slot]
        worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()
        self._workers[slot] = self._start_worker()
        self.num_restarts += 1

    def verify(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[VerifyOutcome]:
        """Score ``responses[i]`` against ``ground_truths[i]``; always returns within the per-answer limits."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if not responses:
            return []
        if not self._workers:
            self._start_workers()
        if self._max_response_chars is not None:
            responses = [r[-self._max_response_chars :] for r in responses]
        outcomes: list[VerifyOutcome | None] = [None] * len(responses)
        pending = deque(range(len(responses)))
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for slot, worker in enumerate(self._workers):
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    try:
                        worker.conn.send((index, responses[index], ground_truths[index]))
                    except (BrokenPipeError, OSError):
                        # The idle process died since its last answer: replace it and retry the answer.
                        pending.appendleft(index)
                        self._replace(slot)
                        continue
                    worker.task, worker.deadline = index, now + self._timeout_s
            self._wait_and_collect(outcomes)
        assert all(o is not None for o in outcomes)
        return [o for o in outcomes if o is not None]

    def _wait_and_collect(self, outcomes: list[VerifyOutcome | None]) -> None:
        """Wait for the next message or deadline, then record results, timeouts and crashes."""
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.task is not None]
        deadlines += [w.started_at + WORKER_STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
        waiting_on = [w.conn for w in self._workers if w.task is not None or not w.ready]
        ready_conns = set(wait(waiting_on, timeout=max(0.0, min(deadlines) - now))) if waiting_on else set()
        for slot, worker in enumerate(self._workers):
            if worker.conn in ready_conns:
                self._receive(slot, outcomes)
        now = time.monotonic()
        for slot, worker in enumerate(self._workers):
            if worker.task is not None and now >= worker.deadline:
                logger.warning(
                    "verifier exceeded %.1fs on answer %d; restarting it", self._timeout_s, worker.task
                )
                outcomes[worker.task] = VerifyOutcome(score=0.0, timed_out=True, error="timed out")
                self.num_timeouts += 1
                self._replace(slot)
            elif not worker.ready and now >= worker.started_at + WORKER_STARTUP_TIMEOUT_S:
                raise RuntimeError(
                    f"a verifier process did not start within {WORKER_STARTUP_TIMEOUT_S:.0f}s; check that "
                    "the machine is not overloaded and that the verifier's libraries import"
                )

    def _receive(self, slot: int, outcomes: list[VerifyOutcome | None]) -> None:
        worker = self._workers[slot]
        try:
            message: Any = worker.conn.recv()
        except (EOFError, OSError):
            exit_code = worker.process.exitcode
            if worker.task is None and not worker.ready:
                raise RuntimeError(
                    f"a verifier process exited during start-up (exit code {exit_code}); run the verify "
                    "function once in a plain Python process to see its error"
                ) from None
            if worker.task is not None:
                outcomes[worker.task] = VerifyOutcome(score=0.0, error=f"verifier process died ({exit_code})")
            self._replace(slot)
            return
        if message == _READY:
            worker.ready = True
            return
        index, score, error, answer = message
        outcomes[index] = VerifyOutcome(score=score, error=error, answer=answer)
        worker.task = None

    def close(self) -> None:
        """Stop every worker process."""
        for worker in self._workers:
            if worker.process.is_alive():
                # A process that just died cannot be told to stop; it is joined below either way.
                with contextlib.suppress(BrokenPipeError, OSError):
                    worker.conn.send(None)
        for worker in self._workers:
            worker.process.join(timeout=2)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=10)
            worker.conn.close()
        self._workers = []

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
