"""The agent endpoint over HTTP, driven by the real ``openai`` client, with a scripted generation backend
standing in for the model (no Ray, no weights; the server path is the real one: tool calls parsed from the
generated tokens, tool messages rendered by the chat template): the bearer token, loopback binding,
per-trajectory routes, multi-turn recording, a tool-call round trip, edited responses restarting the
trajectory, OpenAI error bodies (unknown model, malformed bodies, unknown routes), completions, refused
parameters, and agent rollouts (function and program agents) whose training rows hold exactly the sampled
tokens."""

from __future__ import annotations

import json
import socket
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nemo_rl.algorithms.grpo import build_train_batch  # noqa: E402
from nemo_rl.config.agent import AgentConfig  # noqa: E402
from nemo_rl.config.generation import GenerationConfig  # noqa: E402
from nemo_rl.config.policy import PolicyConfig  # noqa: E402
from nemo_rl.data.llm_message_utils import format_message_log, message_log_token_ids  # noqa: E402
from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # noqa: E402
from nemo_rl.experience.agent_endpoint import AgentEndpoint  # noqa: E402
from nemo_rl.experience.agent_rollouts import (  # noqa: E402
    AgentRolloutError,
    AgentTask,
    load_agent_function,
    run_agent_rollout,
)
from nemo_rl.experience.agent_trajectories import normalise_chat_messages  # noqa: E402
from nemo_rl.models.tokenizer import get_policy_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "examples" / "assets" / "tiny_qwen2_init"
AGENT_FILE = ROOT / "examples" / "agents" / "tiny_calculator_agent.py"
AGENT_FAILING_ON_THE_SECOND_PROMPT = """
import io, runpy, sys
task = sys.stdin.read()
if "3*3" in task:
    sys.exit(3)
sys.stdin = io.StringIO(task)
runpy.run_path({agent!r}, run_name="__main__")
"""
"""The example agent program, except that it fails on the prompt asking for 3*3."""
MODEL = "tiny"
"""The model name the test endpoints serve."""
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


class ScriptedGeneration:
    """Replies ``reply_fn(prompt_text)`` followed by EOS; token ``k`` of a reply gets log-prob ``-(k+1)/100``."""

    def __init__(self, tokenizer: Any, reply_fn: Callable[[str], str]) -> None:
        self.tokenizer = tokenizer
        self.reply_fn = reply_fn
        self.batch_sizes: list[int] = []

    def _reply_ids(self, prompt_ids: list[int]) -> list[int]:
        reply = self.reply_fn(self.tokenizer.decode(prompt_ids))
        return [*self.tokenizer.encode(reply, add_special_tokens=False), self.tokenizer.eos_token_id]

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        lengths = data["input_lengths"].tolist()
        self.batch_sizes.append(len(lengths))
        prompts = [row[:n].tolist() for row, n in zip(data["input_ids"], lengths, strict=True)]
        replies = [self._reply_ids(prompt) for prompt in prompts]
        sequences = [torch.tensor(p + r) for p, r in zip(prompts, replies, strict=True)]
        scores = [
            torch.tensor([0.0] * len(p) + [-(k + 1) / 100 for k in range(len(r))])
            for p, r in zip(prompts, replies, strict=True)
        ]
        pad = self.tokenizer.pad_token_id
        return BatchedDataDict[Any](
            output_ids=torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=pad),
            logprobs=torch.nn.utils.rnn.pad_sequence(scores, batch_first=True),
            generation_lengths=torch.tensor([len(r) for r in replies]),
            unpadded_sequence_lengths=torch.tensor([len(x) for x in sequences]),
            truncated=torch.zeros(len(replies), dtype=torch.bool),
        )


def arithmetic_reply(prompt: str) -> str:
    """Answers the last "What is a+b?" of the conversation, wrongly the first time it is asked."""
    question = prompt.rsplit("What is ", 1)[-1].split("?", 1)[0]
    a, b = question.split("+")
    asked = prompt.count(f"What is {question}?")
    return f"{question}=\\boxed{{{int(a) + int(b) + (1 if asked == 1 else 0)}}}"


