"""On-policy distillation: the student samples, a frozen teacher scores every sampled token.

Each step:

1. take ``distillation.num_prompts_per_step`` prompts and repeat each ``num_generations_per_prompt`` times;
2. refit the student's generation workers if the student changed since they were last updated (every step);
3. roll out: the student samples responses; the environments score them (logged, not trained on);
4. the teacher (its own workers, on the student's slots) returns its ``distillation.topk_logits_k`` largest
   next-token logits at every position of the sampled conversations;
5. one or more optimizer steps on the student with :class:`DistillationLossFn`: the forward, reverse or
   mixed KL between teacher and student on the teacher's top-k tokens, averaged over the response tokens;
6. log, validate and checkpoint when due (the shared :class:`~nemo_rl.algorithms.loop.TrainLoop`).

Unlike GRPO there is no reward in the loss, no group baseline and no importance ratio: the student learns
what the teacher would have said at each token of the student's own samples, so the training signal is
dense (every token) and on the student's distribution (no exposure bias, as in off-policy distillation).

``setup`` builds every piece from a :class:`DistillationMasterConfig` (resuming the student from the latest
checkpoint when there is one) and ``distillation_train`` runs the loop.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.loop import train_metrics
from nemo_rl.algorithms.loss_functions import DistillationLossFn
from nemo_rl.algorithms.run import RLState, Run
from nemo_rl.algorithms.run_build import ExtraPolicy, RunSpec, SamplingSpec, build_run
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import DistillationMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.train_batch import train_batch
from nemo_rl.models.hf_config import load_hf_config
from nemo_rl.models.tokenizer import get_policy_tokenizer
from nemo_rl.utils.timer import Timer

MasterConfig = DistillationMasterConfig
"""The config of a distillation run, under NeMo RL's name."""

_TRAIN_ROLES = ("assistant",)
TEACHER = "teacher"
"""The teacher's key in ``Run.models``."""


class DistillationState(RLState):
    """What a checkpoint records about the distillation loop's progress (steps, response tokens trained on,
    the student's validation accuracy)."""


DistillationRun = Run[DistillationMasterConfig, DistillationState]
"""A started distillation run: the trained ``policy`` is the student, ``models["teacher"]`` the teacher."""


def check_teacher_matches_student(
    student: PolicyConfig, teacher: PolicyConfig, tokenizer: PreTrainedTokenizerBase, topk_logits_k: int
) -> None:
    """The teacher's top-k token ids index the student's logits, so both need one vocabulary: the same
    token -> id mapping and the same logits width; and k cannot exceed it."""
    teacher_tokenizer = get_policy_tokenizer(teacher)
    if tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        raise UserError(
            f"the teacher's tokenizer ({teacher.tokenizer.name or teacher.model_name}) maps tokens to ids "
            f"differently from the student's ({student.tokenizer.name or student.model_name}): on-policy "
            "distillation needs a teacher and student with the same tokenizer"
        )
    # As the workers build them: each side's hf_config_overrides applied.
    sizes = {
        who: load_hf_config(
            cfg.model_name, trust_remote_code=cfg.trust_remote_code, overrides=cfg.hf_config_overrides
        ).vocab_size
        for who, cfg in (("policy", student), ("teacher", teacher))
    }
    if sizes["policy"] != sizes["teacher"]:
        raise UserError(
            f"the student's model has {sizes['policy']} output logits and the teacher's {sizes['teacher']} "
            f"({student.model_name} vs {teacher.model_name}): pick models with the same vocabulary size"
        )
    if topk_logits_k > sizes["teacher"]:
        raise UserError(
            f"distillation.topk_logits_k={topk_logits_k} exceeds the vocabulary size ({sizes['teacher']}); "
            f"set it to at most {sizes['teacher']}"
        )


def setup(
    config: DistillationMasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
) -> DistillationRun:
    """Start Ray, the student (policy and generation), the teacher and the environments; restore the latest
    checkpoint if any.

    The teacher runs on its own workers on the student's policy slots, like a reference model, and keeps its
    weights off the device except while scoring. Environments: one per task (``task_name``) of the data, the
    one registered under the task's name (``nemo_rl.environments.registry.register_env``), configured by
    ``env.<task>``.
    """
    cfg = config.distillation
    # Input checks that need no workers, before Ray starts (the teacher's layout: build_run's).
    check_teacher_matches_student(config.policy, config.teacher, tokenizer, cfg.topk_logits_k)
    spec = RunSpec.sampling_loop(
        "distillation",
        DistillationState,
        SamplingSpec(env=config.env),
        section="distillation",
        seed=cfg.seed,
        num_prompts=cfg.num_prompts_per_step,
        models=[ExtraPolicy(config.teacher, name=TEACHER)],
    )
    return build_run(config, tokenizer, train_dataset, val_dataset, spec)


def teacher_topk(run: DistillationRun, train_data: BatchedDataDict[Any]) -> None:
    """Add the teacher's ``teacher_topk_logits`` / ``teacher_topk_indices`` [B, T, k] to ``train_data``."""
    teacher = run.models[TEACHER]
    teacher.prepare_for_lp_inference()
    topk = teacher.get_topk_logits(train_data, run.config.distillation.topk_logits_k)
    teacher.offload_after_refit()
    train_data["teacher_topk_logits"] = topk["topk_logits"]
    train_data["teacher_topk_indices"] = topk["topk_indices"]


def distillation_step(
    run: DistillationRun, batch: BatchedDataDict[Any], timer: Timer, loss_fn: DistillationLossFn
) -> dict[str, float]:
    """One distillation step on a batch of prompts; returns its ``train/`` metrics."""
    run.refit_if_stale(timer)
    rollout, rollout_metrics, env_metrics = run.sample(batch, run.config.distillation, timer)
    run.rl.generation.finish_generation()
    rollout_metrics.update(env_metrics())

    # Prompts cut to fit the sequence budget have a loss multiplier of 0.
    train_data = train_batch(rollout, int(run.tokenizer.pad_token_id), overlong_filtering=False)
    with timer.time("teacher_topk_logits"):
        teacher_topk(run, train_data)
    with timer.time("policy_training"):
        run.policy.prepare_for_training()
        train_result = run.policy.train(train_data, loss_fn)
    run.mark_trained()
    run.state.total_valid_tokens += float(train_result["global_valid_toks"].sum())
    return train_metrics(train_result, {"reward": float(rollout["total_reward"].mean()), **rollout_metrics})


def distillation_train(run: DistillationRun) -> dict[str, float]:
    """Run distillation to ``distillation.max_num_steps`` (or ``max_num_epochs``); returns the last step's
    metrics."""
    cfg = run.config.distillation
    loss_fn = DistillationLossFn(run.config.loss_fn)
    metrics: dict[str, float] = {}
    loop = run.train_loop(
        "distillation", cfg, validate=lambda step: run.validate_by_sampling(step, cfg, greedy=False)
    )
    for batch in loop:
        metrics = distillation_step(run, batch, loop.timer, loss_fn)
        loop.end_step(metrics, num_tokens=metrics["mean_conversation_tokens"] * cfg.samples_per_step)
    return metrics
