"""What DPO and reward-model training share: a run on preference pairs, its loop, validation and export.

A preference batch interleaves pairs (see :func:`nemo_rl.data.collate_fn.preference_collate_fn`): row ``2i``
is pair ``i`` with its chosen response, row ``2i + 1`` with its rejected one. Batch sizes in the config count
pairs, as in NeMo RL (``policy.train_global_batch_size``, ``policy.train_micro_batch_size``,
``<algo>.val_global_batch_size``, ``<algo>.val_micro_batch_size``); the policy sees twice as many rows, and
the losses' ``rows_per_group = 2`` keeps every pair on one data-parallel rank and in one micro-batch.

The two algorithms differ only in the model's head (``policy.reward_model_cfg``), the loss, and DPO's
reference log-probabilities, which it adds to every batch through the ``prepare`` hook of
:func:`train_on_preferences` and :func:`validate`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.interfaces import LossFunction
from nemo_rl.algorithms.loop import train_metrics
from nemo_rl.algorithms.run import Run, SupervisedState
from nemo_rl.algorithms.run_build import RunSpec, build_run
from nemo_rl.config.algorithms import DPOConfig, RMConfig
from nemo_rl.config.master import PreferenceMasterConfig
from nemo_rl.data.collate_fn import make_preference_collate_fn
from nemo_rl.data.datasets import ProcessedDataset, prompt_groups
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

ROWS_PER_PAIR = 2

PrepareBatch = Callable[[BatchedDataDict[Any]], BatchedDataDict[Any]]
"""Completes a preference batch before the policy trains or validates on it (DPO: reference log-probs)."""


def _unchanged(batch: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    return batch


class PreferenceState(SupervisedState):
    """What a checkpoint records about a DPO or reward-model loop's progress (steps, epoch, validation loss)."""


P = TypeVar("P", bound=PreferenceMasterConfig)

PreferenceRun = Run[P, PreferenceState]
"""A started DPO or reward-model run."""


def setup_preference_run(
    config: P,
    loop_cfg: DPOConfig | RMConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
    *,
    name: str,
    keep_reference_model: bool,
) -> PreferenceRun[P]:
    """Start Ray and the policy workers, build the loaders of preference pairs, and restore the latest
    checkpoint if any. ``keep_reference_model`` keeps the initial weights for reference log-probabilities."""
    spec = RunSpec(
        name=name,
        state_cls=PreferenceState,
        metric_names={"val_loss", "val:val_loss", "val:validation-default_loss"},
        seed=loop_cfg.seed,
        batch_size=config.policy.train_global_batch_size,
        batch_size_key="policy.train_global_batch_size",
        collate_fn=make_preference_collate_fn(
            tokenizer, config.data.max_input_seq_length or config.policy.max_total_sequence_length
        ),
        train_groups=(
            prompt_groups(train_dataset, loop_cfg.group_pairs_by_prompt)
            if loop_cfg.group_pairs_by_prompt
            else None
        ),
        val_batch_size=loop_cfg.val_global_batch_size,
        keep_reference_model=keep_reference_model,
    )
    return build_run(config, tokenizer, train_dataset, val_dataset, spec)


def pad_to_whole_pairs_per_rank(batch: BatchedDataDict[Any], dp_size: int) -> BatchedDataDict[Any]:
    """``batch`` with masked copies of its last pair appended until every data-parallel rank gets as many
    whole pairs (a short last validation batch); the copies have ``sample_mask`` 0 and count nowhere."""
    missing = -(batch.size // ROWS_PER_PAIR) % dp_size
    if missing == 0:
        return batch
    padded = batch.select_indices(list(range(batch.size)) + [batch.size - 2, batch.size - 1] * missing)
    sample_mask = padded["sample_mask"].clone()
    sample_mask[batch.size :] = 0.0
    padded["sample_mask"] = sample_mask
    return padded


def validate(
    run: PreferenceRun[P],
    loop_cfg: DPOConfig | RMConfig,
    loss_fn: LossFunction,
    step: int,
    prepare: PrepareBatch = _unchanged,
) -> dict[str, float]:
    """The loss's metrics on up to ``val_batches`` held-out batches (all when 0 or -1), averaged over their
    valid pairs (``num_valid_samples`` is their number); logged as ``validation/*`` at ``step``."""
    if run.val_loader is None:
        return {}
    dp_size = run.policy.dp_size
    totals: dict[str, float] = {}
    num_pairs = 0.0
    # Every validation run reads the same batches from the start of the (unshuffled) validation set.
    run.val_loader.load_state_dict(run.val_loader.state_dict() | {"epoch": 0, "batch_index": 0})
    for batch_index, batch in enumerate(run.val_loader):
        if 0 < loop_cfg.val_batches <= batch_index:
            break
        batch = prepare(pad_to_whole_pairs_per_rank(batch, dp_size))
        pairs_per_rank = batch.size // ROWS_PER_PAIR // dp_size
        result = run.policy.train(
            batch,
            loss_fn,
            eval_mode=True,
            gbs=batch.size,
            mbs=min(loop_cfg.val_micro_batch_size, pairs_per_rank) * ROWS_PER_PAIR,
        )
        # One step: each metric is this batch's mean over its valid pairs; weight batches by their pairs.
        pairs = result["metrics"]["num_valid_samples"][0]
        for name, values in result["metrics"].items():
            if name != "num_valid_samples":
                totals[name] = totals.get(name, 0.0) + values[0] * pairs
        num_pairs += pairs
    metrics = {name: total / max(num_pairs, 1.0) for name, total in totals.items()}
    metrics["num_valid_samples"] = num_pairs
    run.logger.log_metrics(metrics, step, prefix="validation")
    run.state.val_loss = metrics["loss"]
    return metrics


def train_on_preferences(
    run: PreferenceRun[P],
    loop_cfg: DPOConfig | RMConfig,
    loss_fn: LossFunction,
    *,
    name: str,
    total_steps: int,
    prepare: PrepareBatch = _unchanged,
) -> dict[str, float]:
    """The loop: one optimizer step per batch of pairs until ``total_steps``, validating and checkpointing
    as configured; then the final weights are exported in Hugging Face format. Returns the last step's
    ``train/*`` metrics."""
    metrics: dict[str, float] = {}
    loop = run.train_loop(
        name,
        loop_cfg,
        validate=lambda step: validate(run, loop_cfg, loss_fn, step, prepare),
        total_steps=total_steps,
    )
    policy_cfg = run.config.policy
    for batch in loop:
        run.state.epoch = run.train_loader.epoch
        with loop.timer.time("prepare_batch"):
            batch = prepare(batch)
        with loop.timer.time("policy_training"):
            result = run.policy.train(
                batch,
                loss_fn,
                gbs=policy_cfg.train_global_batch_size * ROWS_PER_PAIR,
                mbs=policy_cfg.train_micro_batch_size * ROWS_PER_PAIR,
            )
        metrics = train_metrics(result)
        loop.end_step(metrics)

    export_dir = loop_cfg.export_dir or str(Path(run.config.checkpointing.checkpoint_dir) / "hf_final")
    run.policy.export_hf(export_dir)
    print(f"Exported the final model to {export_dir}", flush=True)
    return metrics
