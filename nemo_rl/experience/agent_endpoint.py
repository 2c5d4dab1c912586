"""An OpenAI-compatible endpoint that serves the policy's current weights to external agents during a rollout
(see docs/algorithms/agent_endpoint.md).

The driver runs a FastAPI app under uvicorn in a thread of its own. Each trajectory has its own base URL,
``http://<host>:<port>/sessions/<trajectory_id>/v1`` (the session routes of slime's rollout router), so an
agent using the ``openai`` client needs only ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``:

- ``POST .../v1/chat/completions``: messages rendered with the policy's chat template (``tools`` passed to
  it; ``<tool_call>`` blocks returned as ``tool_calls``);
- ``POST .../v1/completions``: a text prompt, or token ids;
- ``GET .../v1/models``: the one model served.

Every request must carry ``Authorization: Bearer <token>`` with the token generated for this endpoint (401
otherwise), name the model served (404 ``model_not_found`` otherwise), and only trajectories opened for the
rollout in progress are served (404 otherwise); every refusal has OpenAI's error body. Requests of
one trajectory are served one at a time, each prompt continuing the trajectory's recorded ids
(:mod:`nemo_rl.experience.agent_trajectories`); requests of all trajectories are sampled together
(:mod:`nemo_rl.experience.agent_batching`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import secrets
import socket
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl.config.agent import AgentConfig
from nemo_rl.config.generation import GenerationConfig
from nemo_rl.experience.agent_batching import GenerationBatcher, SampleRequest
from nemo_rl.experience.agent_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EndpointError,
    chat_response,
    check_request,
    completion_response,
    reply_parts,
    response_text,
)
from nemo_rl.experience.agent_trajectories import (
    AssistantReply,
    Continuation,
    SampledTurn,
    Trajectory,
    TrajectoryStore,
    chat_prompt,
    completion_prompt,
    normalise_chat_messages,
)
from nemo_rl.models.generation.interfaces import GenerationInterface

START_TIMEOUT_S = 30.0
"""Longest wait for the server to start listening, and for it and the batcher to stop."""


class AgentEndpoint:
    """The endpoint of one run: started once, serving the trajectories each rollout opens.

    Args:
        generation: The generation backend (its weights must be current while trajectories are open).
        tokenizer: The policy's tokenizer and chat template.
        cfg: ``grpo.agent`` (address, batching).
        sampling: ``policy.generation`` (the sampling settings requests must match).
        max_seq_len: Longest trajectory in tokens (``policy.max_total_sequence_length``); a longer prompt is
            refused with OpenAI's context-length error.
        stop_token_ids: Tokens that end a response (the tokenizer's EOS and the configured stop tokens).
        model_name: The model served: what ``/models`` lists, what requests must name as ``model`` (404
            ``model_not_found`` otherwise), what responses report.
    """

    def __init__(
        self,
        generation: GenerationInterface,
        tokenizer: PreTrainedTokenizerBase,
        cfg: AgentConfig,
        sampling: GenerationConfig,
        *,
        max_seq_len: int,
        stop_token_ids: Collection[int],
        model_name: str,
    ) -> None:
        self.token = secrets.token_urlsafe(32)
        """The bearer token every request must carry (generated per endpoint, so per run)."""
        self.trajectories = TrajectoryStore()
        self._tokenizer = tokenizer
        self._cfg = cfg
        self._sampling = sampling
        self._max_seq_len = max_seq_len
        self._stop_token_ids = frozenset(stop_token_ids)
        self.model_name = model_name
        """The model served (what requests send as ``model``)."""
        pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self._running_agents = 0
        self._running_lock = threading.Lock()
        self._batcher = GenerationBatcher(
            generation,
            pad_token_id=int(pad_token_id),
            max_batch_size=cfg.max_batch_size,
            wait_s=cfg.batch_wait_s,
            running_agents=lambda: self._running_agents,
        )

        self._locks: dict[str, asyncio.Lock] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._port = 0
        self.num_refused = 0
        """Requests answered with an error (bad token, unknown trajectory, unservable parameters)."""

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind ``grpo.agent.host:port`` and start serving (the batcher and the server threads)."""
        import uvicorn

        from nemo_rl.experience.agent_app import build_app

        family = socket.AF_INET6 if ipaddress.ip_address(self._cfg.host).version == 6 else socket.AF_INET
        sock = socket.create_server((self._cfg.host, self._cfg.port), family=family)
        self._port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            build_app(self), log_config=None, log_level="warning", access_log=False, lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._batcher.start()
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="agent-endpoint", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the agent endpoint did not start on {self._cfg.host}:{self._port}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop serving; requests in flight fail."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)
            self._thread = None
        self._batcher.stop(START_TIMEOUT_S)

    @property
    def url(self) -> str:
        """``http://host:port`` of the running endpoint."""
        host = self._cfg.host if ipaddress.ip_address(self._cfg.host).version == 4 else f"[{self._cfg.host}]"
        return f"http://{host}:{self._port}"

    def base_url(self, trajectory_id: str) -> str:
        """The OpenAI base URL of one trajectory (what an agent sets as ``OPENAI_BASE_URL``)."""
        return f"{self.url}/sessions/{trajectory_id}/v1"

    # --- trajectories ---------------------------------------------------------------------------------
    def open(self, trajectory_ids: Iterable[str]) -> None:
        """Serve these trajectories (one per agent of the rollout starting; the generation weights must be
        current until they are closed)."""
        self.trajectories.open(trajectory_ids)
        self._batcher.resume()

    def close(self, trajectory_ids: Iterable[str]) -> dict[str, Trajectory]:
        """Stop serving these trajectories; returns what their requests recorded. Once none is open, no
        generation call runs until the next :meth:`open` (the policy may train on the same devices)."""
        closed = self.trajectories.close(trajectory_ids)
        if self.trajectories.empty:
            self._batcher.pause()
        for trajectory_id in closed:
            self._locks.pop(trajectory_id, None)
        return closed

    @contextlib.contextmanager
    def agent_running(self) -> Iterator[None]:
        """Count an agent as running while in this block: once every running agent has a request queued, they
        are sampled without waiting out ``grpo.agent.batch_wait_s``."""
        with self._running_lock:
            self._running_agents += 1
        try:
            yield
        finally:
            with self._running_lock:
                self._running_agents -= 1

    @property
    def generation_calls(self) -> tuple[int, int]:
        """Generation calls made so far and the requests they sampled."""
        return self._batcher.num_calls, self._batcher.num_rows

    # --- requests (run on the server's event loop) -------------------------------------------------------
    def check_token(self, authorization: str | None) -> None:
        """Refuse (401) a request without this endpoint's bearer token."""
        expected = f"Bearer {self.token}"
        if authorization is None or not secrets.compare_digest(authorization.encode(), expected.encode()):
            raise EndpointError(
                401,
                "missing or wrong API key: send the run's token as the bearer token",
                code="invalid_api_key",
            )

    def model_list(self) -> dict[str, Any]:
        """The ``/v1/models`` body."""
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "owned_by": "nemo_rl"}],
        }

    async def chat(self, trajectory_id: str, request: ChatCompletionRequest) -> dict[str, Any]:
        """Answer a chat completion of ``trajectory_id`` and record what it sampled."""
        self._check_servable(request)
        messages = normalise_chat_messages(request.messages)
        tools = request.tools or None
        async with self._trajectory_lock(trajectory_id) as trajectory:
            prompt_ids, continuation, rendered = self._chat_prompt(trajectory, messages, tools)
            turn = await self._sample(
                prompt_ids, request, request.token_budget(), rendered_ids=rendered, num_messages=len(messages)
            )
            content, tool_calls = reply_parts(
                turn,
                with_tools=bool(tools) and request.tool_choice != "none",
                stop_token_ids=self._stop_token_ids,
                tokenizer=self._tokenizer,
            )
            # What the agent must send back unchanged for its next request to continue these tokens.
            reply = AssistantReply.of({"content": content, "tool_calls": tool_calls})
            trajectory.add(dataclasses.replace(turn, reply=reply), continuation)
        return chat_response(
            turn,
            content,
            tool_calls,
            model=self.model_name,
            with_logprobs=bool(request.logprobs),
            tokenizer=self._tokenizer,
        )

    def _chat_prompt(
        self, trajectory: Trajectory, messages: list[dict[str, Any]], tools: Any
    ) -> tuple[list[int], Continuation, list[int]]:
        """The prompt ids of a chat request, how they continue ``trajectory``, and the request's rendering."""
        previous = trajectory.last
        rendered = self._render(messages, tools, add_generation_prompt=True)
        history = None
        if (
            previous is not None
            and len(messages) > previous.num_messages
            and messages[previous.num_messages]["role"] == "assistant"
        ):
            history = self._render(messages[: previous.num_messages + 1], tools, add_generation_prompt=False)
        prompt_ids, continuation = chat_prompt(
            trajectory.turns, messages, rendered, history, self._stop_token_ids
        )
        return prompt_ids, continuation, rendered

    async def complete(self, trajectory_id: str, request: CompletionRequest) -> dict[str, Any]:
        """Answer a text completion of ``trajectory_id`` and record what it sampled."""
        self._check_servable(request)
        prompt = request.single_prompt()
        async with self._trajectory_lock(trajectory_id) as trajectory:
            prompt_ids, continuation = completion_prompt(trajectory.last, prompt, self._encode)
            turn = await self._sample(prompt_ids, request, request.max_tokens, rendered_ids=prompt_ids)
            text = response_text(turn.sampled_ids, self._stop_token_ids, self._tokenizer)
            if isinstance(prompt, str):  # what the agent holds now: a next prompt extending it is spliced
                turn = dataclasses.replace(turn, text=prompt + text)
            trajectory.add(turn, continuation)
        return completion_response(turn, text, model=self.model_name)

    def _check_servable(self, request: ChatCompletionRequest | CompletionRequest) -> None:
        check_request(request, self._sampling, self.model_name)

    def _trajectory_lock(self, trajectory_id: str) -> _TrajectoryLock:
        trajectory = self.trajectories.get(trajectory_id)
        if trajectory is None:
            raise EndpointError(
                404,
                f"trajectory {trajectory_id!r} is not being rolled out (unknown, or its rollout has ended)",
                code="trajectory_not_found",
            )
        lock = self._locks.setdefault(trajectory_id, asyncio.Lock())
        return _TrajectoryLock(lock, trajectory)

    def _render(
        self, messages: list[dict[str, Any]], tools: Any, *, add_generation_prompt: bool
    ) -> list[int]:
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:  # a template's own refusal (an unknown role...) is the agent's to fix
            raise EndpointError(
                400, f"the chat template cannot render these messages: {err}", param="messages"
            ) from err
        assert isinstance(text, str)
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    async def _sample(
        self,
        prompt_ids: list[int],
        request: ChatCompletionRequest | CompletionRequest,
        budget: int | None,
        *,
        rendered_ids: list[int],
        num_messages: int = 0,
    ) -> SampledTurn:
        if len(prompt_ids) >= self._max_seq_len:
            raise EndpointError(
                400,
                f"This model's maximum context length is {self._max_seq_len} tokens; the prompt has "
                f"{len(prompt_ids)} (policy.max_total_sequence_length)",
                param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        future = self._batcher.submit(SampleRequest(prompt_ids, request.stop_strings()))
        try:
            result = await asyncio.wrap_future(future)
        except Exception as err:  # the generation call failed (or the rollout ended): the agent's API error
            raise EndpointError(500, f"generation failed: {type(err).__name__}: {err}") from err
        keep = len(result.sampled_ids) if budget is None else min(budget, len(result.sampled_ids))
        return SampledTurn(
            prompt_ids=prompt_ids,
            sampled_ids=result.sampled_ids[:keep],
            logprobs=result.logprobs[:keep],
            rendered_ids=rendered_ids,
            num_messages=num_messages,
            truncated=result.truncated or keep < len(result.sampled_ids),
        )

    def error_response(self, err: EndpointError) -> tuple[int, dict[str, Any]]:
        """Count a refused request; its status and OpenAI error body."""
        self.num_refused += 1
        return err.status, err.body()


class _TrajectoryLock:
    """``async with``: one request of a trajectory at a time; yields the trajectory."""

    def __init__(self, lock: asyncio.Lock, trajectory: Trajectory) -> None:
        self._lock = lock
        self._trajectory = trajectory

    async def __aenter__(self) -> Trajectory:
        await self._lock.acquire()
        return self._trajectory

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()
