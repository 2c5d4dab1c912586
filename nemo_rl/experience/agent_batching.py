"""Batching the agent endpoint's requests into generation calls.

Agents send one request at a time each, many agents at once. One generation call per request would run the
engine on a batch of one; the :class:`GenerationBatcher` thread instead takes the requests that arrive within
``batch_wait_s`` of the first (up to ``max_batch_size``) and samples them in one
:meth:`~nemo_rl.models.generation.interfaces.GenerationInterface.generate` call, without waiting longer once
every running agent has a request queued (an agent sends one request at a time, so no other can come). Only this thread calls the
generation backend while the endpoint serves.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.interfaces import GenerationInterface


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One prompt to continue."""

    prompt_ids: list[int]
    """The prompt's token ids."""

    stop_strings: list[str] | None = None
    """The request's own stop strings, added to ``policy.generation.stop_strings``."""


@dataclasses.dataclass(frozen=True)
class SampleResult:
    """What generation sampled for one :class:`SampleRequest`."""

    sampled_ids: list[int]
    """The tokens sampled, the stop token included."""

    logprobs: list[float]
    """Each sampled token's log-prob under the sampling distribution."""

    truncated: bool
    """No stop token or stop string ended the response (a length budget did)."""


_Pending = tuple[SampleRequest, "concurrent.futures.Future[SampleResult]"]


class GenerationBatcher:
    """A thread that samples queued requests together (see the module docstring)."""

    def __init__(
        self,
        generation: GenerationInterface,
        *,
        pad_token_id: int,
        max_batch_size: int,
        wait_s: float,
        running_agents: Callable[[], int] = lambda: 0,
    ) -> None:
        self._generation = generation
        self._running_agents = running_agents
        self._pad_token_id = pad_token_id
        self._max_batch_size = max_batch_size
        self._wait_s = wait_s
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        # Held while a generation call runs; `accepting` is read and written under it.
        self._sampling = threading.Lock()
        self._accepting = False
        self.num_calls = 0
        """Generation calls made."""
        self.num_rows = 0
        """Requests sampled."""

    def start(self) -> None:
        """Start the thread."""
        self._thread = threading.Thread(target=self._run, name="agent-endpoint-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Finish the call in progress, fail the requests still queued, and end the thread."""
        self.pause()
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._thread = None

    def resume(self) -> None:
        """Accept requests (a rollout starts: the generation weights are current)."""
        with self._sampling:
            self._accepting = True

    def pause(self) -> None:
        """Stop sampling until :meth:`resume`: wait for the generation call in progress, then fail the requests
        still queued (a rollout ended: the policy is about to train on the generation workers' devices)."""
        with self._sampling:
            self._accepting = False
        self._fail_queued("the rollout ended before this request was sampled")

    def submit(self, request: SampleRequest) -> concurrent.futures.Future[SampleResult]:
        """Queue ``request``; the future completes when it has been sampled."""
        future: concurrent.futures.Future[SampleResult] = concurrent.futures.Future()
        if self._thread is None or not self._accepting:
            future.set_exception(RuntimeError("the agent endpoint is not sampling: no rollout is running"))
            return future
        self._queue.put((request, future))
        return future

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            deadline = time.monotonic() + self._wait_s
            while len(batch) < self._max_batch_size and not self._everyone_waits(len(batch)):
                try:
                    item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            self._sample(batch)
        self._fail_queued("the agent endpoint stopped before sampling this request")

    def _everyone_waits(self, queued: int) -> bool:
        # Every running agent has a request queued (none is being sampled: this thread samples them): no
        # further request can come before one of these is answered, so waiting longer only adds latency.
        running = self._running_agents()
        return running > 0 and queued >= running

    def _fail_queued(self, reason: str) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and not item[1].done():
                item[1].set_exception(RuntimeError(reason))

    def _sample(self, batch: list[_Pending]) -> None:
        with self._sampling:
            try:
                if not self._accepting:
                    raise RuntimeError("the rollout ended before this request was sampled")
                output = self._generation.generate(self._input(batch), greedy=False)
            except BaseException as err:  # every waiting request fails with this error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(err)
                return
        self.num_calls += 1
        self.num_rows += len(batch)
        for j, (request, future) in enumerate(batch):
            start = len(request.prompt_ids)
            stop = start + int(output["generation_lengths"][j])
            result = SampleResult(
                sampled_ids=[int(t) for t in output["output_ids"][j, start:stop].tolist()],
                logprobs=[float(x) for x in output["logprobs"][j, start:stop].tolist()],
                truncated=bool(output["truncated"][j]),
            )
            if not future.done():
                future.set_result(result)

    def _input(self, batch: list[_Pending]) -> BatchedDataDict[Any]:
        lengths = [len(request.prompt_ids) for request, _ in batch]
        input_ids_BT = torch.full((len(batch), max(lengths)), self._pad_token_id, dtype=torch.long)
        for b, (request, _) in enumerate(batch):
            input_ids_BT[b, : lengths[b]] = torch.tensor(request.prompt_ids, dtype=torch.long)
        data = BatchedDataDict[Any](
            input_ids=input_ids_BT, input_lengths=torch.tensor(lengths, dtype=torch.long)
        )
        if any(request.stop_strings for request, _ in batch):
            data["stop_strings"] = [request.stop_strings or None for request, _ in batch]
        return data
