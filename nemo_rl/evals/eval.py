"""Evaluation: sample n responses per problem, score them with an environment, report pass@k and cons@k.

What a run computes (see :mod:`nemo_rl.evals.metrics` for the estimators):

1. the benchmark's problems are batched ``generation.num_prompts_per_step`` at a time and each is repeated
   ``eval.num_tests_per_prompt`` (n) times;
2. the generation backend (embedded engine or vLLM, the same factory GRPO uses) samples a response per row,
   from a Hugging Face model or from a training checkpoint's DCP weights loaded into the workers directly;
3. the environment of ``data.env_name`` (from the environment registry) scores every response and extracts
   its answer, through the same rollout function GRPO uses (multi-turn when ``eval.max_rollout_turns > 1``);
4. per problem: pass@k (unbiased estimator), cons@k (majority vote over extracted answers) for k in
   {1, ``eval.k_value``, n}; with ``eval.greedy_accuracy`` one more greedy response per problem;
5. the benchmark metrics are the means over problems with their standard errors, printed, logged as
   ``eval/*`` and written with one JSON line per problem (its responses, answers, rewards, metrics) under
   ``eval.save_path``.

Typical use (what ``examples/run_eval.py`` does)::

    model = resolve_model(config)
    tokenizer = load_eval_tokenizer(config, model)
    dataset = setup_eval_data(config.data, tokenizer, max_total_sequence_length=...)
    components = setup(config, tokenizer, dataset, model)
    try:
        result = run_env_eval(components)
    finally:
        components.shutdown()
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.errors import UserError
from nemo_rl.config.loader import save_config
from nemo_rl.config.master import EvalMasterConfig
from nemo_rl.config.policy import GenerationConfig, PolicyConfig, TokenizerConfig
from nemo_rl.data.collate_fn import IMAGE_KEYS, repeat_prompts, rl_collate_fn
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_start import init_ray
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.environments.registry import EnvHandle, check_task_envs, create_env, registered_envs, stop_envs
from nemo_rl.environments.tools import TaskTools, wire_task_tools
from nemo_rl.evals.metrics import CORRECT_REWARD, mean_and_stderr, metric_ks, problem_metrics, summarize
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.experience.validation import ENV_TIMEOUT_S
from nemo_rl.models.generation.factory import create_generation
from nemo_rl.models.generation.interfaces import GenerationInterface
from nemo_rl.models.policy.dcp_io import (
    TrainingCheckpoint,
    find_training_checkpoint,
    is_dcp_checkpoint,
    load_dcp_model,
)
from nemo_rl.models.tokenizer import get_tokenizer
from nemo_rl.utils.logger import Logger

RESPONSES_FILE = "responses.jsonl"
"""Per-problem results under ``eval.save_path``: one JSON object per line (see :class:`ProblemResult`)."""

METRICS_FILE = "metrics.json"
"""The benchmark metrics under ``eval.save_path``."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What the generation workers load: a Hugging Face model, and a training checkpoint's weights over it."""

    model_name: str
    """The Hugging Face folder or hub name the workers start from (a checkpoint's base model)."""

    checkpoint: TrainingCheckpoint | None = None
    """A training checkpoint whose DCP weights replace the base model's; ``None`` for a Hugging Face model."""


def resolve_model(config: EvalMasterConfig) -> ModelSource:
    """``generation.model_name`` as a :class:`ModelSource`: a training checkpoint (a step folder or its
    ``policy/weights``) starts from its run's base model and loads its own weights; anything else loads as is."""
    name = config.generation.model_name
    path = Path(name).expanduser()
    if is_dcp_checkpoint(path):
        checkpoint = find_training_checkpoint(path)
        return ModelSource(model_name=checkpoint.policy.model_name, checkpoint=checkpoint)
    if not path.exists() and name.startswith(("/", "./", "../", "~")):
        raise UserError(
            f"generation.model_name={name} does not exist: give a model folder, a checkpoint or a hub name"
        )
    if path.exists() and not (path / "config.json").is_file():
        raise UserError(
            f"generation.model_name={name} is neither a Hugging Face model folder (no config.json) nor a "
            "training checkpoint (no policy/weights/.metadata): point it at one of them"
        )
    return ModelSource(model_name=name)


