"""The agent endpoint over HTTP, driven by the real ``openai`` client, with a scripted generation backend
standing in for the model (no Ray, no weights): the bearer token, loopback binding, per-trajectory routes,
multi-turn recording (exact continuations and spliced drift), tool calls, completions, refused parameters,
and agent rollouts (function and program agents) whose training rows hold exactly the sampled tokens."""

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

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from nemo_rl.algorithms.grpo import build_train_batch  # noqa: E402
from nemo_rl.config.agent import AgentConfig  # noqa: E402
from nemo_rl.config.generation import GenerationConfig  # noqa: E402
from nemo_rl.config.policy import PolicyConfig  # noqa: E402
from nemo_rl.data.llm_message_utils import format_message_log  # noqa: E402
from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # noqa: E402
from nemo_rl.experience.agent_endpoint import AgentEndpoint  # noqa: E402
from nemo_rl.experience.agent_rollouts import AgentTask, load_agent_function, run_agent_rollout  # noqa: E402
from nemo_rl.models.tokenizer import get_policy_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "examples" / "assets" / "tiny_qwen2_init"
AGENT_FILE = ROOT / "examples" / "agents" / "tiny_math_agent.py"
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'


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
        model_name="tiny",
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
            model="m", messages=question
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
        client_for(endpoint, "never-opened").chat.completions.create(model="m", messages=question)
    endpoint.open(["t2"])
    client = client_for(endpoint, "t2")
    assert (
        client.chat.completions.create(model="m", messages=question).choices[0].message.content
        == "1+2=\\boxed{4}"
    )
    assert [m.id for m in client.models.list().data] == ["tiny"]
    endpoint.close(["t2"])
    with pytest.raises(openai.NotFoundError):  # its rollout has ended
        client.chat.completions.create(model="m", messages=question)


def test_multi_turn_chat_records_the_sampled_ids(
    tokenizer: Any, served: tuple[AgentEndpoint, ScriptedGeneration]
) -> None:
    endpoint, _ = served
    endpoint.open(["t3"])
    client = client_for(endpoint, "t3")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 1+2?"}]
    first = client.chat.completions.create(model="m", messages=messages, logprobs=True)
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
    second = client.chat.completions.create(model="m", messages=messages)
    # Sent back edited (a trailing space): spliced onto the sampled ids.
    messages += [
        {"role": "assistant", "content": second.choices[0].message.content + " "},
        {"role": "user", "content": "What is 1+2?"},
    ]
    third = client.chat.completions.create(model="m", messages=messages, max_tokens=3)
    assert third.choices[0].finish_reason == "length"
    assert len(third.choices[0].message.generation_token_ids) == 3  # type: ignore[attr-defined]

    trajectory = endpoint.close(["t3"])["t3"]
    assert (trajectory.num_requests, trajectory.num_spliced, trajectory.num_restarts) == (3, 1, 0)
    turns = trajectory.turns
    for turn, response in zip(turns, (first, second, third), strict=True):
        message = response.choices[0].message
        assert turn.prompt_ids == message.prompt_token_ids  # type: ignore[attr-defined]
        assert turn.sampled_ids == message.generation_token_ids  # type: ignore[attr-defined]
        assert turn.logprobs == pytest.approx(message.generation_log_probs)  # type: ignore[attr-defined]
    assert turns[1].prompt_ids[: len(turns[0].ids)] == turns[0].ids
    assert turns[2].prompt_ids[: len(turns[1].ids)] == turns[1].ids


def test_tool_calls_completions_and_refusals(tokenizer: Any) -> None:
    endpoint, _ = start_endpoint(
        tokenizer,
        # The tiny template renders a tool result as a user turn of <tool_response> blocks.
        lambda prompt: (
            "6" if "<tool_response>6</tool_response>" in prompt or "<|user|>6" in prompt else TOOL_CALL
        ),
    )
    try:
        endpoint.open(["t4", "t5"])
        client = client_for(endpoint, "t4")
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2*3?"}]
        reply = client.chat.completions.create(model="m", messages=messages, tools=tools)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "2*3"}')
        # The tiny template does not render tool calls: the re-rendered history drifts and is spliced.
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "content": "6", "tool_call_id": call.id},
        ]
        assert (
            client.chat.completions.create(model="m", messages=messages, tools=tools)
            .choices[0]
            .message.content
            == "6"
        )
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.chat.completions.create(model="m", messages=messages, temperature=0.5)
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 200}])

        completions = client_for(endpoint, "t5").completions
        prompt = "<|bos|><|user|>6<|assistant|>"
        first = completions.create(model="m", prompt=prompt)
        assert first.choices[0].text == "6"
        # The full text with its EOS re-encodes to the recorded ids; the returned text alone is spliced.
        exact = completions.create(model="m", prompt=prompt + "6<|eos|><|user|>6<|assistant|>")
        spliced = completions.create(
            model="m", prompt=prompt + "6<|eos|><|user|>6<|assistant|>6<|user|>6<|assistant|>"
        )
        recorded = endpoint.close(["t4", "t5"])
        assert (recorded["t4"].num_requests, recorded["t4"].num_spliced) == (2, 1)
        t5 = recorded["t5"]
        assert (t5.num_requests, t5.num_spliced, t5.num_restarts) == (3, 1, 0)
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
    return solve(client, task.messages, task.extra_env_info["ground_truth"])  # type: ignore[call-arg]


def test_function_agents_roll_out_and_train_on_the_recorded_tokens(tokenizer: Any) -> None:
    SEEN.clear()
    endpoint, generation = start_endpoint(tokenizer, arithmetic_reply, batch_wait_s=10.0)
    try:
        batch = prompt_batch(tokenizer, [("What is 1+2?", "3"), ("What is 2+2?", "7"), ("What is 4+4?", "8")])
        cfg = AgentConfig(enabled=True, function=f"{__name__}:recording_agent")
        rollout, metrics = run_agent_rollout(endpoint, batch, tokenizer, cfg)
    finally:
        endpoint.stop()
    # The scripted model answers wrongly first, rightly when asked again: 0.5 for right answers.
    assert rollout["total_reward"].tolist() == [0.5, 0.0, 0.5]
    assert rollout["num_turns"].tolist() == [2, 2, 2]
    assert metrics["agent/requests"] == 6.0 and metrics["agent/failed"] == 0.0
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
    endpoint, _ = start_endpoint(tokenizer, arithmetic_reply)
    try:
        batch = prompt_batch(tokenizer, [("What is 1+2?", "3"), ("What is 3+3?", "6")])
        cfg = AgentConfig(enabled=True, command=[sys.executable, str(AGENT_FILE)], timeout_s=60)
        rollout, metrics = run_agent_rollout(endpoint, batch, tokenizer, cfg)
        failing = AgentConfig(
            enabled=True, command=[sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=60
        )
        failed, failed_metrics = run_agent_rollout(endpoint, batch, tokenizer, failing)
    finally:
        endpoint.stop()
    assert rollout["total_reward"].tolist() == [0.5, 0.5]
    assert rollout["loss_multiplier"].tolist() == [1.0, 1.0]
    assert metrics["agent/requests"] == 4.0
    # A failed agent: reward 0, not trained on, its prompt and an empty response as the row.
    assert failed_metrics["agent/failed"] == 2.0
    assert failed["loss_multiplier"].tolist() == [0.0, 0.0]
    assert [m["role"] for m in failed["message_log"][0]] == ["user", "assistant"]
