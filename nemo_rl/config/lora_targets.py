"""LoRA targets that match no layer of the model, found before anything starts.

``policy.dtensor_cfg.lora_cfg.target_modules`` names layers (``q_proj``) or globs over module paths; a name
the model does not have used to surface as a traceback inside the policy's workers, many seconds after Ray
had started. :func:`check_lora_targets` builds the model from its ``config.json`` on PyTorch's ``meta`` device
(no weights, no memory: the module tree only), lists its linear layers and applies the same rule the workers
apply (:func:`~nemo_rl.config.lora.select_lora_targets`). torch and transformers are imported only when LoRA
names its targets, and only a local model folder is checked (a hub name would mean a download here); the
workers still check every model.
"""

from __future__ import annotations

from pathlib import Path

from nemo_rl.config.errors import UserError
from nemo_rl.config.lora import select_lora_targets
from nemo_rl.config.policy import PolicyConfig


def check_lora_targets(policy: PolicyConfig) -> None:
    """Raise :class:`UserError` (one line: the patterns and the model's layer names) when the DTensor policy's
    LoRA ``target_modules`` / ``exclude_modules`` leave no linear layer of a local model to adapt."""
    lora = policy.dtensor_cfg.lora_cfg
    if not (policy.dtensor_cfg.enabled and lora.enabled) or (
        lora.match_all_linear and not lora.exclude_modules
    ):
        return
    if not (Path(policy.model_name) / "config.json").is_file():
        return
    linears = _linear_layers(policy)
    if linears is None:
        return
    try:
        select_lora_targets(linears, lora)
    except ValueError as err:
        raise UserError(f"{err}: name some of them in target_modules") from err


def _linear_layers(policy: PolicyConfig) -> list[str] | None:
    """Module paths of the causal LM's linear layers other than its output head, from the model built on the
    ``meta`` device; ``None`` when transformers builds no causal LM from the config (the workers decide)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(
        policy.model_name, trust_remote_code=policy.trust_remote_code, **policy.hf_config_overrides
    )
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=policy.trust_remote_code)
    except ValueError:  # transformers' "Unrecognized configuration class": not a causal LM it knows
        return None
    head = model.get_output_embeddings()
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head and name
    ]
