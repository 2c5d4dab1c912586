"""The MathEnvironment actor: scoring, time limits inside a step, and batch metrics."""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import ray
import torch

from nemo_rl.config.env import EnvConfig, MathEnvConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.gc_tuning import GC_THRESHOLDS
from nemo_rl.environments.healing import HealingEnvironment
from nemo_rl.environments.interfaces import EnvironmentReturn
from nemo_rl.environments.registry import create_env, stop_envs

# sympy tries to evaluate this tower exactly and never returns: a real answer that hangs math-verify.
HANGING_ANSWER = "The answer is \\boxed{9^{9^{9^{9^{9}}}}}"

RAY_TIMEOUT_S = 180


def conversation(response: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": response}]


@pytest.fixture(scope="module")
def math_env(ray_cluster: dict[str, float]) -> Any:
    env = create_env("math", EnvConfig(math=MathEnvConfig(num_workers=2, verify_timeout_s=2.0)))
    assert isinstance(env, HealingEnvironment)
    yield env.actor  # the tests call the actor itself (its verifier statistics too)
    stop_envs([env], timeout_s=RAY_TIMEOUT_S)


def test_math_environment_step(math_env: Any) -> None:
    logs = [
        conversation("1 + 1 = \\boxed{2}"),
        conversation("\\boxed{3}"),
        conversation("two"),
        [
            *conversation("\\boxed{5}"),
            {"role": "user", "content": "sure?"},
            {"role": "assistant", "content": "\\boxed{2}"},
        ],
    ]
    logs.append(conversation("\\boxed{\\frac{4}{2}}"))  # only this one needs math-verify
    metadata = [{"ground_truth": "2"}] * 5
    quick_before = ray.get(math_env.verifier_stats.remote(), timeout=RAY_TIMEOUT_S)["num_quick_verdicts"]
    ret: EnvironmentReturn[Any] = ray.get(math_env.step.remote(logs, metadata), timeout=RAY_TIMEOUT_S)
    quick_after = ray.get(math_env.verifier_stats.remote(), timeout=RAY_TIMEOUT_S)["num_quick_verdicts"]
    assert quick_after - quick_before == 4
    # The job's worker processes collect garbage with its thresholds, set before they import their actor.
    assert (
        ray.get(math_env.__ray_call__.remote(lambda _: gc.get_threshold()), timeout=RAY_TIMEOUT_S)
        == GC_THRESHOLDS
    )
    assert ret.rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]  # the last assistant message is the one scored
    assert ret.rewards.dtype == torch.float32
    assert ret.terminateds.tolist() == [True] * 5
    assert [o["content"] for o in ret.observations] == [
        "Environment: correct",
        "Environment: incorrect",
        "Environment: incorrect",
        "Environment: correct",
        "Environment: correct",
    ]
    assert ret.answers == ["2", "3", None, "2", "\\frac{4}{2}"]
    assert ret.metadata[0] == {"ground_truth": "2", "extracted_answer": "2", "verify_timed_out": False}
    assert ret.next_stop_strings == [None] * 5


def test_a_hanging_answer_cannot_hang_a_step(math_env: Any) -> None:
    ray.get(
        math_env.step.remote([conversation("\\boxed{2}")], [{"ground_truth": "2"}]), timeout=RAY_TIMEOUT_S
    )
    start = time.monotonic()
    ret = ray.get(
        math_env.step.remote(
            [conversation(HANGING_ANSWER), conversation("\\boxed{2}")], [{"ground_truth": "2"}] * 2
        ),
        timeout=RAY_TIMEOUT_S,
    )
    assert time.monotonic() - start < 2.0 + 60.0
    assert ret.rewards.tolist() == [0.0, 1.0]
    assert [m["verify_timed_out"] for m in ret.metadata] == [True, False]
    stats = ray.get(math_env.verifier_stats.remote(), timeout=RAY_TIMEOUT_S)
    assert stats["num_timeouts"] >= 1


def test_missing_ground_truth_is_a_clear_error(math_env: Any) -> None:
    with pytest.raises(ray.exceptions.RayTaskError, match="ground_truth"):
        ray.get(math_env.step.remote([conversation("\\boxed{2}")], [{"answer": "2"}]), timeout=RAY_TIMEOUT_S)


def test_math_metrics(math_env: Any) -> None:
    # Two prompts with two samples each: prompt 0 solved once, prompt 1 never.
    batch = BatchedDataDict(
        {
            "total_reward": torch.tensor([1.0, 0.0, 0.0, 0.0]),
            "idx": torch.tensor([0, 0, 1, 1]),
            "message_log": [
                conversation("\\boxed{2}"),
                conversation("no"),
                conversation("\\boxed{7}"),
                conversation("x"),
            ],
            "truncated": torch.tensor([False, False, True, False]),
            "extra_env_info": [{"verify_timed_out": False}] * 3 + [{"verify_timed_out": True}],
        }
    )
    _, metrics = ray.get(math_env.global_post_process_and_metrics.remote(batch), timeout=RAY_TIMEOUT_S)
    assert metrics["accuracy"] == pytest.approx(0.25)
    assert metrics["pass@samples_per_prompt"] == pytest.approx(0.5)
    assert metrics["num_problems_in_batch"] == 2
    assert metrics["mean_response_length_chars"] == pytest.approx((9 + 2 + 9 + 1) / 4)
    assert metrics["correct_response_length_chars"] == pytest.approx(9)
    assert metrics["fraction_of_samples_properly_ended"] == pytest.approx(0.75)
    assert metrics["verify_timeout_fraction"] == pytest.approx(0.25)


def test_dapo_math_verify_scores_answer_lines() -> None:
    # NeMo RL's DAPO recipes: the last "Answer:" line, compared as normalised text, in the environment itself.
    cfg = EnvConfig(math=MathEnvConfig(math_verify_impl="dapo_math_verify"))
    env = create_env("math", cfg, in_driver=True)
    logs = [
        conversation("1 + 1 is two.\nAnswer: 2"),
        conversation("1 + 1 = \\boxed{2}"),  # math-verify reads the box; DAPO's rule needs an Answer: line
        conversation("Answer: 4/2"),  # math-verify would call it 2; DAPO's rule compares text
    ]
    ret = env.step.remote(logs, [{"ground_truth": "2"}] * 3).result()
    assert ret.rewards.tolist() == [1.0, 0.0, 0.0]
    assert ret.answers == ["2", "[INVALID]", "4/2"]
    stats = env.verifier_stats.remote().result()
    assert stats["num_quick_verdicts"] == 3 and stats["num_restarts"] == 0
    env.shutdown.remote().result()
