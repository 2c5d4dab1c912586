"""Environment metrics and validation rollouts, shared by the RL loops (GRPO, distillation).

An environment reports its own metrics (accuracy, pass@k...) over the samples of its task when asked;
:func:`request_environment_metrics` asks without waiting, so the caller can train meanwhile.
:func:`validation_rollouts` rolls out a held-out prompt set once per prompt and gathers its metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.data.collate_fn import IMAGE_KEYS, rl_collate_fn
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.registry import as_env_handle
from nemo_rl.environments.tools import TaskTools
from nemo_rl.experience.rollout_tokens import TOKEN_KEYS
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.models.generation.interfaces import GenerationInterface

ENV_TIMEOUT_S = 600.0
"""Longest wait for the environment actors' start or shutdown (their calls wait
``env.actor_call_timeout_s``)."""


def request_environment_metrics(
    task_to_env: Mapping[str, Any], rollout: BatchedDataDict[Any]
) -> Callable[[], dict[str, float]]:
    """Ask each environment for its own metrics (accuracy, pass@k...) over its samples; the returned function
    waits for them, as ``<task>/<metric>``. The environments compute them while the caller goes on (GRPO
    trains meanwhile)."""
    task_names = list(rollout["task_name"])
    # Environments read the conversations as messages: the token tensors (the largest part with routing
    # replay) and the images stay here.
    scored = BatchedDataDict[Any]({k: v for k, v in rollout.items() if k not in (*TOKEN_KEYS, *IMAGE_KEYS)})
    requests = []
    for task, env in task_to_env.items():
        indices = [i for i, name in enumerate(task_names) if name == task]
        if indices:
            call = as_env_handle(env, task).call(
                "global_post_process_and_metrics", scored.select_indices(indices)
            )
            requests.append((task, call))

    def wait() -> dict[str, float]:
        metrics: dict[str, float] = {}
        for task, call in requests:
            _, task_metrics = call.result()
            metrics.update({f"{task}/{name}": value for name, value in task_metrics.items()})
        return metrics

    return wait


def environment_metrics(task_to_env: Mapping[str, Any], rollout: BatchedDataDict[Any]) -> dict[str, float]:
    """Each environment's own metrics (accuracy, pass@k...) over its samples, as ``<task>/<metric>``."""
    return request_environment_metrics(task_to_env, rollout)()


def validation_rollouts(
    generation: GenerationInterface,
    val_dataset: ProcessedDataset,
    tokenizer: PreTrainedTokenizerBase,
    val_task_to_env: Mapping[str, Any],
    *,
    max_val_samples: int,
    val_batch_size: int,
    max_seq_len: int,
    max_rollout_turns: int,
    greedy: bool,
    task_to_tools: Mapping[str, TaskTools] | None = None,
) -> tuple[dict[str, float], list[str]]:
    """Roll out the first ``max_val_samples`` prompts of ``val_dataset`` once each, in batches of
    ``val_batch_size``; returns the ``validation/`` metrics (accuracy, mean reward and length, the
    environments' own) and the conversations as text with their rewards."""
    start_s = time.perf_counter()
    rewards: list[torch.Tensor] = []
    lengths: list[float] = []
    samples: list[str] = []
    rollouts: list[BatchedDataDict[Any]] = []
    num_samples = min(max_val_samples, len(val_dataset))
    generation.prepare_for_generation()
    for start in range(0, num_samples, val_batch_size):
        batch = rl_collate_fn(
            [val_dataset[i] for i in range(start, min(start + val_batch_size, num_samples))]
        )
        rollout, rollout_metrics = run_multi_turn_rollout(
            generation,
            batch,
            tokenizer,
            val_task_to_env,
            max_seq_len=max_seq_len,
            max_rollout_turns=max_rollout_turns,
            greedy=greedy,
            task_to_tools=task_to_tools,
        )
        rewards.append(rollout["total_reward"])
        rollouts.append(rollout)
        lengths.append(rollout_metrics["mean_gen_tokens_per_sample"] * rollout["total_reward"].numel())
        samples += [
            "".join(m["content"] for m in log) + f"\n[reward {float(r):.1f}]"
            for log, r in zip(rollout["message_log"], rollout["total_reward"], strict=True)
        ]
    generation.finish_generation()
    all_rewards = torch.cat(rewards)
    metrics = {
        "accuracy": float((all_rewards > 0).float().mean()),
        "mean_reward": float(all_rewards.mean()),
        "mean_gen_tokens_per_sample": sum(lengths) / all_rewards.numel(),
        "num_samples": float(all_rewards.numel()),
        "time_s": time.perf_counter() - start_s,
        **environment_metrics(val_task_to_env, BatchedDataDict.from_batches(rollouts)),
    }
    return metrics, samples
