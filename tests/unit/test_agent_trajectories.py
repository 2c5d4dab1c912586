"""The agent endpoint's bookkeeping without a server: how each request's prompt continues its trajectory's
ids (exact, spliced after the template's drift, restarted after rewritten history or an edited or
substituted response), the trajectory as a
training message log, the OpenAI request checks and response parts, rewards printed by agent programs, and
the ``grpo.agent`` config checks."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nemo_rl.config.agent import AgentConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.generation import GenerationConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.interfaces import TaskDataSpec
from nemo_rl.data.llm_message_utils import message_log_token_ids, message_logs_to_batch
from nemo_rl.data.processors import math_processor
from nemo_rl.data.prompt_messages import PROMPT_MESSAGES_KEY, KeepPromptMessages
from nemo_rl.experience.agent_openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EndpointError,
    check_request,
    split_tool_calls,
    validation_error,
)
from nemo_rl.experience.agent_rollouts import (
    AgentTask,
    call_with_timeout,
    load_agent_function,
    parse_reward,
    run_program,
)
from nemo_rl.experience.agent_trajectories import (
    AssistantReply,
    SampledTurn,
    Trajectory,
    chat_prompt,
    completion_prompt,
    normalise_chat_messages,
)
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "examples" / "assets" / "tiny_qwen2_init"
QUESTION = {"role": "user", "content": "What is 1+2?"}
AGAIN = {"role": "user", "content": "Again?"}
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return get_policy_tokenizer(PolicyConfig(model_name=str(TINY_MODEL)))


def render(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_turn(
    tokenizer: Any, reply: str, *, stopped: bool = True, returned: AssistantReply | None = None
) -> SampledTurn:
    """The first turn of a trajectory, which sampled ``reply`` and returned it as ``returned`` (its text)."""
    prompt = render(tokenizer, [QUESTION], generation_prompt=True)
    sampled = encode(tokenizer, reply) + ([tokenizer.eos_token_id] if stopped else [])
    return SampledTurn(
        prompt_ids=prompt,
        sampled_ids=sampled,
        logprobs=[-0.1 * (k + 1) for k in range(len(sampled))],
        rendered_ids=prompt,
        num_messages=1,
        reply=returned or AssistantReply(content=reply),
        truncated=not stopped,
    )


def request_after(
    tokenizer: Any, sent_back: dict[str, Any], *then: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[int], list[int]]:
    """A second request, which sends ``sent_back`` as the first response: its messages, their rendering, and the
    rendering of the history up to the response."""
    messages = normalise_chat_messages([QUESTION, {"role": "assistant", **sent_back}, *(then or (AGAIN,))])
    return (
        messages,
        render(tokenizer, messages, generation_prompt=True),
        render(tokenizer, messages[:2], generation_prompt=False),
    )


def test_first_and_exact_continuations_use_the_rendering(tokenizer: Any) -> None:
    turn = first_turn(tokenizer, "1+2=\\boxed{3}")
    stops = {tokenizer.eos_token_id}
    assert chat_prompt([], [QUESTION], turn.prompt_ids, None, stops) == (turn.prompt_ids, "first")
    messages, rendered, history = request_after(tokenizer, {"content": "1+2=\\boxed{3}"})
    prompt, how = chat_prompt([turn], messages, rendered, history, stops)
    assert how == "exact"
    assert prompt == rendered
    assert prompt[: len(turn.ids)] == turn.ids


def test_tool_calls_sent_back_unchanged_are_spliced_onto_the_sampled_ids(tokenizer: Any) -> None:
    returned = AssistantReply.of(
        {
            "content": None,
            "tool_calls": [{"function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}],
        }
    )
    turn = first_turn(tokenizer, CALL, returned=returned)
    # The agent sends the call back as returned (its own id, the JSON re-spaced); the tiny template does not
    # render tool calls, so the history no longer holds the sampled ids: drift, not an edit.
    sent_back = {
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression":"2*3"}'},
            }
        ],
    }
    messages, rendered, history = request_after(
        tokenizer, sent_back, {"role": "tool", "tool_call_id": "call_1", "content": "6"}
    )
    assert rendered[: len(turn.ids)] != turn.ids
    prompt, how = chat_prompt([turn], messages, rendered, history, {tokenizer.eos_token_id})
    assert how == "spliced"
    # The sampled ids are kept, the sampled EOS stands for the template's, and the tool result follows.
    assert prompt == turn.ids + encode(tokenizer, "<|user|><tool_response>6</tool_response><|assistant|>")


def test_edited_or_substituted_responses_restart_the_trajectory(tokenizer: Any) -> None:
    stops = {tokenizer.eos_token_id}
    turn = first_turn(tokenizer, "1+2=\\boxed{3}")
    call = {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}
    for sent_back in (
        {"content": "1+2=\\boxed{3} "},  # a trailing space: the text is not what was sampled
        {"content": "1+2=\\boxed{4}"},  # a substituted answer
        {"content": "1+2=\\boxed{3}", "tool_calls": [call]},  # a call the model never made
    ):
        messages, rendered, history = request_after(tokenizer, sent_back)
        assert chat_prompt([turn], messages, rendered, history, stops) == (rendered, "restarted"), sent_back
    # A substituted tool call (other arguments), and a call dropped from the response.
    called = first_turn(
        tokenizer,
        CALL,
        returned=AssistantReply.of(
            {
                "content": None,
                "tool_calls": [{"function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}],
            }
        ),
    )
    other = {
        "id": "c",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "2*4"}'},
    }
    for sent_back in ({"content": None, "tool_calls": [other]}, {"content": None}):
        messages, rendered, history = request_after(tokenizer, sent_back)
        assert chat_prompt([called], messages, rendered, history, stops) == (rendered, "restarted"), sent_back


def test_response_cut_by_its_budget_continues_exactly_when_sent_back(tokenizer: Any) -> None:
    turn = first_turn(tokenizer, "1+2=\\box", stopped=False)
    stops = {tokenizer.eos_token_id}
    messages, rendered, history = request_after(tokenizer, {"content": "1+2=\\box"})
    prompt, how = chat_prompt([turn], messages, rendered, history, stops)
    # The template's end-of-turn token closes the cut response as context, after the sampled ids.
    assert (how, prompt) == ("exact", rendered)
    assert rendered == [*turn.ids, tokenizer.eos_token_id, *encode(tokenizer, "<|user|>Again?<|assistant|>")]
    # Trimmed by the agent: an edit.
    messages, rendered, history = request_after(tokenizer, {"content": "1+2=\\bo"})
    assert chat_prompt([turn], messages, rendered, history, stops) == (rendered, "restarted")


def test_rewritten_history_restarts_the_trajectory(tokenizer: Any) -> None:
    turn = first_turn(tokenizer, "1+2=\\boxed{3}")
    messages = [
        {"role": "user", "content": "What is 2+2?"},  # an earlier message edited
        {"role": "assistant", "content": "1+2=\\boxed{3}"},
        AGAIN,
    ]
    rendered = render(tokenizer, messages, generation_prompt=True)
    history = render(tokenizer, messages[:2], generation_prompt=False)
    stops = {tokenizer.eos_token_id}
    assert chat_prompt([turn], messages, rendered, history, stops) == (rendered, "restarted")
    # No assistant message where the previous response belongs: nothing to splice onto either.
    assert chat_prompt([turn], messages[:1] + messages[2:], rendered, None, stops) == (rendered, "restarted")
    # An earlier response (not the last) edited: the last one sent back unchanged does not save it.
    messages, rendered, history = request_after(tokenizer, {"content": "1+2=\\boxed{3}"})
    second = SampledTurn(
        rendered,
        [5, tokenizer.eos_token_id],
        [-1.0, -1.0],
        rendered,
        num_messages=3,
        reply=AssistantReply(content=tokenizer.decode([5])),
    )
    edited = [dict(m) for m in messages] + [{"role": "assistant", "content": second.reply.content}, AGAIN]  # type: ignore[union-attr]
    edited[1]["content"] = "1+2=\\boxed{4}"
    rendered = render(tokenizer, edited, generation_prompt=True)
    history = render(tokenizer, edited[:4], generation_prompt=False)
    assert chat_prompt([turn, second], edited, rendered, history, stops) == (rendered, "restarted")


def test_completion_prompts_keep_the_sampled_ids() -> None:
    # A toy tokenizer that merges "xy" into one token (999): re-encoding sampled "x", "y" differs.
    def toy_encode(text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("xy", i):
                ids.append(999)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    turn = SampledTurn(toy_encode("ab"), [ord("x"), ord("y")], [-1.0, -2.0], toy_encode("ab"), text="abxy")
    assert completion_prompt(None, "ab", toy_encode) == (toy_encode("ab"), "first")
    assert completion_prompt(turn, [97, 98, 120, 121, 5], toy_encode) == ([97, 98, 120, 121, 5], "exact")
    assert toy_encode("abxyc")[:4] != turn.ids
    assert completion_prompt(turn, "abxyc", toy_encode) == ([*turn.ids, ord("c")], "spliced")
    assert completion_prompt(turn, "zz", toy_encode) == (toy_encode("zz"), "restarted")


def test_trajectory_trains_exactly_the_sampled_tokens(tokenizer: Any) -> None:
    trajectory = Trajectory()
    returned = AssistantReply.of(
        {
            "content": None,
            "tool_calls": [{"function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}],
        }
    )
    first = first_turn(tokenizer, CALL, returned=returned)
    trajectory.add(first, "first")
    sent_back = {
        "content": None,
        "tool_calls": [{"function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}],
    }
    messages, rendered, history = request_after(tokenizer, sent_back, {"role": "tool", "content": "6"})
    prompt, how = chat_prompt(trajectory.turns, messages, rendered, history, {tokenizer.eos_token_id})
    sampled = [*encode(tokenizer, "\\boxed{6}"), tokenizer.eos_token_id]
    second = SampledTurn(prompt, sampled, [-0.5] * len(sampled), rendered, num_messages=3)
    trajectory.add(second, how)
    assert (trajectory.num_requests, trajectory.num_spliced, trajectory.num_restarts) == (2, 1, 0)

    log = trajectory.message_log(tokenizer)
    assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant"]
    assert message_log_token_ids(log).tolist() == second.ids  # one row: the last prompt and response
    batch = message_logs_to_batch([log], pad_token_id=0, train_roles=("assistant",))
    trained = batch["input_ids"][0][batch["token_mask"][0].bool()].tolist()
    assert trained == first.sampled_ids + second.sampled_ids  # the sampled tokens, nothing else
    logprobs = torch.cat([m["generation_logprobs"] for m in log if m["role"] == "assistant"])  # type: ignore[typeddict-item]
    assert logprobs.tolist() == pytest.approx(first.logprobs + second.logprobs)

    # Rewritten history: the earlier turns are dropped and counted.
    restart = first_turn(tokenizer, "x")
    trajectory.add(restart, "restarted")
    assert trajectory.turns == [restart]
    assert (trajectory.num_requests, trajectory.num_restarts, trajectory.num_dropped_turns) == (3, 1, 2)


def test_tool_call_arguments_are_rendered_as_objects() -> None:
    messages = normalise_chat_messages(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
            {"role": "tool", "content": "2", "tool_call_id": "call_1"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert messages[2]["content"] == "ab"
    assert messages[0]["content"] == ""
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert messages[1] == {"role": "tool", "content": "2", "tool_call_id": "call_1"}


def test_requests_that_would_sample_off_policy_are_refused() -> None:
    sampling = GenerationConfig(temperature=0.7, top_p=0.9)
    chat = [{"role": "user", "content": "hi"}]
    check_request(ChatCompletionRequest(model="m", messages=chat, temperature=0.7, top_p=0.9), sampling, "m")
    check_request(ChatCompletionRequest(model="m", messages=chat, top_k=-1), sampling, "m")
    problems: dict[str, tuple[str, dict[str, Any]]] = {
        "temperature=1.0": ("temperature", {"messages": chat, "temperature": 1.0}),
        "top_p=1.0": ("top_p", {"messages": chat, "top_p": 1.0}),
        "top_k=5": ("top_k", {"messages": chat, "top_k": 5}),
        "n=2": ("n", {"messages": chat, "n": 2}),
        "stream=true": ("stream", {"messages": chat, "stream": True}),
        "messages is empty": ("messages", {"messages": []}),
        "messages[1].role is 'robot'": ("messages[1].role", {"messages": [*chat, {"role": "robot"}]}),
        "several texts": ("prompt", {"prompt": ["a", "b"]}),
        "echo=true": ("echo", {"prompt": "a", "echo": True}),
    }
    for expected, (param, fields) in problems.items():
        kind = ChatCompletionRequest if "messages" in fields else CompletionRequest
        with pytest.raises(EndpointError, match=expected.replace("[", r"\[").replace("]", r"\]")) as refused:
            check_request(kind(model="m", **fields), sampling, "m")
        assert (refused.value.status, refused.value.param) == (400, param), expected
    with pytest.raises(EndpointError) as unknown:
        check_request(ChatCompletionRequest(model="gpt-4o", messages=chat), sampling, "m")
    assert unknown.value.body() == {
        "error": {
            "message": str(unknown.value),
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert unknown.value.status == 404


def test_validation_errors_name_the_field() -> None:
    cases = {
        ("missing", ("body", "messages")): ("messages", "missing_required_parameter"),
        ("int_parsing", ("body", "max_tokens")): ("max_tokens", "invalid_type"),
        ("greater_than_equal", ("body", "max_tokens")): ("max_tokens", "invalid_value"),
        ("dict_type", ("body", "messages", 2)): ("messages[2]", "invalid_type"),
        ("string_type", ("body", "stop", "str")): ("stop", "invalid_type"),  # a union member's tag
        ("list_type", ("body", "prompt", "list[int]", 0)): ("prompt", "invalid_type"),
        ("json_invalid", ("body", 12)): (None, None),
        ("model_attributes_type", ("body",)): (None, None),
    }
    for (kind, loc), (param, code) in cases.items():
        err = validation_error([{"type": kind, "loc": loc, "msg": "bad"}])
        assert (err.status, err.param, err.code) == (400, param, code), (kind, loc)


def test_tool_calls_are_split_from_the_content() -> None:
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    content, calls = split_tool_calls(text)
    assert content == "Let me compute."
    assert [c["function"]["name"] for c in calls] == ["calculator"]
    assert calls[0]["function"]["arguments"] == '{"expression": "2*3"}'
    # A malformed call is returned as written, with no calls.
    assert split_tool_calls("<tool_call>\n{not json}\n</tool_call>") == (
        "<tool_call>\n{not json}\n</tool_call>",
        [],
    )
    assert split_tool_calls("no call") == ("no call", [])


def test_rewards_printed_by_agent_programs() -> None:
    assert parse_reward("log line\n0.5\n").reward == 0.5
    assert parse_reward('{"reward": 1}\n').reward == 1.0
    for bad in ("", "done", '{"score": 1}', "true"):
        outcome = parse_reward(bad)
        assert outcome.error is not None and outcome.reward == 0.0, bad


def test_agent_functions_load_from_modules_and_files(tmp_path: Path) -> None:
    fn = load_agent_function(f"{ROOT / 'examples' / 'agents' / 'tiny_calculator_agent.py'}:agent")
    assert callable(fn)
    assert load_agent_function("json:dumps") is not None
    with pytest.raises(UserError, match="cannot be loaded"):
        load_agent_function(f"{tmp_path / 'missing.py'}:agent")
    with pytest.raises(UserError, match="cannot be loaded"):
        load_agent_function("json:no_such_function")


def test_agent_config_checks() -> None:
    assert AgentConfig().enabled is False
    assert AgentConfig(enabled=True, function="m:f").loopback
    with pytest.raises(ValueError, match="exactly one of"):
        AgentConfig(enabled=True)
    with pytest.raises(ValueError, match="exactly one of"):
        AgentConfig(enabled=True, function="m:f", command=["python"])
    with pytest.raises(ValueError, match="module:function"):
        AgentConfig(enabled=True, function="m.f")
    with pytest.raises(ValueError, match="IP address"):
        AgentConfig(enabled=True, function="m:f", host="localhost")
    assert not AgentConfig(enabled=True, function="m:f", host="0.0.0.0").loopback


def _task() -> AgentTask:
    return AgentTask(
        "t", "http://127.0.0.1:1/sessions/t/v1", "secret", [QUESTION], {"ground_truth": "3"}, "math", "tiny"
    )


def test_agents_that_outlive_their_time_are_stopped(tmp_path: Path) -> None:
    # A program and the process it started are both killed; the token reaches it in its environment only.
    pid_file = tmp_path / "child.pid"
    script = f"import os, subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    outcome = run_program([sys.executable, "-c", script], _task(), timeout_s=3.0)
    assert outcome.error is not None and "timed out" in outcome.error
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    echo = "import json, os, sys; task = json.load(sys.stdin); print(float(os.environ['OPENAI_API_KEY'] == 'secret' and 'api_key' not in task))"
    assert run_program([sys.executable, "-c", echo], _task(), timeout_s=30.0).reward == 1.0
    # A function is abandoned after its time.
    slow = call_with_timeout(lambda task: time.sleep(5) or 1.0, _task(), timeout_s=0.2)
    assert slow.error is not None and "timed out" in slow.error
    assert call_with_timeout(lambda task: 0.25, _task(), timeout_s=5.0).reward == 0.25


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of an exited parent may linger as a zombie until reaped by init.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_processed_samples_keep_their_prompt_as_messages(tokenizer: Any) -> None:
    spec = TaskDataSpec(
        "math", "Solve: {}", "Be brief.", add_bos=True, add_eos=False, add_generation_prompt=True
    )
    record: Any = {
        "messages": [{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "3"}],
        "expected_answer": "3",
    }
    plain = math_processor(record, spec, tokenizer, 64, 0)
    kept = KeepPromptMessages(math_processor)(record, spec, tokenizer, 64, 0)
    assert (
        message_log_token_ids(kept["message_log"]).tolist()
        == message_log_token_ids(plain["message_log"]).tolist()
    )
    assert kept["extra_env_info"] == {
        "ground_truth": "3",
        PROMPT_MESSAGES_KEY: [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Solve: What is 1+2?"},
        ],
    }
