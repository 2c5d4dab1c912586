"""The mixture-of-experts keys of ``policy.megatron_cfg`` (NeMo RL's names), a base of ``MegatronConfig``.

Built here: expert parallelism (``expert_model_parallel_size``, experts not split further:
``expert_tensor_parallel_size`` 1), the router's top-k (checked against the checkpoint), its dtype, the token
dispatcher (``alltoall`` or ``allgather``), ``freeze_moe_router``, the expert-bias update rate and
megatron-core's ``aux_loss`` load-balancing loss. ``transformers``' load-balancing loss, the DTensor backend's,
is switched on by ``policy.hf_config_overrides`` (``output_router_logits`` / ``router_aux_loss_coef``) on both
backends; docs/algorithms/moe.md gives both formulas. Pure speed knobs (fused permutation, DeepEP, grouped
GEMM...) are accepted with no effect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from nemo_rl.config.base import ConfigModel

MoeRouterDtype = Literal["fp32", "fp64"]
MoeDispatcher = Literal["alltoall", "allgather", "flex"]
MoeBalancing = Literal["none", "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn"]


class MegatronMoeKeys(ConfigModel):
    """NeMo RL's mixture-of-experts keys of ``megatron_cfg``; they matter only for a MoE checkpoint."""

    expert_model_parallel_size: int = Field(default=1, ge=1)
    """Expert-parallel degree (EP): each MoE layer's routed experts are split over EP ranks, each rank holding
    ``num_experts / EP`` whole experts; tokens travel to their experts with the token dispatcher. EP > 1 needs
    ``tensor_model_parallel_size`` and ``pipeline_model_parallel_size`` 1 and must divide the expert count
    and the worker count."""

    expert_tensor_parallel_size: int | None = Field(default=1, ge=1)
    """Tensor-parallel degree inside each expert; must be 1 (whole experts per rank) or null (which means the
    attention's TP size, so 1 as well)."""

    moe_router_topk: int | None = Field(default=None, ge=1)
    """Experts each token is routed to; ``None`` takes the checkpoint's ``num_experts_per_tok``, any other
    value must equal it (the generation engines route as the checkpoint says)."""

    moe_router_dtype: MoeRouterDtype | None = None
    """Dtype of the router's logits and routing weights (``fp64`` in NeMo RL's RL recipes); ``None`` computes
    them in the training dtype."""

    moe_token_dispatcher_type: MoeDispatcher | None = None
    """How tokens reach the experts of other expert-parallel ranks: ``alltoall`` (each rank sends its tokens
    to their experts' ranks) or ``allgather`` (every rank gathers all tokens and keeps its experts' share);
    ``None`` means ``alltoall``. ``flex`` (DeepEP / HybridEP kernels) is not built here."""

    freeze_moe_router: bool = False
    """Keep the routers' weights fixed during training (NeMo RL's RL recipes set true, so the routing the
    generation engine samples with stays the one trained on). Nothing to freeze in a dense model."""

    moe_router_load_balancing_type: MoeBalancing | None = None
    """Megatron-core's load-balancing loss: ``aux_loss`` trains megatron-core's per-layer switch loss times
    ``moe_aux_loss_coeff`` (docs/algorithms/moe.md gives its formula next to ``transformers``'); ``none`` /
    null trains none of Megatron's (``transformers``' may still be on, through ``policy.hf_config_overrides``).
    ``seq_aux_loss``, ``global_aux_loss`` and ``sinkhorn`` are not built."""

    moe_aux_loss_coeff: float | None = Field(default=None, ge=0.0)
    """Coefficient of the ``aux_loss`` load-balancing loss; ``None`` takes the checkpoint's
    ``router_aux_loss_coef`` (0 when it has none), as megatron-bridge's converters do."""

    moe_router_bias_update_rate: float | None = Field(default=None, ge=0.0)
    """Step of megatron-core's aux-loss-free balancing: after each optimizer step a sigmoid router's expert
    bias (GLM-4-MoE's ``e_score_correction_bias``) moves by this much towards less-loaded experts. ``None``
    means 0 (the checkpoint's bias is kept, as on the DTensor backend; NeMo RL's RL recipes set 0). A softmax
    router (Qwen3-MoE) has no bias to move."""

    moe_router_enable_expert_bias: bool | None = None
    """Accepted, no effect here: whether a router has an expert bias follows the checkpoint."""

    moe_permute_fusion: bool = False
    """Accepted, no effect here (a fused-kernel speed knob)."""

    moe_enable_deepep: bool = False
    """Accepted, no effect here (DeepEP's CUDA dispatch kernels; the dispatcher follows
    ``moe_token_dispatcher_type``)."""

    inference_moe_token_dispatcher_type: str | None = None
    """Accepted, no effect here (Megatron's own inference engine is not used)."""

    inference_grouped_gemm_backend: str | None = None
    """Accepted, no effect here (Megatron's own inference engine is not used)."""

    moe_router_num_groups: int | None = None
    """Accepted, no effect here: expert groups follow the checkpoint."""

    moe_router_group_topk: int | None = None
    """Accepted, no effect here: expert groups follow the checkpoint."""

    moe_pad_experts_for_cuda_graph_inference: bool | None = None
    """Accepted, no effect here (CUDA graphs are not captured)."""

    moe_shared_expert_overlap: bool = False
    """Accepted, no effect here (a communication-overlap speed knob)."""

    moe_grouped_gemm: bool | None = None
    """Accepted, no effect here: experts run one after another (megatron-core's ``SequentialMLP``; its grouped
    GEMM needs CUDA kernels), which computes the same values."""

    moe_flex_dispatcher_backend: str | None = None
    """Accepted, no effect here (see ``moe_enable_deepep``)."""

    moe_hybridep_num_sms: int | None = None
    """Accepted, no effect here (see ``moe_enable_deepep``)."""

    hybridep_num_ranks_per_nvlink_domain: int | None = None
    """Accepted, no effect here (see ``moe_enable_deepep``)."""

    hybridep_use_mnnvl: bool | None = None
    """Accepted, no effect here (see ``moe_enable_deepep``)."""

    moe_per_layer_logging: bool = False
    """Accepted, no effect here: the routing metrics are always logged per MoE layer (``train/moe_*``)."""

    track_moe_metrics: bool | None = None
    """Accepted, no effect here: a MoE policy always logs its routing metrics (``train/moe_*``)."""

    def moe_unbuilt_settings(
        self, tensor_parallel: int, pipeline_parallel: int
    ) -> list[tuple[str, bool, str]]:
        """``(key, set to an unbuilt value, what to set)`` for the MoE keys (see ``MegatronConfig``)."""
        ep = self.expert_model_parallel_size
        return [
            (
                "expert_model_parallel_size",
                ep > 1 and (tensor_parallel > 1 or pipeline_parallel > 1),
                "expert parallelism is built with tensor_model_parallel_size=1 and pipeline_model_parallel_size=1 "
                "(Megatron's expert and dense rank grids disagree on pipeline stages when data parallelism is the "
                "outer dimension); set those to 1 or expert_model_parallel_size=1",
            ),
            (
                "expert_tensor_parallel_size",
                self.expert_tensor_parallel_size not in (None, 1),
                "experts are not split by tensor parallelism here; set expert_tensor_parallel_size=1",
            ),
            (
                "moe_token_dispatcher_type",
                self.moe_token_dispatcher_type == "flex",
                "the flex dispatcher needs DeepEP / HybridEP CUDA kernels; set alltoall or allgather",
            ),
            (
                "moe_router_load_balancing_type",
                self.moe_router_load_balancing_type not in (None, "none", "aux_loss"),
                "set aux_loss (megatron-core's switch loss) or none; transformers' loss, the DTensor backend's, is "
                "policy.hf_config_overrides.output_router_logits=true with router_aux_loss_coef=<coefficient>",
            ),
        ]

    def check_moe_checkpoint(
        self, hf_config: Mapping[str, Any] | None, tensor_parallel: int, pipeline_parallel: int, lora: bool
    ) -> None:
        """Check the MoE keys against a local checkpoint's ``config.json`` (with the config overrides);
        nothing to check for a hub name (``hf_config`` None), which the worker checks when it loads it."""
        if hf_config is None:
            return
        num_experts = checkpoint_num_experts(hf_config)
        ep = self.expert_model_parallel_size
        if num_experts == 0:
            if ep != 1:
                raise ValueError(
                    f"policy.megatron_cfg.expert_model_parallel_size={ep}, but the model is dense (no experts to "
                    "split): set expert_model_parallel_size=1"
                )
            return
        if tensor_parallel > 1 or pipeline_parallel > 1:
            raise ValueError(
                f"policy.megatron_cfg.tensor_model_parallel_size={tensor_parallel} / pipeline_model_parallel_size="
                f"{pipeline_parallel}: mixture-of-experts models train on the Megatron backend with TP=1 and PP=1 "
                "(split them with expert_model_parallel_size and data parallelism)"
            )
        if lora:
            raise ValueError(
                "policy.megatron_cfg.peft.enabled=true: LoRA on the Megatron backend adapts dense models only; "
                "set peft.enabled=false for this mixture-of-experts model"
            )
        if num_experts % ep:
            raise ValueError(
                f"policy.megatron_cfg.expert_model_parallel_size={ep} does not divide the model's {num_experts} "
                "experts: choose a divisor of the expert count"
            )
        if self.moe_router_load_balancing_type == "aux_loss" and hf_config.get("output_router_logits"):
            raise ValueError(
                "policy.megatron_cfg.moe_router_load_balancing_type=aux_loss and policy.hf_config_overrides."
                "output_router_logits=true would train two load-balancing losses: keep one"
            )
        top_k = hf_config.get("num_experts_per_tok")
        if self.moe_router_topk is not None and self.moe_router_topk != top_k:
            raise ValueError(
                f"policy.megatron_cfg.moe_router_topk={self.moe_router_topk} differs from the checkpoint's "
                f"num_experts_per_tok={top_k}: set moe_router_topk=null (or {top_k})"
            )


def checkpoint_num_experts(hf_config: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer of a Hugging Face ``config.json`` (0 for a dense model)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = hf_config.get(key)
        if value:
            return int(value)
    return 0
