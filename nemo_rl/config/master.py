"""Master configs: one per algorithm, composing the sections its driver script reads."""

from __future__ import annotations

from pydantic import Field, model_validator

from nemo_rl.config.algorithms import GRPOConfig, SFTConfig
from nemo_rl.config.base import ConfigModel
from nemo_rl.config.checkpointing import CheckpointingConfig
from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.data import DataConfig
from nemo_rl.config.env import EnvConfig
from nemo_rl.config.logger import LoggerConfig
from nemo_rl.config.loss import ClippedPGLossConfig
from nemo_rl.config.policy import PolicyConfig


class SFTMasterConfig(ConfigModel):
    """Everything ``examples/run_sft.py`` reads."""

    sft: SFTConfig = Field(default_factory=SFTConfig)
    """The SFT loop."""

    policy: PolicyConfig
    """The trained model."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation data."""

    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    """Metric logging backends."""

    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    """Checkpoint saving, retention and resume."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Worker slots (GPUs, or CPU slots without CUDA) and nodes."""


class GRPOMasterConfig(ConfigModel):
    """Everything ``examples/run_grpo_math.py`` reads."""

    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    """The GRPO loop."""

    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    """The clipped policy-gradient loss."""

    policy: PolicyConfig
    """The trained model and its generation settings."""

    data: DataConfig = Field(default_factory=DataConfig)
    """Training and validation prompts."""

    env: EnvConfig = Field(default_factory=EnvConfig)
    """Environments that score responses."""

    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    """Metric logging backends."""

    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    """Checkpoint saving, retention and resume."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Worker slots (GPUs, or CPU slots without CUDA) and nodes."""

    @model_validator(mode="after")
    def _check(self) -> GRPOMasterConfig:
        resources = self.policy.generation.colocated.resources
        if not self.policy.generation.colocated.enabled:
            if resources.gpus_per_node is None:
                raise ValueError(
                    "policy.generation.colocated.enabled=false needs "
                    "policy.generation.colocated.resources.gpus_per_node (slots reserved for generation)"
                )
            if (resources.num_nodes or 1) > 1 and self.cluster.num_nodes == 1:
                raise ValueError("non-colocated generation on several nodes needs cluster.num_nodes > 1")
        return self
