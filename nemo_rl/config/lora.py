"""Schema of LoRA adapters on the DTensor policy: NeMo RL's ``policy.dtensor_cfg.lora_cfg``.

With ``enabled`` the base model's weights are frozen and every chosen linear layer ``y = x W^T + b`` gains a
low-rank update ``(alpha / dim) * B A x`` whose ``A`` ([dim, in]) and ``B`` ([out, dim]) are the only trained
parameters (``nemo_rl.models.lora`` builds them). ``docs/algorithms/lora.md`` covers the whole feature.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from nemo_rl.config.base import ConfigModel


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