def eval_tokenizer_config(config: EvalMasterConfig, model: ModelSource) -> TokenizerConfig:
    """The ``tokenizer`` section, with ``name: null`` meaning the model's own tokenizer (for a training
    checkpoint, the one its run trained with, and its chat template unless ``tokenizer.chat_template`` is set)."""
    if config.tokenizer.name is not None or model.checkpoint is None:
        return config.tokenizer
    run_tokenizer = model.checkpoint.tokenizer_config
    return TokenizerConfig(
        name=run_tokenizer.name, chat_template=config.tokenizer.chat_template or run_tokenizer.chat_template
    )


def load_eval_tokenizer(config: EvalMasterConfig, model: ModelSource) -> PreTrainedTokenizerBase:
    """The tokenizer the model is evaluated with (see :func:`eval_tokenizer_config`)."""
    return get_tokenizer(
        eval_tokenizer_config(config, model),
        model_name=model.model_name,
        trust_remote_code=config.generation.trust_remote_code,
    )


def generation_policy_config(config: EvalMasterConfig, model: ModelSource) -> PolicyConfig:
    """The ``policy`` section the generation backends take, built from the eval ``generation`` section.

    Temperature 0 (greedy) becomes greedy calls at temperature 1, since the backends sample at a positive
    temperature and decode greedily per call.
    """
    gen = config.generation
    sampling = {name: getattr(gen, name) for name in GenerationConfig.model_fields}
    if gen.temperature == 0.0:
        sampling["temperature"] = 1.0
    return PolicyConfig(
        model_name=model.model_name,
        tokenizer=eval_tokenizer_config(config, model),
        trust_remote_code=gen.trust_remote_code,
        generation_batch_size=gen.generation_batch_size,
        max_total_sequence_length=gen.max_total_sequence_length,
        generation=GenerationConfig(**sampling),
    )


@dataclasses.dataclass
class EvalSetup:
    """Everything :func:`run_env_eval` needs, built by :func:`setup`."""

    config: EvalMasterConfig
    tokenizer: PreTrainedTokenizerBase
    dataset: ProcessedDataset
    model: ModelSource
    cluster: RayVirtualCluster
    generation: GenerationInterface
    task_to_env: dict[str, EnvHandle]
    logger: Logger
    task_to_tools: dict[str, TaskTools]
    """The tools of ``env.<data.env_name>.tools`` (empty: the responses call none)."""

    def shutdown(self) -> None:
        """Stop the generation workers and the environment, flush the loggers, release the placement groups."""
        self.logger.close()
        self.generation.shutdown()
        stop_envs(self.task_to_env.values(), ENV_TIMEOUT_S)
        self.cluster.shutdown()


def load_checkpoint_weights(generation: GenerationInterface, checkpoint: TrainingCheckpoint) -> None:
    """Load a training checkpoint's weights into every generation worker (the base model's are replaced)."""
    model = load_dcp_model(checkpoint)
    expected = generation.expected_weights_manifest()
    generation.update_weights(
        (name, tensor) for name, tensor in model.state_dict().items() if name in expected
    )


def setup(
    config: EvalMasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    dataset: ProcessedDataset,
    model: ModelSource,
) -> EvalSetup:
    """Start Ray, the generation workers (with the checkpoint's weights) and the scoring environment."""
    env_name = config.data.env_name
    if env_name not in registered_envs():
        raise UserError(
            f"data.env_name={env_name} is not a registered environment; registered: {registered_envs()}"
        )
    check_task_envs([env_name], config.env)  # e.g. the code sandbox's isolation, before any worker starts
    tools = wire_task_tools(config.env, (dataset,))
    task_to_tools = {task: task_tools for task, task_tools in tools.items() if task == env_name}
    init_ray(config.cluster)
    cluster = RayVirtualCluster(config.cluster, name="eval", max_colocated_worker_groups=1)
    generation = create_generation(
        cluster, generation_policy_config(config, model), tokenizer, seed=config.eval.seed
    )
    if model.checkpoint is not None:
        load_checkpoint_weights(generation, model.checkpoint)
    task_to_env = {env_name: create_env(env_name, config.env)}
    logger = Logger(config.logger)
    logger.log_hyperparams(config.model_dump(mode="json"))
    return EvalSetup(
        config=config,
        tokenizer=tokenizer,
        dataset=dataset,
        model=model,
        cluster=cluster,
        generation=generation,
        task_to_env=task_to_env,
        logger=logger,
        task_to_tools=task_to_tools,
    )


