"""Sections of NeMo RL's recipes for machinery this project does not build, so that those recipes load.

Each section accepts NeMo RL's keys with NeMo RL's defaults. A section that selects unbuilt behaviour is
refused unless neutral (``enabled: false``...), with one line naming the key; the keys below a disabled
section are unused. Sections that only tune speed or memory are accepted with no effect here (the field
holding them says so; see :mod:`nemo_rl.config.no_effect`). ``docs/porting.md`` lists them all.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.no_effect import refusal as refuse


class _Switchable(ConfigModel):
    """A NeMo RL feature section with an ``enabled`` switch that must stay off here."""

    enabled: bool = False
    """Turn the feature on; not built here: must be false (the other keys are then unused)."""

    KEY: ClassVar[str] = ""
    """Dotted key of the section, for the error message."""

    @model_validator(mode="after")
    def _refuse_enabled(self) -> Self:
        if self.enabled:
            raise refuse(f"{self.KEY}.enabled", f"set {self.KEY}.enabled=false")
        return self


class SequencePackingConfig(ConfigModel):
    """NeMo RL's ``policy.sequence_packing``: several sequences packed into one row of a micro-batch.

    Built on the DTensor backend (see ``PolicyConfig.packs_sequences``): each micro-batch's rows run as one
    row whose position ids restart at every sequence, so attention stays within each sequence and no compute
    goes to padding; the logits (a value model's per-token head) are unpacked to ``[B, T, V]`` (``[B, T]``)
    before the loss, so every loss works unchanged. The Megatron backend, sequence parallelism and
    Bradley-Terry reward models pad instead, and report ``enabled`` as having no effect (at start and under
    ``--dry-run``)."""

    enabled: bool = False
    """Pack training and log-prob micro-batches (exclusive with ``policy.dynamic_batching``)."""

    train_mb_tokens: int | None = Field(default=None, ge=1)
    """Token budget of one packed training micro-batch (a longer sequence is packed alone); ``None``:
    ``max_total_sequence_length x train_micro_batch_size``, NeMo RL's recipe value."""

    logprob_mb_tokens: int | None = Field(default=None, ge=1)
    """Token budget of one packed log-prob micro-batch; ``None``: ``max_total_sequence_length x
    logprob_batch_size`` (or ``train_micro_batch_size`` when that is unset)."""

    algorithm: Literal[
        "modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle", "concatenative"
    ] = "modified_first_fit_decreasing"
    """How sequences go into packs: ``concatenative`` in order, a new pack when the next one does not fit;
    NeMo RL's other names all pack first-fit decreasing here (longest first, each into the first pack with
    room). The algorithm decides only how many packs there are, never the loss or the log-probs."""

    microbatch_order: str | None = None
    """Accepted, no effect here: packs run in the order they are made."""

    sequence_length_round: int = Field(default=64, ge=1)
    """Each pack's length is rounded up to a multiple of this."""


class AdvantageEstimatorConfig(ConfigModel):
    """NeMo RL's ``grpo.adv_estimator``: which advantage estimator; GRPO's is the one built here."""

    name: str = "grpo"
    """``grpo`` (group-relative, the one built here); ``reinforce_plus_plus`` is not built."""

    normalize_rewards: bool | None = None
    """Must equal ``grpo.normalize_rewards`` (NeMo RL's recipes interpolate it); ``None`` follows it."""

    use_leave_one_out_baseline: bool | None = None
    """Must equal ``grpo.use_leave_one_out_baseline``; ``None`` follows it."""

    minus_baseline: bool = True
    """Accepted, no effect here: a Reinforce++ option (``name`` must be ``grpo``)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.name != "grpo":
            raise refuse("grpo.adv_estimator.name", "set grpo.adv_estimator.name=grpo")
        return self


class RewardPenaltiesConfig(ConfigModel):
    """NeMo RL's ``reward_penalties`` (reward zeroing for NeMo-Gym rollouts); not built here."""

    penalize_duplicated_reasoning: bool = False
    """Not built here: must be false."""

    penalize_empty_final_answer: bool = False
    """Not built here: must be false."""

    penalize_unwanted_tokens: bool = False
    """Not built here: must be false."""

    penalize_malformed_think_tag: bool = False
    """Not built here: must be false."""

    token_ids: dict[str, Any] | None = None
    """Token ids the penalties look for (unused while every penalty is off)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        for name in type(self).model_fields:
            if name.startswith("penalize_") and getattr(self, name):
                raise refuse(f"reward_penalties.{name}", f"set reward_penalties.{name}=false")
        return self


class DataPlaneConfig(_Switchable):
    """NeMo RL's ``data_plane`` (a TransferQueue data plane); not built here."""

    KEY: ClassVar[str] = "data_plane"

    impl: str = "transfer_queue"
    """Implementation (unused while ``enabled`` is false)."""

    backend: str = "simple"
    """Storage backend (unused while ``enabled`` is false)."""

    storage_capacity: int = 1_000_000
    """Samples per partition (unused while ``enabled`` is false)."""

    num_storage_units: int = 2
    """Storage shards (unused while ``enabled`` is false)."""

    claim_meta_poll_interval_s: float = 0.5
    """Poll period (unused while ``enabled`` is false)."""

    global_segment_size: int = 549_755_813_888
    """Mooncake segment bytes (unused while ``enabled`` is false)."""

    local_buffer_size: int = 68_719_476_736
    """Mooncake buffer bytes (unused while ``enabled`` is false)."""

    observability: dict[str, Any] | None = None
    """Observability settings (unused while ``enabled`` is false)."""
