"""Schema of ``policy.dtensor_cfg``: the DTensor (FSDP2 + tensor parallel) policy backend."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel
from nemo_rl.config.lora import LoraConfig
from nemo_rl.config.no_effect import refusal


class VisionFreezeConfig(ConfigModel):
    """Which sub-models of a vision-language model stay frozen (the keys of NeMo RL's Megatron
    ``freeze_config``); each must be false for a text model."""

    freeze_vision_model: bool = False
    """Freeze the vision tower (patch embedding and blocks, not the projection)."""

    freeze_vision_projection: bool = False
    """Freeze the projection from the vision tower into the language model (Qwen's patch merger)."""

    freeze_language_model: bool = False
    """Freeze the language model (embeddings, decoder layers, final norm and head)."""


class DTensorConfig(ConfigModel):
    """The DTensor (FSDP2 + tensor parallel) policy backend."""

    enabled: bool = True
    """Use the DTensor backend for the policy workers."""

    cpu_offload: bool = False
    """Offload parameters and optimizer state to host memory (FSDP2 CPUOffloadPolicy; CUDA only)."""

    sequence_parallel: bool = False
    """Shard activations along the sequence dim between tensor-parallel regions (needs TP > 1)."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass to save memory."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """Tensor-parallel degree; the data-parallel degree is the worker count divided by it."""

    context_parallel_size: int = Field(default=1, ge=1)
    """Context-parallel degree: each sequence is split over this many ranks (2 x CP load-balanced chunks), keys
    and values are exchanged in attention, and FSDP2 shards over data x context parallel ranks; the workers
    divide into ``DP x CP x TP``. Needs ``policy.make_sequence_length_divisible_by`` a multiple of 2 x CP (with
    ``sequence_parallel`` also of CP x TP); see docs/parallelism.md."""

    expert_parallel_size: int = Field(default=1, ge=1)
    """Expert-parallel degree of a mixture-of-experts model (NeMo RL's key); not built on this backend: must be
    1 (FSDP2 shards the experts like any other weight). Expert parallelism belongs to the Megatron backend."""

    custom_parallel_plan: str | None = None
    """Import path of a function ``(model, tp_mesh, sequence_parallel) -> None`` applying a custom TP plan."""

    env_vars: dict[str, str] | None = None
    """Environment variables set in every DTensor worker before the model is built."""

    clear_cache_every_n_steps: int | None = None
    """Accepted, no effect here: emptying the allocator cache is a memory knob."""

    data_parallel_mode: Literal["fsdp", "replicate"] = "fsdp"
    """How data-parallel ranks hold the model: ``fsdp`` shards it with FSDP2; ``replicate`` keeps the whole
    float32 model as a plain module on every rank and sums the gradients of the trained parameters with one
    all-reduce after a step's last micro-batch (DDP's way: faster for small models on CPU; needs TP=1, no CPU
    offload, float32, refused at load otherwise). Checkpoints (model and optimizer) resume in either mode
    whichever wrote them; ``frozen_parameters`` and ``activation_checkpointing`` work in both."""

    dp_replicate_size: Literal[1] | None = None
    """HSDP replica groups; not built here: must be 1 or null (FSDP shards over every data-parallel rank)."""

    automodel_kwargs: dict[str, Any] = Field(default_factory=dict)
    """NeMo Automodel's ``from_pretrained`` arguments; not built here: must be empty (models load with
    ``transformers``)."""

    lora_cfg: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters on the linear layers (``nemo_rl.config.lora``); off by default (full fine-tuning)."""

    freeze_config: VisionFreezeConfig = Field(default_factory=VisionFreezeConfig)
    """Frozen sub-models of a vision-language model (``nemo_rl.models.vlm``): no gradient, no optimizer state,
    exported unchanged."""

    @model_validator(mode="before")
    @classmethod
    def _drop_v2(cls, data: Any) -> Any:
        # NeMo RL's `_v2` picks between two implementations of its DTensor worker; there is one here, and a
        # field cannot start with an underscore, so the key is accepted and dropped (docs/porting.md).
        if isinstance(data, dict) and "_v2" in data:
            data = {k: v for k, v in data.items() if k != "_v2"}
        return data

    @model_validator(mode="after")
    def _refuse_automodel_kwargs(self) -> Self:
        if self.automodel_kwargs:
            raise refusal("policy.dtensor_cfg.automodel_kwargs", "set policy.dtensor_cfg.automodel_kwargs={}")
        if self.expert_parallel_size != 1:
            raise refusal(
                "policy.dtensor_cfg.expert_parallel_size",
                "set it to 1 (FSDP2 shards the experts); expert parallelism is the Megatron backend's "
                "(policy.megatron_cfg.expert_model_parallel_size, docs/algorithms/moe.md)",
            )
        replicate_blockers = (
            self.tensor_parallel_size > 1 or self.context_parallel_size > 1 or self.cpu_offload
        )
        if self.data_parallel_mode == "replicate" and replicate_blockers:
            raise ValueError(
                "policy.dtensor_cfg.data_parallel_mode=replicate needs tensor_parallel_size=1, "
                "context_parallel_size=1 and cpu_offload=false: set policy.dtensor_cfg.data_parallel_mode=fsdp"
            )
        return self