@dataclasses.dataclass
class ProblemResult:
    """One problem's responses and metrics: a line of ``responses.jsonl``."""

    index: int
    """Position of the problem in the benchmark."""

    prompt: str
    """The prompt as the model saw it (chat template applied)."""

    ground_truth: Any
    """The reference answer the environment checked against."""

    responses: list[str]
    """The n sampled responses (for multi-turn tasks, everything after the prompt)."""

    extracted_answers: list[str | None]
    """The answer the environment extracted from each response (``None``: none)."""

    rewards: list[float]
    """Each response's reward."""

    response_tokens: list[int]
    """Tokens generated for each response."""

    truncated: list[bool]
    """Whether each response hit the length limit."""

    metrics: dict[str, float]
    """This problem's pass@k and cons@k (and ``greedy_accuracy``)."""

    greedy_response: str | None = None
    """The greedy response, with ``eval.greedy_accuracy``."""

    greedy_reward: float | None = None
    """The greedy response's reward, with ``eval.greedy_accuracy``."""


@dataclasses.dataclass
class EvalResult:
    """What :func:`run_env_eval` returns."""

    metrics: dict[str, float]
    """Benchmark metrics (means over problems and ``*_stderr``), as logged under ``eval/``."""

    problems: list[ProblemResult]
    """Per-problem results, in benchmark order."""

    responses_path: Path | None
    """Where the per-problem results were written (``None`` without ``eval.save_path``)."""


def _problem_batches(s: EvalSetup) -> Iterator[BatchedDataDict[Any]]:
    per_step = s.config.generation.num_prompts_per_step
    size = len(s.dataset) if per_step == -1 else per_step
    for start in range(0, len(s.dataset), size):
        yield rl_collate_fn([s.dataset[i] for i in range(start, min(start + size, len(s.dataset)))])


def _rollout(s: EvalSetup, batch: BatchedDataDict[Any], greedy: bool) -> BatchedDataDict[Any]:
    rollout, _ = run_multi_turn_rollout(
        s.generation,
        batch,
        s.tokenizer,
        s.task_to_env,
        max_seq_len=s.config.generation.max_total_sequence_length,
        max_rollout_turns=s.config.eval.max_rollout_turns,
        greedy=greedy,
        task_to_tools=s.task_to_tools,
    )
    return rollout


def _split_conversation(log: list[dict[str, Any]], prompt_turns: int) -> tuple[str, str]:
    """(prompt text, everything after it) of a rolled-out conversation."""
    return (
        "".join(str(m["content"]) for m in log[:prompt_turns]),
        "".join(str(m["content"]) for m in log[prompt_turns:]),
    )


def _problem_results(
    batch: BatchedDataDict[Any],
    rollout: BatchedDataDict[Any],
    greedy: BatchedDataDict[Any] | None,
    n: int,
    ks: list[int],
    first_index: int,
) -> list[ProblemResult]:
    results = []
    for i in range(batch.size):
        rows = range(i * n, (i + 1) * n)
        prompt_turns = len(batch["message_log"][i])
        prompt, _ = _split_conversation(rollout["message_log"][rows[0]], prompt_turns)
        rewards = [float(rollout["total_reward"][r]) for r in rows]
        answers = [rollout["answers"][r] for r in rows]
        metrics = problem_metrics(rewards, answers, ks)
        result = ProblemResult(
            index=first_index + i,
            prompt=prompt,
            ground_truth=(batch["extra_env_info"][i] or {}).get("ground_truth"),
            responses=[_split_conversation(rollout["message_log"][r], prompt_turns)[1] for r in rows],
            extracted_answers=answers,
            rewards=rewards,
            response_tokens=[int(rollout["generated_tokens"][r]) for r in rows],
            truncated=[bool(rollout["truncated"][r]) for r in rows],
            metrics=metrics,
        )
        if greedy is not None:
            result.greedy_response = _split_conversation(greedy["message_log"][i], prompt_turns)[1]
            result.greedy_reward = float(greedy["total_reward"][i])
        results.append(result)
    return results


def _environment_metrics(s: EvalSetup, rollouts: list[BatchedDataDict[Any]]) -> dict[str, float]:
    """The environment's own metrics over every sampled response, as ``<env_name>/<metric>``."""
    env_name = s.config.data.env_name
    metrics: dict[str, float]
    # The environment reads the conversations; a multimodal benchmark's images stay here.
    scored = BatchedDataDict.from_batches(
        [BatchedDataDict({k: v for k, v in r.items() if k not in IMAGE_KEYS}) for r in rollouts]
    )
    _, metrics = s.task_to_env[env_name].call("global_post_process_and_metrics", scored).result()
    return {f"{env_name}/{name}": float(value) for name, value in metrics.items()}