def calculator_reply(prompt: str) -> str:
    """What the tiny tools checkpoint writes: a calculator call on the last question, then the boxed value the
    tool returned (the tiny template renders a tool result as a user turn of ``<tool_response>`` blocks)."""
    if prompt.endswith("</tool_response><|assistant|>"):
        return "\\boxed{" + prompt.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0] + "}"
    expression = prompt.rsplit("What is ", 1)[-1].split("?", 1)[0]
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expression + '"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return get_policy_tokenizer(PolicyConfig(model_name=str(TINY_MODEL)))


def start_endpoint(
    tokenizer: Any, reply_fn: Callable[[str], str], **cfg: Any
) -> tuple[AgentEndpoint, ScriptedGeneration]:
    generation = ScriptedGeneration(tokenizer, reply_fn)
    endpoint = AgentEndpoint(
        generation,  # type: ignore[arg-type]
        tokenizer,
        AgentConfig(enabled=True, function=f"{AGENT_FILE}:agent", **cfg),
        GenerationConfig(temperature=1.0),
        max_seq_len=200,  # room for the tiny template's tools section
        stop_token_ids=[tokenizer.eos_token_id],
        model_name=MODEL,
    )
    endpoint.start()
    return endpoint, generation


@pytest.fixture
def served(tokenizer: Any) -> Iterator[tuple[AgentEndpoint, ScriptedGeneration]]:
    endpoint, generation = start_endpoint(tokenizer, arithmetic_reply)
    try:
        yield endpoint, generation
    finally:
        endpoint.stop()


def client_for(endpoint: AgentEndpoint, trajectory_id: str, api_key: str | None = None) -> Any:
    return openai.OpenAI(
        base_url=endpoint.base_url(trajectory_id),
        api_key=api_key or endpoint.token,
        max_retries=0,
        timeout=30,
    )


def non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: only picks the outgoing interface
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_loopback_only_and_the_token_is_required(served: tuple[AgentEndpoint, ScriptedGeneration]) -> None:
    endpoint, _ = served
    endpoint.open(["t1"])
    assert endpoint.url.startswith("http://127.0.0.1:")
    port = int(endpoint.url.rsplit(":", 1)[1])
    other = non_loopback_address()
    if other is not None:  # the port is not reachable from another interface
        with pytest.raises(OSError), socket.create_connection((other, port), timeout=5):
            pass
    question = [{"role": "user", "content": "What is 1+2?"}]
    with pytest.raises(openai.AuthenticationError):
        client_for(endpoint, "t1", api_key="not-the-token").chat.completions.create(
            model=MODEL, messages=question
        )
    no_header = urllib.request.Request(
        f"{endpoint.base_url('t1')}/chat/completions",
        data=json.dumps({"messages": question}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(no_header, timeout=30)
    assert refused.value.code == 401
    assert endpoint.close(["t1"])["t1"].num_requests == 0  # refused requests sample nothing
    assert endpoint.num_refused == 2


def test_only_open_trajectories_are_served(served: tuple[AgentEndpoint, ScriptedGeneration]) -> None:
    endpoint, _ = served
    question = [{"role": "user", "content": "What is 1+2?"}]
    with pytest.raises(openai.NotFoundError, match="not being rolled out"):
        client_for(endpoint, "never-opened").chat.completions.create(model=MODEL, messages=question)
    endpoint.open(["t2"])
    client = client_for(endpoint, "t2")
    assert (
        client.chat.completions.create(model=MODEL, messages=question).choices[0].message.content
        == "1+2=\\boxed{4}"
    )
    assert [m.id for m in client.models.list().data] == [MODEL]
    endpoint.close(["t2"])
    with pytest.raises(openai.NotFoundError):  # its rollout has ended
        client.chat.completions.create(model=MODEL, messages=question)


def test_multi_turn_chat_records_the_sampled_ids(
    tokenizer: Any, served: tuple[AgentEndpoint, ScriptedGeneration]
) -> None:
    endpoint, _ = served
    endpoint.open(["t3"])
    client = client_for(endpoint, "t3")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 1+2?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True)
    sampled_1 = first.choices[0].message.generation_token_ids  # type: ignore[attr-defined]
    assert sampled_1[-1] == tokenizer.eos_token_id
    assert [t.logprob for t in first.choices[0].logprobs.content] == pytest.approx(
        [-(k + 1) / 100 for k in range(len(sampled_1))]
    )
    assert first.usage.completion_tokens == len(sampled_1)
    # Sent back as returned: the rendering extends the recorded ids.
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What is 1+2?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages)
    messages += [
        {"role": "assistant", "content": second.choices[0].message.content},
        {"role": "user", "content": "What is 1+2?"},
    ]
    third = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert third.choices[0].finish_reason == "length"
    assert len(third.choices[0].message.generation_token_ids) == 3  # type: ignore[attr-defined]

    trajectory = endpoint.close(["t3"])["t3"]
    assert (trajectory.num_requests, trajectory.num_spliced, trajectory.num_restarts) == (3, 0, 0)
    turns = trajectory.turns
    for turn, response in zip(turns, (first, second, third), strict=True):
        message = response.choices[0].message
        assert turn.prompt_ids == message.prompt_token_ids  # type: ignore[attr-defined]
        assert turn.sampled_ids == message.generation_token_ids  # type: ignore[attr-defined]
        assert turn.logprobs == pytest.approx(message.generation_log_probs)  # type: ignore[attr-defined]
    assert turns[1].prompt_ids[: len(turns[0].ids)] == turns[0].ids
    assert turns[2].prompt_ids[: len(turns[1].ids)] == turns[1].ids


