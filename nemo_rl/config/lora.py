"""Schema of LoRA adapters: NeMo RL's ``policy.dtensor_cfg.lora_cfg`` and ``policy.megatron_cfg.peft``.

With ``enabled`` the base model's weights are frozen and every chosen linear layer ``y = x W^T + b`` gains a
low-rank update ``(alpha / dim) * B A x`` whose ``A`` ([dim, in]) and ``B`` ([out, dim]) are the only trained
parameters (``nemo_rl.models.lora`` builds them). ``docs/algorithms/lora.md`` covers the whole feature.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel

VLLM_MAX_LORA_RANK = 512
"""The largest ``max_lora_rank`` vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``)."""


class LoraConfig(ConfigModel):
    """LoRA adapters on the policy's linear layers (NeMo RL's ``policy.dtensor_cfg.lora_cfg``)."""

    enabled: bool = False
    """Train LoRA adapters instead of the whole model: the base weights are frozen (no gradients, no optimizer
    state), the reference policy of GRPO's KL and of DPO is the base model with the adapters switched off, and
    each refit sends only the adapters to the generation engine after the first."""

    target_modules: list[str] = Field(default_factory=list)
    """Linear layers to adapt when ``match_all_linear`` is false: a layer's last name (``q_proj``) or a glob
    over its full module path (``*.layers.0.*.q_proj``)."""

    exclude_modules: list[str] = Field(default_factory=list)
    """Linear layers never to adapt, named like ``target_modules`` (applied after it)."""

    match_all_linear: bool = True
    """Adapt every linear layer of the decoder (all of q/k/v/o and gate/up/down on Llama-like models); the
    output head is never adapted. Overrides ``target_modules``."""

    dim: int = Field(default=8, ge=1)
    """The adapters' rank ``r``."""

    alpha: float = Field(default=32, gt=0)
    """Scaling numerator: the update is multiplied by ``alpha / dim``."""

    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout probability on the adapter path during training (never while scoring or generating)."""

    dropout_position: Literal["pre", "post"] = "post"
    """``pre``: dropout on the adapter's input ``x`` (PEFT's placement); ``post``: on its output ``B A x``."""

    lora_A_init: Literal["xavier", "uniform"] = "xavier"
    """How ``A`` starts: ``xavier`` (Glorot normal) or ``uniform`` (Kaiming uniform with ``a = sqrt(5)``, as
    ``nn.Linear`` initialises). ``B`` always starts at zero, so a fresh adapter leaves the model unchanged."""

    use_triton: bool = True
    """Accepted, no effect here: the adapter runs as two plain matmuls (Triton kernels are CUDA-only)."""

    @model_validator(mode="after")
    def _check_targets(self) -> Self:
        if self.enabled and not self.match_all_linear and not self.target_modules:
            raise ValueError(
                "policy.dtensor_cfg.lora_cfg.target_modules is empty and match_all_linear is false, so no layer "
                "would be adapted: name the layers (e.g. [q_proj, v_proj]) or set match_all_linear=true"
            )
        return self


def _matches(module_name: str, patterns: Iterable[str]) -> bool:
    leaf = module_name.rsplit(".", 1)[-1]
    return any(pattern == leaf or fnmatch.fnmatchcase(module_name, pattern) for pattern in patterns)


def select_lora_targets(linears: list[str], cfg: LoraConfig) -> list[str]:
    """The names among ``linears`` (a model's adaptable linear layers, in module order) that ``cfg`` adapts;
    raises ``ValueError`` when there are none. The policy's workers, the generation engines and the check
    before Ray starts (:mod:`nemo_rl.config.lora_targets`) all call it."""
    chosen = linears if cfg.match_all_linear else [n for n in linears if _matches(n, cfg.target_modules)]
    chosen = [name for name in chosen if not _matches(name, cfg.exclude_modules)]
    if not chosen:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linears})
        raise ValueError(
            f"policy.dtensor_cfg.lora_cfg selects no linear layer of the model (target_modules="
            f"{cfg.target_modules}, exclude_modules={cfg.exclude_modules}); its linear layers are named {leaves}"
        )
    return chosen


MEGATRON_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Names of the adaptable linear layers of a Megatron decoder layer (NeMo RL's ``peft.target_modules``)."""


class MegatronPeftConfig(ConfigModel):
    """LoRA adapters on the Megatron model (NeMo RL's ``policy.megatron_cfg.peft``).

    Each adapted Megatron layer carries the adapters of the Hugging Face layers it fuses, exactly as
    ``policy.dtensor_cfg.lora_cfg`` adapts them: ``linear_qkv`` one each for ``q_proj``, ``k_proj`` and
    ``v_proj``, ``linear_proj`` one for ``o_proj``, ``linear_fc1`` one each for ``gate_proj`` and ``up_proj``,
    ``linear_fc2`` one for ``down_proj`` (``nemo_rl.models.megatron.lora``). So checkpoints, refits and exports
    use the Hugging Face adapter names, and both backends compute the same model.
    """

    enabled: bool = False
    """Train LoRA adapters instead of the whole model: the base weights are frozen (no gradients, no optimizer
    state), the reference policy of GRPO's KL and of DPO is the base model with the adapters switched off,
    checkpoints hold the adapters only, and refits and exports send the merged weights ``W + (alpha/dim) B A``.
    The adapted layers are megatron-core's local layers (Transformer Engine fuses the norm into ``linear_qkv``
    and ``linear_fc1``, hiding the normalised input the adapters need)."""

    target_modules: list[str] = Field(default_factory=list)
    """Layers to adapt: a name of :data:`MEGATRON_LINEARS` (every layer's ``linear_qkv``...) or a glob over the
    module path ``decoder.layers.<i>.self_attention.linear_qkv`` / ``decoder.layers.<i>.mlp.linear_fc1``, with
    the global layer index ``i`` (``*.layers.0.*.linear_qkv``). Empty: every linear layer of every decoder
    layer (minus ``exclude_modules``); the output layer is never adapted."""

    exclude_modules: list[str] = Field(default_factory=list)
    """Layers not to adapt when ``target_modules`` is empty, named like ``target_modules``."""

    dim: int = Field(default=8, ge=1)
    """The adapters' rank ``r``."""

    alpha: int = Field(default=32, ge=1)
    """Scaling numerator: the update is multiplied by ``alpha / dim``."""

    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout probability on the adapter path during training (never while scoring)."""

    dropout_position: Literal["pre", "post"] = "post"
    """``pre``: dropout on the adapter's input ``x``; ``post``: on its output ``B A x``."""

    lora_A_init_method: str = "xavier"
    """How ``A`` starts: ``xavier`` (Glorot normal) or ``uniform`` (Kaiming uniform with ``a = sqrt(5)``), drawn
    as the DTensor backend draws them for the same model, so both backends start from the same adapters."""

    lora_B_init_method: str = "zero"
    """How ``B`` starts: ``zero`` only, so a fresh adapter leaves the model unchanged."""

    a2a_experimental: bool = False
    """Megatron-Bridge's all-to-all LoRA for MoE experts; the supported model families are dense: must be
    false."""

    lora_dtype: str | None = None
    """Dtype of the adapters: ``null`` or ``policy.precision`` (adapters train in the layer's dtype, with
    float32 master weights in the optimizer)."""

    @model_validator(mode="after")
    def _check_enabled(self) -> Self:
        """One-line errors for settings the Megatron adapters do not build (checked only when enabled)."""
        if not self.enabled:
            return self
        key = "policy.megatron_cfg.peft"
        for pattern in [*self.target_modules, *self.exclude_modules]:
            leaf = pattern.rsplit(".", 1)[-1]
            if not fnmatch.filter(MEGATRON_LINEARS, leaf):
                raise ValueError(
                    f"{key}: {pattern!r} names no Megatron linear layer; the layers are {list(MEGATRON_LINEARS)} "
                    "(q_proj / k_proj / v_proj are linear_qkv, o_proj linear_proj, gate_proj / up_proj "
                    "linear_fc1, down_proj linear_fc2)"
                )
        if self.exclude_modules and self.target_modules:
            raise ValueError(
                f"{key}.exclude_modules needs target_modules=[] (exclusions apply to all linear layers): "
                "empty one of them"
            )
        if self.lora_A_init_method not in ("xavier", "uniform"):
            raise ValueError(f"{key}.lora_A_init_method={self.lora_A_init_method!r}: set xavier or uniform")
        if self.lora_B_init_method != "zero":
            raise ValueError(f"{key}.lora_B_init_method={self.lora_B_init_method!r}: set zero")
        if self.a2a_experimental:
            raise ValueError(f"{key}.a2a_experimental is for MoE experts, not built here: set false")
        return self

    def check_dtype(self, precision: str) -> None:
        """Raise ``ValueError`` unless ``lora_dtype`` is null or ``precision`` (``policy.precision``)."""
        if self.enabled and self.lora_dtype not in (None, precision):
            raise ValueError(
                f"policy.megatron_cfg.peft.lora_dtype={self.lora_dtype!r} differs from policy.precision="
                f"{precision!r}: set lora_dtype to null (adapters follow the layer's dtype)"
            )

    def lora_config(self, hf_targets: list[str]) -> LoraConfig:
        """The same adapters as a :class:`LoraConfig` over the Hugging Face layers ``hf_targets`` (full module
        paths): what the Hugging Face side draws, merges and exports them with."""
        return LoraConfig(
            enabled=True,
            target_modules=hf_targets,
            match_all_linear=False,
            dim=self.dim,
            alpha=self.alpha,
            dropout=self.dropout,
            dropout_position=self.dropout_position,
            lora_A_init="xavier" if self.lora_A_init_method == "xavier" else "uniform",
        )