def run_env_eval(s: EvalSetup) -> EvalResult:
    """Generate, score and summarise (see the module docstring); prints, logs and writes the results."""
    cfg = s.config
    n = cfg.eval.num_tests_per_prompt
    ks = metric_ks(cfg.eval.k_value, n)
    greedy_only = cfg.generation.temperature == 0.0
    start_s = time.perf_counter()
    problems: list[ProblemResult] = []
    rollouts: list[BatchedDataDict[Any]] = []
    s.generation.prepare_for_generation()
    for batch in _problem_batches(s):
        rollout = _rollout(s, repeat_prompts(batch, n), greedy=greedy_only)
        greedy = _rollout(s, batch, greedy=True) if cfg.eval.greedy_accuracy and not greedy_only else None
        problems += _problem_results(batch, rollout, greedy, n, ks, first_index=len(problems))
        rollouts.append(rollout)
    s.generation.finish_generation()

    if greedy_only or cfg.eval.greedy_accuracy:
        for problem in problems:
            reward = problem.rewards[0] if greedy_only else problem.greedy_reward
            assert reward is not None
            problem.metrics["greedy_accuracy"] = float(reward >= CORRECT_REWARD)
    metrics = summarize([p.metrics for p in problems])
    tokens = [t for p in problems for t in p.response_tokens]
    metrics["mean_response_tokens"], metrics["mean_response_tokens_stderr"] = mean_and_stderr(
        [sum(p.response_tokens) / n for p in problems]
    )
    metrics["truncation_rate"] = sum(t for p in problems for t in p.truncated) / len(tokens)
    metrics["num_problems"] = float(len(problems))
    metrics["num_tests_per_prompt"] = float(n)
    metrics["score"] = metrics[f"{cfg.eval.metric.removesuffix('@k')}@{cfg.eval.k_value}"]
    metrics.update(_environment_metrics(s, rollouts))
    metrics["time_s"] = time.perf_counter() - start_s

    responses_path = write_results(cfg, problems, metrics) if cfg.eval.save_path is not None else None
    s.logger.log_metrics(metrics, 0, prefix="eval")
    print(format_summary(cfg, s.model, metrics), flush=True)
    return EvalResult(metrics=metrics, problems=problems, responses_path=responses_path)


def write_results(config: EvalMasterConfig, problems: list[ProblemResult], metrics: dict[str, float]) -> Path:
    """Write ``responses.jsonl``, ``metrics.json`` and the resolved ``config.yaml`` under ``eval.save_path``."""
    assert config.eval.save_path is not None
    out = Path(config.eval.save_path)
    out.mkdir(parents=True, exist_ok=True)
    responses_path = out / RESPONSES_FILE
    with responses_path.open("w", encoding="utf-8") as f:
        for problem in problems:
            f.write(json.dumps(dataclasses.asdict(problem), default=_json_default) + "\n")
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    save_config(config, out)
    return responses_path


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def format_summary(config: EvalMasterConfig, model: ModelSource, metrics: dict[str, float]) -> str:
    """The printed result: the model, data and sampling settings, the headline score, every metric ± its
    standard error."""
    gen = config.generation
    evaluated = config.generation.model_name if model.checkpoint is None else f"{gen.model_name} (checkpoint)"
    n = config.eval.num_tests_per_prompt
    rule = "=" * 72
    lines = [
        rule,
        f"model: {evaluated}   data: {config.data.dataset_name} ({int(metrics['num_problems'])} problems)",
        f"backend={gen.backend} temperature={gen.temperature} top_p={gen.top_p} top_k={gen.top_k} "
        f"max_new_tokens={gen.max_new_tokens} seed={config.eval.seed} num_tests_per_prompt={n}",
        f"score ({config.eval.metric.replace('@k', f'@{config.eval.k_value}')}) = {metrics['score']:.4f}",
    ]
    names = [k for k in metrics if f"{k}_stderr" in metrics]
    for name in names:
        lines.append(f"  {name:<24} {metrics[name]:9.4f} ± {metrics[f'{name}_stderr']:.4f}")
    lines.append(f"  {'truncation_rate':<24} {metrics['truncation_rate']:9.4f}")
    lines.append(rule)
    return "\n".join(lines)
