"""Reward-model training: a Bradley-Terry scalar head on preference pairs.

The policy workers load the model with a scalar head instead of the language-model head
(``policy.reward_model_cfg.enabled``: Hugging Face ``AutoModelForSequenceClassification`` with one output,
read at each sequence's last token). Each step takes ``policy.train_global_batch_size`` preference pairs and
one optimizer step on ``-log sigmoid(r(chosen) - r(rejected))`` averaged over the pairs (see
:class:`~nemo_rl.algorithms.loss_functions.PreferenceLoss`); ``accuracy`` is the fraction of pairs whose chosen
response gets the larger reward.

``setup`` builds the run from an :class:`RMMasterConfig` (resuming from the latest checkpoint when there is
one); ``rm_train`` runs the loop shared with DPO (:mod:`nemo_rl.algorithms.preference`): validation on held-out
pairs, checkpoints, and a final export that loads with ``AutoModelForSequenceClassification`` and serves as
the reward of RL through :class:`~nemo_rl.environments.reward_model_environment.RewardModelEnvironment`.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from nemo_rl.algorithms.loop import step_budget
from nemo_rl.algorithms.loss_functions import PreferenceLoss
from nemo_rl.algorithms.preference import PreferenceRun, setup_preference_run, train_on_preferences
from nemo_rl.config.master import RMMasterConfig
from nemo_rl.data.datasets import ProcessedDataset

RMRun = PreferenceRun[RMMasterConfig]
"""A started reward-model run: what ``setup`` returns and ``rm_train`` runs."""


def setup(
    config: RMMasterConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_dataset: ProcessedDataset,
    val_dataset: ProcessedDataset | None,
) -> RMRun:
    """Start Ray and the reward-model workers, build the loaders of preference pairs, and restore the latest
    checkpoint if any."""
    return setup_preference_run(
        config, config.rm, tokenizer, train_dataset, val_dataset, name="RM", keep_reference_model=False
    )


def rm_train(run: RMRun) -> dict[str, float]:
    """Train the reward model to ``rm.max_num_steps`` (every step of ``rm.max_num_epochs`` epochs when it is
    -1) and export it; returns the last step's ``train/*`` metrics."""
    cfg = run.config.rm
    steps_per_epoch = len(run.train_loader)
    max_steps = cfg.max_num_epochs * steps_per_epoch if cfg.max_num_steps == -1 else cfg.max_num_steps
    total_steps = step_budget(max_steps, cfg.max_num_epochs, steps_per_epoch)
    return train_on_preferences(run, cfg, PreferenceLoss(), name="rm", total_steps=total_steps)
