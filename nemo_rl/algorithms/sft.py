"""Supervised fine-tuning: next-token NLL on the assistant turns of conversations.

``setup`` builds the pieces (cluster, policy workers, data loaders, logger, checkpointer), resuming from the
latest complete checkpoint when there is one. ``sft_train`` runs the loop: one optimizer step per global
batch, validation loss every ``sft.val_period`` steps, a checkpoint every ``checkpointing.save_period``
steps (weights, optimizer, scheduler and data-loader position), and a Hugging Face export at the end.
"""

from __future__ import annotations

import math
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.loop import train_metrics
from nemo_rl.algorithms.loss_functions import NLLLoss
from nemo_rl.algorithms.run import Run, SupervisedState
from nemo_rl.algorithms.run_build import RunSpec, build_run
from nemo_rl.config.master import SFTMasterConfig
from nemo_rl.data.collate_fn import make_sft_collate_fn
from nemo_rl.data.datasets import ProcessedDataset

MasterConfig = SFTMasterConfig
"""The config of an SFT run, under NeMo RL's name (``from nemo_rl.algorithms.sft import MasterConfig``)."""


class SFTState(SupervisedState):
    """What a checkpoint records about the SFT loop's progress (steps, epoch, validation loss)."""


SFTRun = Run[SFTMasterConfig, SFTState]
"""A started SFT run: what ``setup`` returns and ``sft_train`` runs."""


def _max_seq_len(cfg: SFTMasterConfig) -> int:
    return cfg.data.max_input_seq_length or cfg.policy.max_total_sequence_length


def setup(
    config: SFTMasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
) -> SFTRun:
    """Start Ray and the policy workers, build the loaders, and restore the latest checkpoint if any."""
    collate_fn = make_sft_collate_fn(tokenizer, _max_seq_len(config))
    spec = RunSpec(
        name="SFT",
        state_cls=SFTState,
        metric_names={"val_loss", "validation/val_loss", "val:val_loss"},
        seed=config.sft.seed,
        batch_size=config.policy.train_global_batch_size,
        batch_size_key="policy.train_global_batch_size",
        collate_fn=collate_fn,
        val_batch_size=config.sft.val_global_batch_size,
    )
    return build_run(config, tokenizer, train_dataset, val_dataset, spec)


def validate(run: SFTRun, loss_fn: NLLLoss, step: int) -> float | None:
    """Mean validation loss over ``sft.val_batches`` batches (all of them when 0); logged at ``step`` and
    kept in ``run.state.val_loss``."""
    if run.val_loader is None:
        return None
    cfg = run.config.sft
    total_loss = 0.0
    total_tokens = 0.0
    # Every validation run reads the same batches from the start of the (unshuffled) validation set.
    run.val_loader.load_state_dict(run.val_loader.state_dict() | {"epoch": 0, "batch_index": 0})
    for batch_index, batch in enumerate(run.val_loader):
        if cfg.val_batches and batch_index >= cfg.val_batches:
            break
        result = run.policy.train(
            batch, loss_fn, eval_mode=True, gbs=batch.size, mbs=min(cfg.val_micro_batch_size, batch.size)
        )
        # Each batch's loss is a token mean; weight batches by their token counts for the overall mean.
        tokens = float(result["global_valid_toks"].sum())
        total_loss += float(result["loss"].sum()) * tokens
        total_tokens += tokens
    val_loss = total_loss / max(total_tokens, 1.0)
    run.logger.log_metrics(
        {"val_loss": val_loss, "num_valid_tokens": total_tokens}, step, prefix="validation"
    )
    run.state.val_loss = val_loss
    return val_loss


def sft_train(run: SFTRun) -> dict[str, float]:
    """Run SFT to ``sft.max_num_steps`` (or ``max_num_epochs``); returns the last step's metrics."""
    cfg = run.config
    loss_fn = NLLLoss()
    last_metrics: dict[str, float] = {}
    loop = run.train_loop("sft", cfg.sft, validate=lambda step: validate(run, loss_fn, step))
    for batch in loop:
        run.state.epoch = run.train_loader.epoch
        with loop.timer.time("policy_training"):
            result = run.policy.train(batch, loss_fn)
        last_metrics = train_metrics(result)
        loop.end_step(last_metrics)

    export_dir = cfg.sft.export_dir or str(Path(cfg.checkpointing.checkpoint_dir) / "hf_final")
    run.policy.export_hf(export_dir)
    print(f"Exported the final model to {export_dir}", flush=True)
    if run.state.val_loss is not None and not math.isnan(run.state.val_loss):
        last_metrics["val_loss"] = run.state.val_loss
    return last_metrics
