"""The agent endpoint's bookkeeping without a server: how each request's prompt continues its trajectory's
ids (exact, spliced after re-tokenisation drift, restarted after rewritten history), the trajectory as a
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
    request_problem,
    split_tool_calls,
)
from nemo_rl.experience.agent_rollouts import (
    AgentTask,
    call_with_timeout,
    load_agent_function,
    parse_reward,
    run_program,
)
from nemo_rl.experience.agent_trajectories import (
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


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return get_policy_tokenizer(PolicyConfig(model_name=str(TINY_MODEL)))


def render(tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_turn(tokenizer: Any, reply: str, *, stopped: bool = True) -> SampledTurn:
    prompt = render(tokenizer, [QUESTION], generation_prompt=True)
    sampled = encode(tokenizer, reply) + ([tokenizer.eos_token_id] if stopped else [])
    return SampledTurn(
        prompt_ids=prompt,
        sampled_ids=sampled,
        logprobs=[-0.1 * (k + 1) for k in range(len(sampled))],
        rendered_ids=prompt,
        num_messages=1,
        truncated=not stopped,
    )


def second_request(tokenizer: Any, sent_back: str) -> tuple[list[int], list[int]]:
    messages = [QUESTION, {"role": "assistant", "content": sent_back}, {"role": "user", "content": "Again?"}]
    return (
        render(tokenizer, messages, generation_prompt=True),
        render(tokenizer, messages[:2], generation_prompt=False),
    )


def test_first_and_exact_continuations_use_the_rendering(tokenizer: Any) -> None:
    turn = first_turn(tokenizer, "1+2=\\boxed{3}")
    assert chat_prompt(None, turn.prompt_ids, None, {tokenizer.eos_token_id}) == (turn.prompt_ids, "first")
    rendered, history = second_request(tokenizer, "1+2=\\boxed{3}")
    prompt, how = chat_prompt(turn, rendered, history, {tokenizer.eos_token_id})
    assert how == "exact"
    assert prompt == rendered
    assert prompt[: len(turn.ids)] == turn.ids


def test_drifted_response_is_spliced_onto_the_sampled_ids(tokenizer: Any) -> None:
    turn = first_turn(tokenizer, "1+2=\\boxed{3}")
    # The agent sends the response back reformatted (a trailing space): its rendering no longer holds the ids.
    rendered, history = second_request(tokenizer, "1+2=\\boxed{3} ")
    assert rendered[: len(turn.ids)] != turn.ids
    prompt, how = chat_prompt(turn, rendered, history, {tokenizer.eos_token_id})
    assert how == "spliced"
    # The sampled ids are kept, the sampled EOS stands for the template's, and the new turn follows.
    assert prompt == turn.ids + encode(tokenizer, "<|user|>Again?<|assistant|>")


def test_response_cut_by_its_budget_gets_the_templates_end_of_turn(tokenizer: Any) -> None:
    turn = first_turn(tokenizer, "1+2=\\box", stopped=False)
    rendered, history = second_request(tokenizer, "1+2=\\bo")  # the agent trimmed the cut response
    prompt, how = chat_prompt(turn, rendered, history, {tokenizer.eos_token_id})
    assert how == "spliced"
    assert prompt == [*turn.ids, tokenizer.eos_token_id, *encode(tokenizer, "<|user|>Again?<|assistant|>")]


def test_rewritten_history_restarts_the_trajectory(tokenizer: Any) -> None:
    turn = first_turn(tokenizer, "1+2=\\boxed{3}")
    messages = [
        {"role": "user", "content": "What is 2+2?"},  # an earlier message edited
        {"role": "assistant", "content": "1+2=\\boxed{3}"},
        {"role": "user", "content": "Again?"},
    ]
    rendered = render(tokenizer, messages, generation_prompt=True)
    history = render(tokenizer, messages[:2], generation_prompt=False)
    assert chat_prompt(turn, rendered, history, {tokenizer.eos_token_id}) == (rendered, "restarted")
    # No assistant message where the previous response belongs: nothing to splice onto either.
    assert chat_prompt(turn, rendered, None, {tokenizer.eos_token_id}) == (rendered, "restarted")


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
    first = first_turn(tokenizer, "1+2=\\boxed{4}")
    trajectory.add(first, "first")
    rendered, history = second_request(tokenizer, "1+2=\\boxed{4} ")
    prompt, how = chat_prompt(first, rendered, history, {tokenizer.eos_token_id})
    sampled = [*encode(tokenizer, "1+2=\\boxed{3}"), tokenizer.eos_token_id]
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
    assert request_problem(ChatCompletionRequest(messages=chat, temperature=0.7, top_p=0.9), sampling) is None
    assert request_problem(ChatCompletionRequest(messages=chat, top_k=-1), sampling) is None
    problems = {
        "temperature=1.0": ChatCompletionRequest(messages=chat, temperature=1.0),
        "top_p=1.0": ChatCompletionRequest(messages=chat, top_p=1.0),
        "top_k=5": ChatCompletionRequest(messages=chat, top_k=5),
        "n=2": ChatCompletionRequest(messages=chat, n=2),
        "stream=true": ChatCompletionRequest(messages=chat, stream=True),
        "messages is empty": ChatCompletionRequest(messages=[]),
        "several texts": CompletionRequest(prompt=["a", "b"]),
        "echo=true": CompletionRequest(prompt="a", echo=True),
    }
    for expected, request in problems.items():
        assert expected in (request_problem(request, sampling) or ""), expected


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
    fn = load_agent_function(f"{ROOT / 'examples' / 'agents' / 'tiny_math_agent.py'}:agent")
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
        "t", "http://127.0.0.1:1/sessions/t/v1", "secret", [QUESTION], {"ground_truth": "3"}, "math"
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