def test_a_tool_call_round_trip_trains_the_exact_tokens(tokenizer: Any) -> None:
    endpoint, _ = start_endpoint(tokenizer, calculator_reply)
    try:
        endpoint.open(["t4"])
        client = client_for(endpoint, "t4")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2*3?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        choice = first.choices[0]
        # The call the model wrote comes back as OpenAI tool_calls, parsed from the sampled tokens.
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "calculator",
            {"expression": "2*3"},
        )
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "6"},
        ]
        second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        assert (second.choices[0].message.content, second.choices[0].finish_reason) == ("\\boxed{6}", "stop")
        # tool_choice="none": the same tokens come back as text.
        endpoint.open(["t5"])
        text = client_for(endpoint, "t5").chat.completions.create(
            model=MODEL, messages=messages[:1], tools=TOOLS, tool_choice="none"
        )
        assert text.choices[0].message.content.startswith("<tool_call>")  # type: ignore[union-attr]
        trajectory = endpoint.close(["t4", "t5"])["t4"]
    finally:
        endpoint.stop()
    # The tiny template does not render tool calls: the call sent back unchanged drifts and is spliced.
    assert (trajectory.num_requests, trajectory.num_spliced, trajectory.num_restarts) == (2, 1, 0)
    sent_1, sent_2 = first.choices[0].message, second.choices[0].message
    first_ids = sent_1.prompt_token_ids + sent_1.generation_token_ids  # type: ignore[attr-defined]
    # The tool message, rendered by the chat template, follows the sampled call (and its EOS) token for token.
    tool_turn = tokenizer("<|user|><tool_response>6</tool_response><|assistant|>", add_special_tokens=False)
    assert sent_2.prompt_token_ids == first_ids + tool_turn["input_ids"]  # type: ignore[attr-defined]
    # The training row is exactly the ids the agent was sent, the sampled ones trained.
    log = trajectory.message_log(tokenizer)
    assert message_log_token_ids(log).tolist() == sent_2.prompt_token_ids + sent_2.generation_token_ids  # type: ignore[attr-defined]
    trained = [t for m in log if m["role"] == "assistant" for t in m["token_ids"].tolist()]
    assert trained == sent_1.generation_token_ids + sent_2.generation_token_ids  # type: ignore[attr-defined]


