"""Tools: the registry, ``<tool_call>`` parsing (malformed calls become error results), the calculator, the
python tool through the sandbox, user tools from ``module:function`` paths, and the chat-template format."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nemo_rl.config.env import CodeEnvConfig, EnvConfig, MathEnvConfig, SandboxConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.data.interfaces import TaskDataSpec
from nemo_rl.data.processors import math_processor
from nemo_rl.environments.registry import check_task_envs
from nemo_rl.environments.sandbox import check_sandbox, detect_isolation
from nemo_rl.environments.tools import (
    MalformedToolCall,
    TaskTools,
    Tool,
    ToolCall,
    ToolRegistry,
    build_task_tools,
    build_tool_registry,
    parse_tool_calls,
    truncate_tool_response,
    wire_task_tools,
)
from nemo_rl.environments.tools.calculator import CalculatorError, calculate
from nemo_rl.models.tokenizer import get_policy_tokenizer

TINY_TOKENIZER = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_qwen2_init"
CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{}"}}}}</tool_call>'
SANDBOX = SandboxConfig(wall_time_limit_s=2.0, cpu_time_limit_s=1, memory_limit_mb=256, max_output_bytes=2048)
try:
    check_sandbox(SANDBOX)
except (
    UserError
):  # no bubblewrap here: these tests check the tools, not containment (tests/unit/test_security.py)
    SANDBOX = SANDBOX.model_copy(update={"isolation": "rlimits"})


def call_block(payload: object) -> str:
    return f"<tool_call>\n{json.dumps(payload)}\n</tool_call>"


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


UPPER = Tool(
    name="upper",
    description="Upper-case a text.",
    parameters={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    fn=lambda text: text.upper(),
)


def undocumented(x):  # type: ignore[no-untyped-def]  # no hints: no schema can be derived
    return x


def test_parse_qwen_tool_calls() -> None:
    turn = (
        "Let me compute.\n"
        + call_block({"name": "calculator", "arguments": {"expression": "2 * 3"}})
        + "\n"
        + call_block({"name": "python", "arguments": json.dumps({"code": "print(1)"})})
    )
    assert parse_tool_calls(turn) == [
        ToolCall("calculator", {"expression": "2 * 3"}),
        ToolCall("python", {"code": "print(1)"}),
    ]
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize(
    ("block", "error"),
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "expected a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '"arguments" must be an object'),
        ('<tool_call>{"name": "f", "arguments": "nope"}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {"expr', "not closed"),
    ],
)
def test_malformed_calls_are_reported_not_raised(block: str, error: str) -> None:
    [call] = parse_tool_calls(block)
    assert isinstance(call, MalformedToolCall) and error in call.error
    [result] = ToolRegistry([]).respond(block)
    assert (
        result.is_error
        and result.content.startswith("Error: malformed tool call")
        and error in result.content
    )
    assert result.message() == {"role": "tool", "content": result.content}


def test_registry_runs_calls_and_reports_every_failure() -> None:
    registry = build_tool_registry(["calculator"], SANDBOX)
    turn = "".join(
        call_block(payload)
        for payload in [
            {"name": "calculator", "arguments": {"expression": "1234 * 5678"}},
            {"name": "calculater", "arguments": {"expression": "1"}},
            {"name": "calculator", "arguments": {"expr": "1"}},
            {"name": "calculator", "arguments": {"expression": 7}},
            {"name": "calculator", "arguments": {"expression": "1 / 0"}},
        ]
    )
    results = registry.respond(turn)
    assert [r.content for r in results] == [
        "7006652",
        "Error: unknown tool 'calculater' (tools: calculator)",
        "Error: missing required argument 'expression'; unknown argument 'expr' (expected: expression)",
        "Error: argument 'expression' must be string, got int",
        "Error: CalculatorError: division by zero",
    ]
    assert [r.is_error for r in results] == [False, True, True, True, True]
    assert results[0].message() == {"role": "tool", "content": "7006652", "name": "calculator"}


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1234 * 5678", "7006652"),
        ("(1 + 2) * -3", "-9"),
        ("7 / 2", "3.5"),
        ("2 ** 10", "1024"),
        ("8 / 4", "2"),
    ],
)
def test_calculator(expression: str, value: str) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('id')", "only numbers"),
        ("x + 1", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 2", "only numbers"),
        ("(1).__class__", "only numbers"),
        ("2 ** 100000", "exponents are limited"),
        ("9 ** 999 * 9 ** 999 * 9 ** 999", "digits"),
        ("10.0 ** 400", "too large"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 600, "longer than"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, error: str) -> None:
    with pytest.raises(CalculatorError, match=error):
        calculate(expression)


def test_python_tool_runs_in_the_sandbox() -> None:
    registry = build_tool_registry(["python"], SANDBOX)
    [ok, failed, looped] = registry.respond(
        call_block({"name": "python", "arguments": {"code": "print(sum(range(10)))"}})
        + call_block({"name": "python", "arguments": {"code": "raise ValueError('bad')"}})
        + call_block({"name": "python", "arguments": {"code": "import time\ntime.sleep(30)"}})
    )
    assert ok.content == "45" and not ok.is_error
    assert "ValueError: bad" in failed.content and failed.content.endswith("[exit status 1]")
    assert looped.content.endswith("[stopped: the time limit was reached]")


def test_user_tools_from_import_paths() -> None:
    module = __name__
    registry = build_tool_registry([f"{module}:multiply", f"{module}:UPPER", "calculator"], SANDBOX)
    assert [s["function"]["name"] for s in registry.schemas()] == ["multiply", "upper", "calculator"]
    assert registry.schemas()[0]["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first factor."},
            "b": {"type": "integer", "description": "The second factor."},
        },
        "required": ["a", "b"],
    }
    [product, shout] = registry.respond(
        call_block({"name": "multiply", "arguments": {"a": 6, "b": 7}})
        + call_block({"name": "upper", "arguments": {"text": "hi"}})
    )
    assert (product.content, shout.content) == ("42", "HI")


@pytest.mark.parametrize(
    ("names", "error"),
    [
        (["calculater"], "did you mean 'calculator'"),
        (["no.such.module:f"], "does not import"),
        ([f"{__name__}:SANDBOX"], "not a Tool or a function"),
        ([f"{__name__}:undocumented"], "no JSON schema"),
        (["calculator", "calculator"], "unique"),
    ],
)
def test_bad_tool_names_are_user_errors(names: list[str], error: str) -> None:
    with pytest.raises(UserError, match=error):
        build_tool_registry(names, SANDBOX)


def test_schemas_render_through_a_chat_template() -> None:
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    # The tools block of the Qwen templates in short: each schema as JSON on a line inside <tools></tools>.
    template = (
        "{% if tools %}<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    )
    registry = build_tool_registry(["calculator", "python"], SANDBOX)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=registry.schemas(), chat_template=template, tokenize=False
    )
    assert isinstance(text, str)
    rendered = [
        json.loads(line) for line in text.split("<tools>")[1].split("</tools>")[0].strip().splitlines()
    ]
    assert rendered == registry.schemas()


def test_tools_need_a_turn_to_answer_in() -> None:
    check_task_envs(["math"], EnvConfig(math=MathEnvConfig(tools=["calculator"])))
    env = EnvConfig(math=MathEnvConfig(tools=["calculator"]))
    with pytest.raises(ValueError, match=r"env\.math\.tools=\['calculator'\] .* grpo\.max_rollout_turns=1"):
        env.check_tool_turns(1, "grpo.max_rollout_turns")
    env.check_tool_turns(2, "grpo.max_rollout_turns")
    EnvConfig().check_tool_turns(1, "grpo.max_rollout_turns")


def test_tools_and_external_agents_are_refused_together() -> None:
    from nemo_rl.config.master import GRPOMasterConfig

    with pytest.raises(ValueError, match=r"env\.math\.tools would never run: with grpo\.agent\.enabled"):
        GRPOMasterConfig.model_validate(
            {
                "policy": {"model_name": str(TINY_TOKENIZER)},
                "grpo": {"max_rollout_turns": 2, "agent": {"enabled": True, "function": "agents:solve"}},
                "env": {"math": {"tools": ["calculator"]}},
            }
        )


def test_task_tools_cut_long_results_and_extra_calls() -> None:
    tools = TaskTools.from_config(
        MathEnvConfig(tools=["calculator"], max_tool_response_length=6, tool_response_truncate_side="left")
    )
    results = tools.run(parse_tool_calls(CALL.format("2**100") + CALL.format("1+1")))
    assert [r.content for r in results] == [
        "126765...(truncated)...",
        "Error: at most 1 tool call(s) per turn run; this one did not",
    ]
    assert [r.is_error for r in results] == [False, True]
    assert truncate_tool_response("abcdefgh", 3, "right") == "...(truncated)...fgh"
    assert truncate_tool_response("abcdefgh", 3, "middle") == "ab...(truncated)...h"
    assert truncate_tool_response("abc", 3, "middle") == "abc"
    assert build_task_tools(EnvConfig()) == {}
    assert set(build_task_tools(EnvConfig(code=CodeEnvConfig(tools=["python"], sandbox=SANDBOX)))) == {"code"}


def test_tools_are_wired_once_where_the_run_starts() -> None:
    """``wire_task_tools`` builds the tools and declares their schemas in the prompts of their task's
    datasets (read lazily, so the prompts read afterwards show them); other tasks' prompts stay as they are,
    and prompts that declare other tools are refused."""
    tokenizer = get_policy_tokenizer(PolicyConfig(model_name=str(TINY_TOKENIZER)))
    records = [{"messages": [{"role": "user", "content": "What is 2*3?"}], "expected_answer": "6"}]

    def dataset(task: str, tools: tuple[dict[str, object], ...] = ()) -> ProcessedDataset:
        spec = TaskDataSpec(
            task, None, None, add_bos=True, add_eos=False, add_generation_prompt=True, tools=tools
        )
        return ProcessedDataset(records, math_processor, spec, tokenizer, 256)  # type: ignore[arg-type]

    math, code = dataset("math"), dataset("code")
    env = EnvConfig(math=MathEnvConfig(tools=["calculator"]))
    assert "<tools>" not in math[0]["message_log"][0]["content"]
    task_to_tools = wire_task_tools(env, (math, code, None))
    assert set(task_to_tools) == {"math"}
    assert math.spec.tools == tuple(task_to_tools["math"].schemas())
    assert math[0]["message_log"][0]["content"].startswith(
        "<|bos|><|system|><tools>calculator(expression)</tools>"
    )
    assert code.spec.tools == ()
    assert wire_task_tools(env, (math,))["math"].schemas() == list(math.spec.tools)  # wired again: unchanged
    with pytest.raises(UserError, match=r"already declare other tools than env\.math\.tools"):
        wire_task_tools(env, (dataset("math", tuple(build_tool_registry(["python"], SANDBOX).schemas())),))


def test_isolation_is_detected_once() -> None:
    assert detect_isolation(SANDBOX.isolation, sys.executable) is detect_isolation(
        SANDBOX.isolation, sys.executable
    )
