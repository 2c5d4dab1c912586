"""DPO: direct preference optimisation on (chosen, rejected) response pairs.

Each step takes ``policy.train_global_batch_size`` preference pairs, scores them under the frozen reference
policy (the initial weights, kept by the policy workers) and takes one optimizer step on::

    preference_loss_weight * -log sigmoid(beta * (r(chosen) - r(rejected)))  +  sft_loss_weight * -log pi(chosen)

where r(y) = sum over y's tokens of (log pi - log pi_ref) is a response's implicit reward, beta is
``dpo.reference_policy_kl_penalty``, and ``dpo.preference_average_log_probs`` / ``dpo.sft_average_log_probs``
average over the tokens instead of summing (see :class:`~nemo_rl.algorithms.loss_functions.DPOLossFn`). A
pair's two sequences always share one micro-batch. ``accuracy`` is the fraction of pairs whose chosen response
has the larger implicit reward.

``setup`` builds the run from a :class:`DPOMasterConfig` (resuming from the latest checkpoint when there is
one); ``dpo_train`` runs the loop shared with reward-model training (:mod:`nemo_rl.algorithms.preference`):
validation on held-out pairs, checkpoints, and a Hugging Face export of the final policy.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.loss_functions import DPOLossFn
from nemo_rl.algorithms.preference import PreferenceRun, setup_preference_run, train_on_preferences
from nemo_rl.config.master import DPOMasterConfig
from nemo_rl.data.datasets import ProcessedDataset
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

DPORun = PreferenceRun[DPOMasterConfig]
"""A started DPO run: what ``setup`` returns and ``dpo_train`` runs."""


def setup(
    config: DPOMasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
) -> DPORun:
    """Start Ray and the policy workers (keeping the reference weights), build the loaders of preference
    pairs, and restore the latest checkpoint if any."""
    return setup_preference_run(
        config, config.dpo, tokenizer, train_dataset, val_dataset, name="DPO", keep_reference_model=True
    )


def add_reference_logprobs(run: DPORun, batch: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """``batch`` with ``reference_policy_logprobs`` [B, T]: its tokens' log-probabilities under the initial
    weights, aligned with ``input_ids`` as the loss reads them."""
    batch["reference_policy_logprobs"] = run.policy.get_reference_policy_logprobs(batch)["reference_logprobs"]
    return batch


def dpo_train(run: DPORun) -> dict[str, float]:
    """Run DPO to ``dpo.max_num_steps`` (or ``dpo.max_num_epochs``) and export the final policy; returns the
    last step's ``train/*`` metrics."""
    cfg = run.config.dpo
    return train_on_preferences(
        run,
        cfg,
        DPOLossFn(cfg),
        name="dpo",
        total_steps=run.step_budget(cfg),
        prepare=lambda batch: add_reference_logprobs(run, batch),
    )