def test_edited_responses_restart_the_trajectory(tokenizer: Any) -> None:
    endpoint, _ = start_endpoint(tokenizer, calculator_reply)
    try:
        endpoint.open(["t6", "t7"])
        # A substituted tool call: the agent sends back other arguments than the model wrote.
        client = client_for(endpoint, "t6")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2*3?"}]
        call = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0].message
        substituted = call.tool_calls[0].model_dump()  # type: ignore[index]
        substituted["function"]["arguments"] = json.dumps({"expression": "2*4"})
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [substituted]},
            {"role": "tool", "tool_call_id": substituted["id"], "content": "8"},
        ]
        after_call = (
            client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0].message
        )
        # An edited answer: the agent sends back "\\boxed{7}" where the model wrote "\\boxed{8}".
        messages += [
            {"role": "assistant", "content": "\\boxed{7}"},
            {"role": "user", "content": "What is 3*3?"},
        ]
        after_edit = (
            client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS).choices[0].message
        )
        # The same conversation sent back as returned continues the trajectory.
        unchanged = client_for(endpoint, "t7")
        kept = [{"role": "user", "content": "What is 2*3?"}]
        reply = unchanged.chat.completions.create(model=MODEL, messages=kept, tools=TOOLS).choices[0].message
        kept += [
            {"role": "assistant", "content": reply.content, "tool_calls": [reply.tool_calls[0].model_dump()]},  # type: ignore[index]
            {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "6"},  # type: ignore[index]
        ]
        unchanged.chat.completions.create(model=MODEL, messages=kept, tools=TOOLS)
        recorded = endpoint.close(["t6", "t7"])
    finally:
        endpoint.stop()
    edited = recorded["t6"]
    counts = (edited.num_requests, edited.num_restarts, edited.num_dropped_turns, edited.num_spliced)
    assert counts == (3, 2, 2, 0)
    # The model is shown what the agent sent (its own tokens never stand in for the edit), and only the last
    # stretch trains.
    rendered = tokenizer.apply_chat_template(
        normalise_chat_messages(messages), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert after_edit.prompt_token_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]  # type: ignore[attr-defined]
    # (The tiny template does not render tool calls: the substituted call shows as an empty response, and the
    # call the model sampled is not put in its place.)
    assert "<tool_call>" not in tokenizer.decode(after_call.prompt_token_ids)  # type: ignore[attr-defined]
    assert [turn.prompt_ids for turn in edited.turns] == [after_edit.prompt_token_ids]  # type: ignore[attr-defined]
    assert (recorded["t7"].num_requests, recorded["t7"].num_restarts, len(recorded["t7"].turns)) == (2, 0, 2)


def error_of(request: Callable[[], Any]) -> Any:
    """The ``openai`` exception ``request`` raises, checked to carry an OpenAI error body."""
    with pytest.raises(openai.APIStatusError) as raised:
        request()
    assert set(raised.value.body) == {"message", "type", "param", "code"}
    return raised.value


