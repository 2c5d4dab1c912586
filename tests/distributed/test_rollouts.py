"""Rollouts through real environment actors, with a scripted generation backend standing in for the model.

The multi-turn test plays the number-guessing game with a binary-search agent that reads the conversation
(its earlier guesses and the environment's "higher"/"lower" replies), so the conversation grows turn by turn
exactly as it does under GRPO.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from nemo_rl.config.env import EnvConfig, MathEnvConfig, NumberGuessingEnvConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.llm_message_utils import format_message_log, message_log_token_ids
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.games.number_guessing import game_prompt, new_game
from nemo_rl.environments.healing import HealingEnvironment
from nemo_rl.environments.registry import create_env, stop_envs
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.models.tokenizer import get_policy_tokenizer

TINY_MODEL = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_qwen2_init"
GAME = NumberGuessingEnvConfig(low=1, high=16, max_guesses=6)
SAMPLER_LOGPROB = -0.25


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return get_policy_tokenizer(PolicyConfig(model_name=str(TINY_MODEL)))


class ScriptedGeneration:
    """A generation backend whose replies come from ``reply_fn(prompt_text)`` (ends each reply with EOS)."""

    def __init__(self, tokenizer: Any, reply_fn: Callable[[str], str]) -> None:
        self.tokenizer = tokenizer
        self.reply_fn = reply_fn
        self.calls = 0

    def generate(self, data: BatchedDataDict[Any], greedy: bool = False) -> BatchedDataDict[Any]:
        self.calls += 1
        rows = []
        for ids, length in zip(data["input_ids"], data["input_lengths"], strict=True):
            prompt = ids[: int(length)]
            reply = self.reply_fn(self.tokenizer.decode(prompt))
            reply_ids = torch.tensor(
                [*self.tokenizer.encode(reply, add_special_tokens=False), self.tokenizer.eos_token_id]
            )
            rows.append((prompt, reply_ids))
        width = max(len(p) + len(r) for p, r in rows)
        out = BatchedDataDict[Any](
            output_ids=torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long),
            logprobs=torch.zeros(len(rows), width),
            generation_lengths=torch.tensor([len(r) for _, r in rows]),
            unpadded_sequence_lengths=torch.tensor([len(p) + len(r) for p, r in rows]),
            truncated=torch.zeros(len(rows), dtype=torch.bool),
        )
        for b, (prompt, reply_ids) in enumerate(rows):
            out["output_ids"][b, : len(prompt) + len(reply_ids)] = torch.cat([prompt, reply_ids])
            out["logprobs"][b, len(prompt) : len(prompt) + len(reply_ids)] = SAMPLER_LOGPROB
        return out


def binary_search_agent(conversation: str) -> str:
    """Next guess from the conversation so far: bisect the range left by earlier higher/lower answers."""
    low, high = GAME.low, GAME.high
    guesses = [int(g) for g in re.findall(r"<\|assistant\|>(\d+)", conversation)]
    answers = re.findall(r"\b(higher|lower)\b", conversation.split("You have", 1)[1])
    for guess, answer in zip(guesses, answers, strict=False):
        if answer == "higher":
            low = guess + 1
        else:
            high = guess - 1
    return str((low + high) // 2)


def _game_batch(tokenizer: Any, targets: list[int]) -> BatchedDataDict[Any]:
    prompt_log = format_message_log(
        [{"role": "user", "content": game_prompt(GAME)}],
        tokenizer,
        add_bos=True,
        add_eos=False,
        add_generation_prompt=True,
    )
    return BatchedDataDict[Any](
        message_log=[list(prompt_log) for _ in targets],
        extra_env_info=[new_game(t) for t in targets],
        task_name=["number_guessing"] * len(targets),
        loss_multiplier=torch.ones(len(targets)),
    )


def test_multi_turn_number_guessing(ray_cluster: Any, tokenizer: Any) -> None:
    env = create_env("number_guessing", EnvConfig(number_guessing=GAME))
    targets = [8, 1, 13, 16]
    # Bisection over 1..16 needs 1 guess for 8, and 4 or 5 for the others.
    generation = ScriptedGeneration(tokenizer, binary_search_agent)
    batch, metrics = run_multi_turn_rollout(
        generation,  # type: ignore[arg-type]
        _game_batch(tokenizer, targets),
        tokenizer,
        {"number_guessing": env},
        max_seq_len=1024,
        max_rollout_turns=GAME.max_guesses,
    )
    assert batch["total_reward"].tolist() == [1.0, 1.0, 1.0, 1.0]
    turns = batch["num_turns"].tolist()
    assert turns[0] == 1 and all(t > 1 for t in turns[1:]), turns
    assert generation.calls == max(turns)
    assert metrics["mean_turns_per_sample"] == pytest.approx(sum(turns) / len(turns))
    assert "env/replaced_actors" not in metrics  # no environment actor was lost
    assert not batch["truncated"].any()

    for log, target, num_turns in zip(batch["message_log"], targets, turns, strict=True):
        roles = [m["role"] for m in log]
        # prompt, then assistant guesses interleaved with the environment's answers as user turns
        assert roles == ["user"] + ["assistant", "user"] * (num_turns - 1) + ["assistant"]
        assert log[-1]["content"].startswith(str(target))
        for message in log[1:]:
            if message["role"] == "user":
                assert re.search(r"higher|lower", message["content"]), message["content"]
                # The observation is a full user turn that ends by handing the turn back to the assistant.
                assert message["content"].endswith("<|assistant|>")

    # The rollout's token tensors hold each conversation, the assistant's tokens marked with their log-probs.
    for b, log in enumerate(batch["message_log"]):
        length = int(batch["input_lengths"][b])
        assert torch.equal(batch["input_ids"][b, :length], message_log_token_ids(log))
        assert bool((batch["input_ids"][b, length:] == tokenizer.pad_token_id).all())
        assistant_tokens = sum(m["token_ids"].numel() for m in log if m["role"] == "assistant")
        mask = batch["token_mask"][b].bool()
        assert int(mask.sum()) == assistant_tokens
        assert bool((batch["generation_logprobs"][b][mask] == SAMPLER_LOGPROB).all())
        assert bool((batch["generation_logprobs"][b][~mask] == 0).all())
    stop_envs([env], timeout_s=60)


def test_environment_actor_killed_mid_game_is_replaced(ray_cluster: Any, tokenizer: Any) -> None:
    # The game's state travels in the metadata, so the replacement of an actor killed between two turns plays
    # on: every game still ends correct, and the rollout counts the replacement.
    env = create_env("number_guessing", EnvConfig(number_guessing=GAME))
    assert isinstance(env, HealingEnvironment)
    first_actor = env.actor

    def kill_on_second_turn(conversation: str) -> str:
        if conversation.count("<|assistant|>") == 2 and env.actor is first_actor:
            ray.kill(first_actor)
            # Dead before the turn's step is sent: ray.kill returns at once, and a call may still be answered
            # while the kill is on its way.
            for _ in range(10_000):
                try:
                    ray.get(first_actor.__ray_ready__.remote(), timeout=60)
                except ray.exceptions.RayActorError:
                    break
            else:
                pytest.fail("the killed environment actor kept answering")
        return binary_search_agent(conversation)

    batch, metrics = run_multi_turn_rollout(
        ScriptedGeneration(tokenizer, kill_on_second_turn),  # type: ignore[arg-type]
        _game_batch(tokenizer, [1, 13]),
        tokenizer,
        {"number_guessing": env},
        max_seq_len=1024,
        max_rollout_turns=GAME.max_guesses,
    )
    assert batch["total_reward"].tolist() == [1.0, 1.0] and min(batch["num_turns"].tolist()) > 2
    assert metrics["env/replaced_actors"] == 1.0 and env.actor is not first_actor
    stop_envs([env], timeout_s=60)


def test_token_budget_truncates_and_stops(ray_cluster: Any, tokenizer: Any) -> None:
    env = create_env("number_guessing", EnvConfig(number_guessing=GAME))
    batch_in = _game_batch(tokenizer, [13])
    prompt_len = int(message_log_token_ids(batch_in["message_log"][0]).numel())
    batch, metrics = run_multi_turn_rollout(
        ScriptedGeneration(tokenizer, lambda _: "12345678"),  # type: ignore[arg-type]
        batch_in,
        tokenizer,
        {"number_guessing": env},
        max_seq_len=prompt_len + 4,
        max_rollout_turns=GAME.max_guesses,
    )
    log = batch["message_log"][0]
    assert batch["truncated"].tolist() == [True]
    assert batch["num_turns"].tolist() == [1]
    assert log[-1]["token_ids"].numel() == 4  # cut to the budget
    assert metrics["truncation_rate"] == 1.0
    stop_envs([env], timeout_s=60)


def test_single_turn_math_rewards(ray_cluster: Any, tokenizer: Any) -> None:
    env = create_env("math", EnvConfig(math=MathEnvConfig(num_workers=1)))
    problems = [("What is 2+3?", "5"), ("What is 9-4?", "5"), ("What is 7+7?", "14")]
    logs = [
        format_message_log(
            [{"role": "user", "content": q}],
            tokenizer,
            add_bos=True,
            add_eos=False,
            add_generation_prompt=True,
        )
        for q, _ in problems
    ]
    batch_in = BatchedDataDict[Any](
        message_log=logs,
        extra_env_info=[{"ground_truth": a} for _, a in problems],
        task_name=["math"] * 3,
        loss_multiplier=torch.ones(3),
    )
    batch, metrics = run_multi_turn_rollout(
        ScriptedGeneration(tokenizer, lambda _: "\\boxed{5}"),  # type: ignore[arg-type]
        batch_in,
        tokenizer,
        {"math": env},
        max_seq_len=128,
        max_rollout_turns=1,
    )
    assert batch["total_reward"].tolist() == [1.0, 1.0, 0.0]
    assert batch["num_turns"].tolist() == [1, 1, 1]
    assert metrics["mean_total_reward"] == pytest.approx(2 / 3)
    stop_envs([env], timeout_s=120)


def test_reward_model_environment_scores_like_transformers(
    ray_cluster: Any, tokenizer: Any, tmp_path: Path
) -> None:
    from transformers import AutoModelForSequenceClassification

    from nemo_rl.config.cluster import ClusterConfig
    from nemo_rl.config.env import RewardModelEnvConfig

    # A reward model in Hugging Face format: the tiny checkpoint with a (random) scalar head.
    torch.manual_seed(0)
    reward_model = AutoModelForSequenceClassification.from_pretrained(TINY_MODEL, num_labels=1)
    reward_model.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    cfg = RewardModelEnvConfig(
        enabled=True,
        model_name=str(tmp_path / "rm"),
        batch_size=2,  # 5 conversations over 2 data-parallel workers: uneven shards and micro-batches
        resources=ClusterConfig(gpus_per_node=2),
    )
    env = create_env("reward_model", EnvConfig(reward_model=cfg))
    questions = ["What is 2+3?", "What is 19-4?", "What is 7+7?", "What is 1+1?", "Hi"]
    logs = [
        format_message_log(
            [{"role": "user", "content": q}],
            tokenizer,
            add_bos=True,
            add_eos=False,
            add_generation_prompt=True,
        )
        for q in questions
    ]
    batch_in = BatchedDataDict[Any](
        message_log=logs,
        extra_env_info=[None] * len(logs),
        task_name=["reward_model"] * len(logs),
        loss_multiplier=torch.ones(len(logs)),
    )
    replies = iter(["5", "a much longer reply: 15", "\\boxed{14}", "2", "hello"])
    batch, _ = run_multi_turn_rollout(
        ScriptedGeneration(tokenizer, lambda _: next(replies)),  # type: ignore[arg-type]
        batch_in,
        tokenizer,
        {"reward_model": env},
        max_seq_len=128,
        max_rollout_turns=1,
    )
    # The reward is the HF model's score of the rendered conversation (prompt, reply and its EOS).
    expected = []
    with torch.no_grad():
        for log in batch["message_log"]:
            ids = message_log_token_ids(log)[None, :]
            expected.append(float(reward_model(input_ids=ids).logits))
    torch.testing.assert_close(batch["total_reward"], torch.tensor(expected), rtol=1e-5, atol=1e-5)
    _, metrics = env.call("global_post_process_and_metrics", batch).result()
    assert metrics["mean_reward"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)
    assert metrics["max_reward"] == pytest.approx(max(expected), rel=1e-5)
    stop_envs([env], timeout_s=120)
