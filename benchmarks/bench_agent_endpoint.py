"""What the agent endpoint costs per request, next to the generation calls it makes.

A stand-in backend answers every row at once with a fixed reply (no model), so all the time measured is the
endpoint's: HTTP through the ``openai`` client, rendering with the chat template, the per-trajectory
bookkeeping and the batching. Two sides, the same ``agents x turns`` requests:

- ``direct``: the generation calls an in-process rollout would make (one call of ``agents`` rows per turn);
- ``endpoint``: ``agents`` function agents, each sending ``turns`` chat requests with the ``openai`` client
  (every turn resends the conversation, as agents do), batched by the endpoint; the agents' clients and
  threads are made before the clock starts.

    uv run python benchmarks/bench_agent_endpoint.py --agents 16 64 --turns 2 --repeats 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from nemo_rl.config.agent import AgentConfig
from nemo_rl.config.generation import GenerationConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.agent_endpoint import AgentEndpoint
from nemo_rl.models.tokenizer import get_policy_tokenizer

TINY_MODEL = Path(__file__).resolve().parents[1] / "examples" / "assets" / "tiny_math_sft"
REPLY = "12+7=\\boxed{19}"


class FixedReply:
    """Answers every row with ``REPLY`` and EOS at once; counts its calls."""

    def __init__(self, tokenizer: Any) -> None:
        self.reply = [*tokenizer.encode(REPLY, add_special_tokens=False), tokenizer.eos_token_id]
        self.pad = tokenizer.pad_token_id
        self.calls = 0

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        self.calls += 1
        batch, width = data["input_ids"].shape
        reply = torch.tensor(self.reply)
        output = torch.full((batch, width + len(reply)), self.pad, dtype=torch.long)
        logprobs = torch.zeros(batch, width + len(reply))
        for b, n in enumerate(data["input_lengths"].tolist()):
            output[b, :n] = data["input_ids"][b, :n]
            output[b, n : n + len(reply)] = reply
            logprobs[b, n : n + len(reply)] = -0.5
        return BatchedDataDict[Any](
            output_ids=output,
            logprobs=logprobs,
            generation_lengths=torch.full((batch,), len(reply)),
            unpadded_sequence_lengths=data["input_lengths"] + len(reply),
            truncated=torch.zeros(batch, dtype=torch.bool),
        )


def direct(backend: FixedReply, tokenizer: Any, agents: int, turns: int) -> float:
    """Seconds for the generation calls alone (prompts tokenized once per turn, as a rollout does)."""
    start = time.perf_counter()
    for turn in range(turns):
        messages = [{"role": "user", "content": "What is 12+7?"}] * (turn + 1)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        batch = BatchedDataDict[Any](
            input_ids=ids.repeat(agents, 1), input_lengths=torch.full((agents,), len(ids), dtype=torch.long)
        )
        backend.generate(batch)
    return time.perf_counter() - start


def through_endpoint(endpoint: AgentEndpoint, agents: int, turns: int) -> float:
    """Seconds for ``agents`` concurrent agents of ``turns`` chat requests each (their clients made and their
    threads started beforehand: an ``openai`` client costs tens of milliseconds to make, an agent's cost)."""
    import openai

    ids = [f"bench-{i}" for i in range(agents)]
    clients = {
        tid: openai.OpenAI(base_url=endpoint.base_url(tid), api_key=endpoint.token, max_retries=0)
        for tid in ids
    }
    endpoint.open(ids)
    go = threading.Barrier(agents + 1)

    def agent(trajectory_id: str) -> None:
        with endpoint.agent_running():  # as a rollout counts its agents
            go.wait()
            messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 12+7?"}]
            for _ in range(turns):
                reply = clients[trajectory_id].chat.completions.create(model="tiny", messages=messages)
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": "What is 12+7?"},
                ]

    with concurrent.futures.ThreadPoolExecutor(agents) as pool:
        done = [pool.submit(agent, tid) for tid in ids]
        go.wait()
        start = time.perf_counter()
        for future in done:
            future.result()
        elapsed = time.perf_counter() - start
    recorded = endpoint.close(ids)
    assert sum(t.num_requests for t in recorded.values()) == agents * turns
    assert all(t.num_spliced == t.num_restarts == 0 for t in recorded.values())
    return elapsed


def main() -> None:
    """Measure both sides for each agent count and print seconds, requests/s and the per-request overhead."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-wait-s", type=float, default=0.02)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = get_policy_tokenizer(PolicyConfig(model_name=str(TINY_MODEL)))
    backend = FixedReply(tokenizer)
    cfg = AgentConfig(
        enabled=True, function="bench:agent", batch_wait_s=args.batch_wait_s, max_batch_size=1024
    )
    endpoint = AgentEndpoint(
        backend,  # type: ignore[arg-type]
        tokenizer,
        cfg,
        GenerationConfig(),
        max_seq_len=256,
        stop_token_ids=[tokenizer.eos_token_id],
        model_name="tiny",
    )
    endpoint.start()
    try:
        for agents in args.agents:
            requests = agents * args.turns
            direct_s = statistics.median(
                direct(backend, tokenizer, agents, args.turns) for _ in range(args.repeats)
            )
            calls_before = backend.calls
            served_s = statistics.median(
                through_endpoint(endpoint, agents, args.turns) for _ in range(args.repeats)
            )
            calls = (backend.calls - calls_before) / args.repeats
            print(
                f"agents={agents} turns={args.turns}: direct {direct_s * 1e3:.1f} ms, endpoint "
                f"{served_s * 1e3:.1f} ms ({requests / served_s:.0f} requests/s, {calls:.1f} generation calls, "
                f"{(served_s - direct_s) / requests * 1e3:.2f} ms per request over direct)",
                flush=True,
            )
    finally:
        endpoint.stop()


if __name__ == "__main__":
    main()