def test_unknown_models_and_malformed_requests_get_openai_errors(
    served: tuple[AgentEndpoint, ScriptedGeneration],
) -> None:
    endpoint, _ = served
    endpoint.open(["t8"])
    client = client_for(endpoint, "t8")
    create = client.chat.completions.create
    question = [{"role": "user", "content": "What is 1+2?"}]
    unknown = error_of(lambda: create(model="gpt-4o", messages=question))
    assert isinstance(unknown, openai.NotFoundError)
    assert (unknown.code, unknown.param, unknown.type) == (
        "model_not_found",
        "model",
        "invalid_request_error",
    )
    assert "gpt-4o" in unknown.message and MODEL in unknown.message
    refused = {
        "max_tokens": (lambda: create(model=MODEL, messages=question, max_tokens="many"), "invalid_type"),  # type: ignore[arg-type]
        "max_tokens ": (lambda: create(model=MODEL, messages=question, max_tokens=0), "invalid_value"),
        "messages": (lambda: create(model=MODEL, messages="hi"), "invalid_type"),  # type: ignore[arg-type]
        "messages[1]": (lambda: create(model=MODEL, messages=[*question, "hi"]), "invalid_type"),  # type: ignore[list-item]
        "messages[0].role": (lambda: create(model=MODEL, messages=[{"content": "hi"}]), "invalid_value"),  # type: ignore[list-item,typeddict-item]
        "stop": (lambda: create(model=MODEL, messages=question, stop=5), "invalid_type"),  # type: ignore[arg-type]
        "temperature": (lambda: create(model=MODEL, messages=question, temperature=0.3), "invalid_value"),
        "model ": (
            lambda: client.post("/chat/completions", body={"messages": question}, cast_to=object),
            "missing_required_parameter",
        ),
        "messages ": (
            lambda: client.post("/chat/completions", body={"model": MODEL}, cast_to=object),
            "missing_required_parameter",
        ),
    }
    for param, (request, code) in refused.items():
        err = error_of(request)
        assert isinstance(err, openai.BadRequestError), param
        assert (err.param, err.code, err.type) == (param.strip(), code, "invalid_request_error"), param
    # Routes and methods the endpoint does not serve.
    route = error_of(lambda: client.embeddings.create(model=MODEL, input="x"))
    assert (route.status_code, route.param) == (404, None) and "Invalid URL (POST" in route.message
    method = error_of(lambda: client.get("/chat/completions", cast_to=object))
    assert method.status_code == 405 and "GET" in method.message
    # A body that is not JSON: answered in the same format, and only to a caller holding the token.
    url = f"{endpoint.base_url('t8')}/chat/completions"
    headers = {"Content-Type": "application/json"}
    bad_json = httpx.post(
        url, content=b"{not json", headers={**headers, "Authorization": f"Bearer {endpoint.token}"}
    )
    assert bad_json.status_code == 400
    assert (
        bad_json.json()["error"]["type"] == "invalid_request_error"
        and "JSON" in bad_json.json()["error"]["message"]
    )
    for anonymous in (
        httpx.post(url, content=b"{not json", headers=headers),
        httpx.post(f"{endpoint.base_url('t8')}/embeddings", json={}),
    ):
        assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
    assert endpoint.close(["t8"])["t8"].num_requests == 0  # nothing was sampled


def test_completions_and_the_context_length(tokenizer: Any) -> None:
    endpoint, _ = start_endpoint(tokenizer, lambda prompt: "6")
    try:
        endpoint.open(["t9", "t10"])
        too_long = error_of(
            lambda: client_for(endpoint, "t9").chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x" * 200}]
            )
        )
        assert (too_long.status_code, too_long.code, too_long.param) == (
            400,
            "context_length_exceeded",
            "messages",
        )

        completions = client_for(endpoint, "t10").completions
        prompt = "<|bos|><|user|>6<|assistant|>"
        first = completions.create(model=MODEL, prompt=prompt)
        assert first.choices[0].text == "6"
        # The full text with its EOS re-encodes to the recorded ids; the returned text alone is spliced.
        exact = completions.create(model=MODEL, prompt=prompt + "6<|eos|><|user|>6<|assistant|>")
        spliced = completions.create(
            model=MODEL, prompt=prompt + "6<|eos|><|user|>6<|assistant|>6<|user|>6<|assistant|>"
        )
        t10 = endpoint.close(["t9", "t10"])["t10"]
        assert (t10.num_requests, t10.num_spliced, t10.num_restarts) == (3, 1, 0)
        for earlier, later in ((first, exact), (exact, spliced)):
            ids = earlier.choices[0].prompt_token_ids + earlier.choices[0].generation_token_ids  # type: ignore[attr-defined]
            assert later.choices[0].prompt_token_ids[: len(ids)] == ids  # type: ignore[attr-defined]
    finally:
        endpoint.stop()


