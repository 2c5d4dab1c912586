"""GRPO on rollouts of external agents (``examples/configs/grpo_agent_endpoint_tiny.yaml``): the example
agent drives its calculator loop with the ``openai`` client against the endpoint, served by the tiny tools
checkpoint on the embedded engine in the policy workers: the calls the model writes come back as OpenAI
``tool_calls``, the agent answers them with ``tool`` messages, and one GRPO step trains on exactly the
tokens the agent was sent (each row is the last prompt and response the endpoint returned; the sampled ids
and log-probs as the agent received them), with ``gen_kl_error`` ~ 0. (That vLLM's sampled ids and
log-probs reach the training batch unchanged is checked in tests/distributed/test_tool_rollouts.py.)"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("openai")
pytest.importorskip("fastapi")

import nemo_rl.algorithms.grpo as grpo
from nemo_rl.config import load_and_validate
from nemo_rl.data.datasets import setup_rl_data
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.agent_rollouts import AgentTask, load_agent_function
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "configs" / "grpo_agent_endpoint_tiny.yaml"
AGENT_FILE = ROOT / "examples" / "agents" / "tiny_calculator_agent.py"

RESPONSES: dict[str, list[Any]] = {}
"""The message of every response each trajectory's agent received, in order."""
_LOCK = threading.Lock()


def recording_agent(task: AgentTask) -> float:
    """The example agent, keeping what each response carried."""
    import openai

    solve = load_agent_function(f"{AGENT_FILE}:solve")
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0, timeout=120)
    create = client.chat.completions.create

    def recording_create(**kwargs: Any) -> Any:
        response = create(**kwargs)
        with _LOCK:
            RESPONSES.setdefault(task.trajectory_id, []).append(response.choices[0].message)
        return response

    client.chat.completions.create = recording_create  # type: ignore[method-assign]
    return solve(client, task.model, task.messages, str(task.extra_env_info["ground_truth"]))  # type: ignore[call-arg]


@pytest.mark.usefixtures("ray_cluster")
def test_grpo_step_trains_on_the_agents_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    RESPONSES.clear()
    config = load_and_validate(
        CONFIG,
        grpo.MasterConfig,
        [
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "grpo.max_num_steps=1",
            "grpo.val_at_start=false",
            "grpo.val_period=0",
            f"grpo.agent.function='{__name__}:recording_agent'",
            "policy.train_global_batch_size=16",
            "policy.train_micro_batch_size=16",
            "policy.logprob_batch_size=16",
            "data.num_train_samples=64",
            "data.num_val_samples=8",
            "checkpointing.enabled=false",
            f"logger.log_dir={tmp_path / 'logs'}",
            "logger.console_enabled=false",
            "++logger.progress_bar=false",
        ],
    )
    tokenizer = get_policy_tokenizer(config.policy)
    train, val = setup_rl_data(
        config.data, tokenizer, max_total_sequence_length=config.policy.max_total_sequence_length
    )
    trained: list[tuple[BatchedDataDict[Any], BatchedDataDict[Any]]] = []
    build = grpo.build_train_batch

    def capture(rollout: BatchedDataDict[Any], *args: Any, **kwargs: Any) -> BatchedDataDict[Any]:
        trained.append((rollout, build(rollout, *args, **kwargs)))
        return trained[-1][1]

    monkeypatch.setattr(grpo, "build_train_batch", capture)
    s = grpo.setup(config, tokenizer, train, val)
    try:
        assert s.rl.agent_endpoint is not None and s.rl.agent_endpoint.url.startswith("http://127.0.0.1:")
        metrics = grpo.grpo_train(s)
    finally:
        s.shutdown()

    assert metrics["agent/failed"] == 0.0
    assert len(RESPONSES) == 16
    assert metrics["agent/requests"] == sum(len(r) for r in RESPONSES.values())
    # The tiny tools checkpoint calls the calculator (about once per problem); each call came back as
    # tool_calls and was answered, the agent sending every response back unchanged (no restart). The tiny
    # template does not render tool calls, so each answered call drifts and is spliced.
    calls = [m for messages in RESPONSES.values() for m in messages if m.tool_calls]
    assert len(calls) >= 8
    assert all(call.tool_calls[0].function.name == "calculator" for call in calls)
    assert metrics["agent/restarts"] == 0.0
    assert metrics["agent/spliced_requests"] == sum(
        bool(m.tool_calls) for messages in RESPONSES.values() for m in messages[:-1]
    )
    # Each training row is exactly the ids the agent was sent: its last prompt (the earlier prompts,
    # responses and tool results in it) and response; the sampled tokens train, with their sampler's log-probs.
    ((rollout, batch),) = trained
    for row, trajectory_id in enumerate(rollout["trajectory_id"]):
        responses = RESPONSES[trajectory_id]
        last = responses[-1]
        length = int(batch["input_lengths"][row])
        assert batch["input_ids"][row][:length].tolist() == last.prompt_token_ids + last.generation_token_ids
        mask = batch["token_mask"][row].bool()
        assert batch["input_ids"][row][mask].tolist() == [
            t for m in responses for t in m.generation_token_ids
        ]
        expected = [lp for m in responses for lp in m.generation_log_probs]
        assert batch["generation_logprobs"][row][mask].tolist() == pytest.approx(expected, abs=1e-6)
    # The policy scores the sampled tokens as the sampler did: same weights, same distribution.
    assert abs(metrics["gen_kl_error"]) < 1e-4
    assert torch.isfinite(torch.tensor(metrics["loss"]))
