"""A trained reward model as an environment: its reward of each finished conversation is the RL reward.

The environment actor starts the reward model the way a run starts its policy: a
:class:`~nemo_rl.distributed.virtual_cluster.RayVirtualCluster` of ``env.reward_model.resources`` (its own
placement groups: GPUs, or CPU worker slots without CUDA) and a
:class:`~nemo_rl.models.policy.lm_policy.Policy` on it with the scalar head
(``reward_model_cfg.enabled``). Each :meth:`RewardModelEnvironment.step` scores all the conversations it is
given in one call, sharded over the reward model's data-parallel workers, ``batch_size`` conversations per
forward pass.

What the reward model reads: the conversation exactly as the policy's chat template rendered it (the
message log's text, special tokens included), tokenized with the reward model's tokenizer, so the reward
model must have been trained on conversations in the same chat format (as ``examples/run_rm.py`` trains
one from the policy's own checkpoint). Conversations longer than ``max_model_len`` tokens are cut at the end.

Single turn: every response is final. The environment returns no answer text of its own; metrics are the
rewards' mean, standard deviation, min and max.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from nemo_rl.config.env import RewardModelEnvConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    Message,
    check_step_batch,
)
from nemo_rl.environments.metrics import batch_rewards, last_assistant_text
from nemo_rl.models.policy.lm_policy import Policy
from nemo_rl.models.tokenizer import get_tokenizer, require_pad_token_id

RewardMetadata = Any
"""Per-sample state, passed through unchanged (the reward model needs none)."""


def conversation_text(message_log: Sequence[Message]) -> str:
    """The conversation as rendered for the policy: its messages' texts (role headers included), joined."""
    return "".join(str(message["content"]) for message in message_log)


@ray.remote
class RewardModelEnvironment(EnvironmentInterface[RewardMetadata]):
    """Scores conversations with a reward model on its own Ray workers (a Ray actor; see the module docstring).

    Args:
        cfg: The ``env.reward_model`` section (a plain dict in NeMo RL's shape is accepted too).
    """

    def __init__(self, cfg: RewardModelEnvConfig | Mapping[str, Any]) -> None:
        self.cfg = (
            cfg if isinstance(cfg, RewardModelEnvConfig) else RewardModelEnvConfig.model_validate(dict(cfg))
        )
        policy_cfg = self.cfg.policy_config()
        self.tokenizer = get_tokenizer(
            policy_cfg.tokenizer,
            model_name=policy_cfg.model_name,
            trust_remote_code=policy_cfg.trust_remote_code,
        )
        self.pad_token_id = require_pad_token_id(self.tokenizer)
        # One worker group on these bundles: nothing else shares them.
        self.cluster = RayVirtualCluster(
            self.cfg.resources, name="reward_model", max_colocated_worker_groups=1
        )
        try:
            self.reward_model = Policy(
                self.cluster,
                policy_cfg,
                name_prefix="reward_model",
                init_reference_model=False,
                weights_path=self.cfg.checkpoint_path,
            )
        except BaseException:
            self.cluster.shutdown()
            raise

    def score(self, message_log_batch: Sequence[Sequence[Message]]) -> torch.Tensor:
        """[B] float32 reward of each conversation."""
        rows = [
            self.tokenizer(conversation_text(log), add_special_tokens=False)["input_ids"][
                : self.cfg.max_model_len
            ]
            for log in message_log_batch
        ]
        lengths_B = torch.tensor([len(ids) for ids in rows], dtype=torch.long)
        input_ids_BT = torch.full(
            (len(rows), max(1, int(lengths_B.max()))), self.pad_token_id, dtype=torch.long
        )
        for b, ids in enumerate(rows):
            input_ids_BT[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        scores: torch.Tensor = self.reward_model.score(
            BatchedDataDict(input_ids=input_ids_BT, input_lengths=lengths_B)
        )["scores"]
        return scores.float()

    def step(
        self, message_log_batch: Sequence[Sequence[Message]], metadata: Sequence[RewardMetadata]
    ) -> EnvironmentReturn[RewardMetadata]:
        """Reward each conversation with the reward model; every episode ends here."""
        check_step_batch(message_log_batch, metadata)
        if not message_log_batch:
            empty: list[Any] = []
            return EnvironmentReturn(empty, empty, empty, torch.zeros(0), torch.zeros(0, dtype=torch.bool))
        rewards_B = self.score(message_log_batch)
        return EnvironmentReturn(
            observations=[
                {"role": "environment", "content": f"Environment: reward {r:.4f}"} for r in rewards_B.tolist()
            ],
            metadata=list(metadata),
            next_stop_strings=[None] * len(metadata),
            rewards=rewards_B,
            terminateds=torch.ones(len(metadata), dtype=torch.bool),
            answers=[last_assistant_text(log) for log in message_log_batch],
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """Mean, standard deviation, min and max of the rewards (``total_reward`` or ``rewards``) of a batch."""
        rewards_B = batch_rewards(batch)
        if rewards_B.numel() == 0:
            return batch, {"num_samples": 0.0}
        return batch, {
            "mean_reward": rewards_B.mean().item(),
            "std_reward": rewards_B.std(unbiased=False).item(),
            "min_reward": rewards_B.min().item(),
            "max_reward": rewards_B.max().item(),
            "num_samples": float(rewards_B.numel()),
        }

    def shutdown(self) -> None:
        """Stop the reward-model workers and release their placement groups."""
        self.reward_model.shutdown()
        self.cluster.shutdown()