def prompt_batch(tokenizer: Any, problems: list[tuple[str, str]]) -> BatchedDataDict[Any]:
    messages = [[{"role": "user", "content": question}] for question, _ in problems]
    return BatchedDataDict[Any](
        message_log=[
            format_message_log(m, tokenizer, add_bos=True, add_eos=False, add_generation_prompt=True)
            for m in messages
        ],
        extra_env_info=[
            {"ground_truth": answer, "prompt_messages": m}
            for (_, answer), m in zip(problems, messages, strict=True)
        ],
        task_name=["math"] * len(problems),
        loss_multiplier=torch.ones(len(problems)),
        idx=torch.arange(len(problems)),
    )


SEEN: dict[str, list[list[int]]] = {}
"""Token ids each trajectory's responses carried, as :func:`recording_agent` saw them."""
_SEEN_LOCK = threading.Lock()


def recording_agent(task: AgentTask) -> float:
    """The example agent (``grpo.agent.function: test_agent_endpoint:recording_agent``), keeping the sampled
    ids each response carried."""
    solve = load_agent_function(f"{AGENT_FILE}:solve")
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0, timeout=30)
    create = client.chat.completions.create

    def recording_create(**kwargs: Any) -> Any:
        response = create(**kwargs)
        with _SEEN_LOCK:
            SEEN.setdefault(task.trajectory_id, []).append(response.choices[0].message.generation_token_ids)
        return response

    client.chat.completions.create = recording_create  # type: ignore[method-assign]
    return solve(client, task.model, task.messages, task.extra_env_info["ground_truth"])  # type: ignore[call-arg]


def test_function_agents_roll_out_and_train_on_the_recorded_tokens(tokenizer: Any) -> None:
    SEEN.clear()
    endpoint, generation = start_endpoint(tokenizer, calculator_reply, batch_wait_s=10.0)
    try:
        batch = prompt_batch(
            tokenizer, [("What is 2*3?", "6"), ("What is 3*4?", "13"), ("What is 4*5?", "20")]
        )
        cfg = AgentConfig(enabled=True, function=f"{__name__}:recording_agent")
        rollout, metrics = run_agent_rollout(endpoint, batch, tokenizer, cfg)
    finally:
        endpoint.stop()
    # The scripted model calls the calculator and boxes its value (the second ground truth is wrong).
    assert rollout["total_reward"].tolist() == [1.0, 0.0, 1.0]
    assert rollout["num_turns"].tolist() == [2, 2, 2]
    assert metrics["agent/requests"] == 6.0 and metrics["agent/failed"] == 0.0
    assert metrics["agent/restarts"] == 0.0
    # Concurrent agents' requests are sampled together, without waiting out batch_wait_s once all are queued.
    assert generation.batch_sizes == [3, 3]

    train = build_train_batch(rollout, torch.zeros(3), tokenizer.pad_token_id, overlong_filtering=False)
    trained_rows = {
        tuple(train["input_ids"][row][train["token_mask"][row].bool()].tolist()) for row in range(3)
    }
    sampled = {tuple(token for ids in responses for token in ids) for responses in SEEN.values()}
    assert trained_rows == sampled  # byte-identical to what the agents were sent, response by response
    for row in range(3):
        mask = train["token_mask"][row].bool()
        logprobs = train["generation_logprobs"][row][mask].tolist()
        lengths = [len(m["token_ids"]) for m in rollout["message_log"][row] if m["role"] == "assistant"]
        assert logprobs == pytest.approx([-(k + 1) / 100 for n in lengths for k in range(n)])


