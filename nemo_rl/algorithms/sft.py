"""Supervised fine-tuning: next-token NLL on the assistant turns of conversations.

``setup`` builds the pieces (cluster, policy workers, data loaders, logger, checkpointer), resuming from the
latest complete checkpoint when there is one. ``sft_train`` runs the loop: one optimizer step per global
batch, validation loss every ``sft.val_period`` steps, a checkpoint every ``checkpointing.save_period``
steps (weights, optimizer, scheduler and data-loader position), and a Hugging Face export at the end.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.loop import train_metrics
from nemo_rl.algorithms.loss_functions import NLLLoss
from nemo_rl.algorithms.run_setup import (
    SupervisedRun,
    SupervisedState,
    make_train_loop,
    save_run_checkpoint,
    start_supervised_run,
)
from nemo_rl.config.master import SFTMasterConfig
from nemo_rl.data.collate_fn import make_sft_collate_fn
from nemo_rl.data.datasets import ProcessedDataset

MasterConfig = SFTMasterConfig
"""The config of an SFT run, under NeMo RL's name (``from nemo_rl.algorithms.sft import MasterConfig``)."""


class SFTState(SupervisedState):
    """What a checkpoint records about the SFT loop's progress (steps, epoch, validation loss)."""


@dataclasses.dataclass(kw_only=True)
class SFTSetup(SupervisedRun):
    """Everything ``sft_train`` needs, built by ``setup``: the run (see :class:`SupervisedRun`) and its loss."""

    config: SFTMasterConfig
    loss_fn: NLLLoss


def _max_seq_len(cfg: SFTMasterConfig) -> int:
    return cfg.data.max_input_seq_length or cfg.policy.max_total_sequence_length


def setup(
    config: SFTMasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
) -> SFTSetup:
    """Start Ray and the policy workers, build the loaders, and restore the latest checkpoint if any."""
    run = start_supervised_run(
        config,
        tokenizer,
        train_dataset,
        val_dataset,
        SFTState,
        name="sft",
        metric_names={"val_loss", "validation/val_loss", "val:val_loss"},
        seed=config.sft.seed,
        val_batch_size=config.sft.val_global_batch_size,
        collate_fn=make_sft_collate_fn(tokenizer, _max_seq_len(config)),
    )
    return SFTSetup(**run.run_fields(), config=config, loss_fn=NLLLoss())


def validate(s: SFTSetup, step: int) -> float | None:
    """Mean validation loss over ``sft.val_batches`` batches (all of them when 0); logged at ``step`` and
    kept in ``s.state.val_loss``."""
    if s.val_loader is None:
        return None
    cfg = s.config.sft
    total_loss = 0.0
    total_tokens = 0.0
    # Every validation run reads the same batches from the start of the (unshuffled) validation set.
    s.val_loader.load_state_dict(s.val_loader.state_dict() | {"epoch": 0, "batch_index": 0})
    for batch_index, batch in enumerate(s.val_loader):
        if cfg.val_batches and batch_index >= cfg.val_batches:
            break
        result = s.policy.train(
            batch, s.loss_fn, eval_mode=True, gbs=batch.size, mbs=min(cfg.val_micro_batch_size, batch.size)
        )
        # Each batch's loss is a token mean; weight batches by their token counts for the overall mean.
        tokens = float(result["global_valid_toks"].sum())
        total_loss += float(result["loss"].sum()) * tokens
        total_tokens += tokens
    val_loss = total_loss / max(total_tokens, 1.0)
    s.logger.log_metrics({"val_loss": val_loss, "num_valid_tokens": total_tokens}, step, prefix="validation")
    s.state.val_loss = val_loss
    return val_loss


def save_checkpoint(s: SFTSetup) -> Path:
    """Write the policy, optimizer, scheduler, loader position and loop state as ``step_<N>`` (atomically)."""
    return save_run_checkpoint(s, s.state.val_loss)


def sft_train(s: SFTSetup) -> dict[str, float]:
    """Run SFT to ``sft.max_num_steps`` (or ``max_num_epochs``); returns the last step's metrics."""
    cfg = s.config
    last_metrics: dict[str, float] = {}
    loop = make_train_loop(
        "sft", s, cfg.sft, save_checkpoint=lambda: save_checkpoint(s), validate=lambda step: validate(s, step)
    )
    for batch in loop:
        s.state.epoch = s.train_loader.epoch
        with loop.timer.time("policy_training"):
            result = s.policy.train(batch, s.loss_fn)
        last_metrics = train_metrics(result)
        loop.end_step(last_metrics)

    export_dir = cfg.sft.export_dir or str(Path(cfg.checkpointing.checkpoint_dir) / "hf_final")
    s.policy.export_hf(export_dir)
    print(f"Exported the final model to {export_dir}", flush=True)
    if s.state.val_loss is not None and not math.isnan(s.state.val_loss):
        last_metrics["val_loss"] = s.state.val_loss
    return last_metrics