def test_program_agents_get_the_endpoint_from_their_environment(tokenizer: Any) -> None:
    endpoint, _ = start_endpoint(tokenizer, calculator_reply)
    try:
        batch = prompt_batch(tokenizer, [("What is 2*3?", "6"), ("What is 3*3?", "9")])
        cfg = AgentConfig(enabled=True, command=[sys.executable, str(AGENT_FILE)], timeout_s=60)
        rollout, metrics = run_agent_rollout(endpoint, batch, tokenizer, cfg)
        failing = AgentConfig(
            enabled=True, command=[sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=60
        )
        # A step whose every agent failed stops the run instead of training on nothing.
        with pytest.raises(AgentRolloutError, match="all 2 agents of this step failed"):
            run_agent_rollout(endpoint, batch, tokenizer, failing)
        # One failed agent of two: reward 0, not trained on, its prompt and an empty response as the row.
        half = AgentConfig(
            enabled=True,
            command=[sys.executable, "-c", AGENT_FAILING_ON_THE_SECOND_PROMPT.format(agent=str(AGENT_FILE))],
            timeout_s=60,
        )
        failed, failed_metrics = run_agent_rollout(endpoint, batch, tokenizer, half)
    finally:
        endpoint.stop()
    assert rollout["total_reward"].tolist() == [1.0, 1.0]
    assert rollout["loss_multiplier"].tolist() == [1.0, 1.0]
    assert metrics["agent/requests"] == 4.0
    assert failed_metrics["agent/failed"] == 1.0
    assert failed["loss_multiplier"].tolist() == [1.0, 0.0]
    assert [m["role"] for m in failed["message_log"][1]] == ["user", "assistant"]


def raising_agent(task: AgentTask) -> float:
    """A function agent that raises at once (with a message of two lines)."""
    raise ValueError("the calculator is missing\nsee the setup notes")


def agent_failing_on_3x3(task: AgentTask) -> float:
    """A function agent that raises on the prompt asking for 3*3 and returns 1 without a request otherwise."""
    if "3*3" in json.dumps(task.messages):
        raise RuntimeError("3*3 is too hard")
    return 1.0


def test_a_step_of_failed_agents_exits_2_with_one_line_quoting_the_first_failure(
    tokenizer: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from nemo_rl.config.cli import run_cli

    endpoint, _ = start_endpoint(tokenizer, calculator_reply)
    batch = prompt_batch(tokenizer, [("What is 2*3?", "6"), ("What is 3*3?", "9")])
    exits_at_once = "echo 'Traceback ...' >&2; echo 'RuntimeError: no API key' >&2; exit 1"
    cases = [
        (
            AgentConfig(enabled=True, command=["sh", "-c", exits_at_once], timeout_s=60),
            "exited with status 1: RuntimeError: no API key",
        ),
        (
            AgentConfig(enabled=True, function=f"{__file__}:raising_agent", timeout_s=60),
            "ValueError: the calculator is missing | see the setup notes",
        ),
    ]
    one_of_two = f"{__file__}:agent_failing_on_3x3"
    try:
        for cfg, first_failure in cases:
            with pytest.raises(SystemExit) as exit_info:
                run_cli(run_agent_rollout, endpoint, batch, tokenizer, cfg)
            assert exit_info.value.code == 2
            stderr = capsys.readouterr().err.strip()
            assert len(stderr.splitlines()) == 1, stderr
            assert f"all 2 agents of this step failed (first: {first_failure})" in stderr
        # Half of the agents failing is within the default grpo.agent.max_failed_fraction (0.5), not within 0.4.
        tolerated = AgentConfig(enabled=True, function=one_of_two, timeout_s=60)
        _, metrics = run_agent_rollout(endpoint, batch, tokenizer, tolerated)
        assert metrics["agent/failed"] == 1.0
        bounded = AgentConfig(enabled=True, function=one_of_two, timeout_s=60, max_failed_fraction=0.4)
        with pytest.raises(
            AgentRolloutError, match=r"1 of 2 agents .* \(first: RuntimeError: 3\*3 is too hard"
        ):
            run_agent_rollout(endpoint, batch, tokenizer, bounded)
    finally:
        endpoint.stop()
