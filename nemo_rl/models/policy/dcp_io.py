"""Reading the policy's torch.distributed.checkpoint (DCP) weights without the workers that wrote them.

A training checkpoint (``<checkpoint_dir>/step_<N>``) holds the policy's sharded weights under
``policy/weights`` (written by ``DTensorPolicyWorker.save_checkpoint`` with any dp / tp layout) and the run's
resolved ``config.yaml``, whose ``policy`` section names the base model (its architecture) and the
tokenizer. :func:`find_training_checkpoint` locates both from either folder; :func:`load_dcp_model` rebuilds
the Hugging Face model in one process (no process group), and :func:`convert_dcp_to_hf` writes it as a
Hugging Face folder (what ``examples/converters/convert_dcp_to_hf.py`` runs).

A LoRA run's checkpoint holds only the adapters (and ``lora.json``): the model is the base model's weights
with the adapters merged in, and :func:`convert_dcp_to_peft` writes the adapters alone as a PEFT folder.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from nemo_rl.config.errors import UserError
from nemo_rl.config.lora import LoraConfig
from nemo_rl.config.policy import PolicyConfig, TokenizerConfig
from nemo_rl.models.dtypes import PRECISION_DTYPES
from nemo_rl.models.hf_config import load_hf_config
from nemo_rl.models.lora import (
    adapter_state,
    apply_lora,
    lora_modules,
    merge_and_unload,
    read_lora_metadata,
)
from nemo_rl.models.policy.hf_io import LoraExport
from nemo_rl.models.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

DCP_METADATA_FILE = ".metadata"
"""The file every DCP checkpoint folder has (its index of tensors and shards)."""

WEIGHTS_SUBDIR = Path("policy") / "weights"
"""Where a training checkpoint keeps the policy's DCP weights (see ``nemo_rl.algorithms`` loop utilities)."""

RUN_CONFIG_FILE = "config.yaml"
"""The resolved config of the run, written into every training checkpoint."""


class CheckpointFormatError(UserError):
    """A path given as a training checkpoint is not one, or its run config lacks what is needed."""


def is_dcp_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a DCP folder or a training checkpoint holding one under ``policy/weights``."""
    folder = Path(path)
    return (folder / DCP_METADATA_FILE).is_file() or (folder / WEIGHTS_SUBDIR / DCP_METADATA_FILE).is_file()


@dataclasses.dataclass(frozen=True)
class TrainingCheckpoint:
    """The DCP weights of a training checkpoint and the ``policy`` section of the run that wrote them."""

    weights_dir: Path
    """The DCP folder of the policy weights."""

    policy: PolicyConfig
    """The run's ``policy`` section: base model (architecture), tokenizer, precision."""

    @property
    def lora(self) -> LoraConfig | None:
        """The adapters' settings when the checkpoint holds LoRA adapters only (the base model is
        ``policy.model_name``'s), else None."""
        metadata = read_lora_metadata(self.weights_dir)
        return None if metadata is None else LoraConfig.model_validate(metadata["lora_cfg"])

    @property
    def tokenizer_config(self) -> TokenizerConfig:
        """The tokenizer the run trained with (its name, or the base model's, and its chat template)."""
        return TokenizerConfig(
            name=self.policy.tokenizer_name, chat_template=self.policy.tokenizer.chat_template
        )


def find_training_checkpoint(path: str | Path, run_config: str | Path | None = None) -> TrainingCheckpoint:
    """The weights and run config of the checkpoint at ``path``: a step folder (``step_<N>``) or its
    ``policy/weights`` DCP folder. ``run_config`` overrides where the run's ``config.yaml`` is read from
    (by default the step folder's)."""
    folder = Path(path)
    if (folder / WEIGHTS_SUBDIR / DCP_METADATA_FILE).is_file():
        weights_dir, step_dir = folder / WEIGHTS_SUBDIR, folder
    elif (folder / DCP_METADATA_FILE).is_file():
        weights_dir, step_dir = folder, folder.parent.parent
    else:
        raise CheckpointFormatError(
            f"{folder} is not a training checkpoint: expected a step folder with {WEIGHTS_SUBDIR}/"
            f"{DCP_METADATA_FILE} or a DCP folder with {DCP_METADATA_FILE}"
        )
    config_path = Path(run_config) if run_config is not None else step_dir / RUN_CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointFormatError(
            f"no run config at {config_path}: the checkpoint's base model and tokenizer are read from the "
            "config.yaml of its step folder; give its path (--config for the converter)"
        )
    loaded = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    section = loaded.get("policy") if isinstance(loaded, dict) else None
    if not isinstance(section, dict):
        raise CheckpointFormatError(f"{config_path} has no policy section naming the checkpoint's base model")
    return TrainingCheckpoint(weights_dir=weights_dir, policy=PolicyConfig.model_validate(section))


def _checkpoint_keys(weights_dir: Path) -> set[str]:
    metadata = dcp.FileSystemReader(str(weights_dir)).read_metadata()
    return set(metadata.state_dict_metadata)


def load_dcp_model(checkpoint: TrainingCheckpoint) -> PreTrainedModel:
    """The run's Hugging Face model (float32, on the CPU) with the checkpoint's weights loaded.

    Weights are matched by name; tied weights the checkpoint stores once are filled through the tie. A
    weight of the model missing from the checkpoint (a different architecture) raises.
    """
    policy = checkpoint.policy
    hf_config = load_hf_config(
        policy.model_name, trust_remote_code=policy.trust_remote_code, overrides=policy.hf_config_overrides
    )
    if checkpoint.lora is not None:
        model = load_lora_model(checkpoint, hf_config)
        merge_and_unload(model)
        return model
    model = AutoModelForCausalLM.from_config(
        hf_config, dtype=torch.float32, trust_remote_code=policy.trust_remote_code
    )
    state = model.state_dict()
    stored = _checkpoint_keys(checkpoint.weights_dir)
    tied = {name for name in _tied_names(model) if name not in stored}
    missing = sorted(set(state) - stored - tied)
    if missing:
        raise CheckpointFormatError(
            f"{checkpoint.weights_dir} lacks {len(missing)} weights of {policy.model_name}, e.g. {missing[:5]}: "
            "is the run config's policy.model_name the model this checkpoint was trained from?"
        )
    to_load: dict[str, Any] = {name: tensor for name, tensor in state.items() if name in stored}
    with warnings.catch_warnings():
        # Reading without a process group is the point here, not a mistake worth a warning.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(to_load, checkpoint_id=str(checkpoint.weights_dir), no_dist=True)
    model.load_state_dict(to_load, strict=False)
    if tied:
        model.tie_weights()
    return model


def load_lora_model(checkpoint: TrainingCheckpoint, hf_config: Any) -> PreTrainedModel:
    """The run's base model (``policy.model_name``'s weights) with the checkpoint's LoRA adapters loaded."""
    policy, lora = checkpoint.policy, checkpoint.lora
    assert lora is not None
    model = AutoModelForCausalLM.from_pretrained(
        policy.model_name, config=hf_config, dtype=torch.float32, trust_remote_code=policy.trust_remote_code
    )
    apply_lora(model, lora)
    adapters = adapter_state((name, p.detach()) for name, p in model.named_parameters())
    missing = sorted(set(adapters) - _checkpoint_keys(checkpoint.weights_dir))
    if missing:
        raise CheckpointFormatError(
            f"{checkpoint.weights_dir} lacks {len(missing)} LoRA adapters of {policy.model_name}, e.g. "
            f"{missing[:3]}: does the run config's lora_cfg match the run that wrote it?"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(adapters, checkpoint_id=str(checkpoint.weights_dir), no_dist=True)
    return model


def convert_dcp_to_peft(checkpoint: TrainingCheckpoint, path: str | Path) -> Path:
    """Write a LoRA checkpoint's adapters as a PEFT adapter folder at ``path`` (``adapter_config.json`` and
    ``adapter_model.safetensors``, for ``peft.PeftModel.from_pretrained`` on the base model) and return it."""
    lora = checkpoint.lora
    if lora is None:
        raise UserError(
            f"{checkpoint.weights_dir} holds a full model, not LoRA adapters: convert it without --adapter-only"
        )
    policy = checkpoint.policy
    hf_config = load_hf_config(
        policy.model_name, trust_remote_code=policy.trust_remote_code, overrides=policy.hf_config_overrides
    )
    model = load_lora_model(checkpoint, hf_config)
    export = LoraExport(lora, [name for name, _ in lora_modules(model)], policy.model_name)
    export.save_adapter(model, dict(model.named_parameters()), str(path))
    logger.info("wrote the LoRA adapters of %s as a PEFT folder at %s", checkpoint.weights_dir, path)
    return Path(path)


def _tied_names(model: nn.Module) -> set[str]:
    """Names of the weights of ``model`` that share their storage with another weight (tied embeddings)."""
    by_pointer: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_pointer.setdefault(tensor.data_ptr(), []).append(name)
    return {name for names in by_pointer.values() if len(names) > 1 for name in names}


def convert_dcp_to_hf(
    checkpoint: TrainingCheckpoint,
    hf_path: str | Path,
    *,
    dtype: str | None = None,
    tokenizer: TokenizerConfig | None = None,
) -> Path:
    """Write the checkpoint as a Hugging Face folder at ``hf_path`` (safetensors, config, generation config,
    tokenizer) and return it.

    Args:
        checkpoint: From :func:`find_training_checkpoint`.
        hf_path: The folder to write (created; existing files are overwritten).
        dtype: ``float32``, ``bfloat16`` or ``float16``; ``None`` uses the run's ``policy.precision``.
        tokenizer: The tokenizer to save with it; ``None`` uses the run's (with its chat template).
    """
    precision = dtype or checkpoint.policy.precision
    if precision not in PRECISION_DTYPES:
        raise UserError(f"dtype {precision!r} is not one of {sorted(PRECISION_DTYPES)}")
    model = load_dcp_model(checkpoint)
    nn.Module.to(model, PRECISION_DTYPES[precision])
    out = Path(hf_path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    _save_generation_config(checkpoint.policy, out)
    tokenizer_cfg = tokenizer or checkpoint.tokenizer_config
    # Through get_tokenizer (not AutoTokenizer), which honours the tokenizer's own class and chat template.
    get_tokenizer(
        tokenizer_cfg,
        model_name=checkpoint.policy.model_name,
        trust_remote_code=checkpoint.policy.trust_remote_code,
    ).save_pretrained(str(out))
    logger.info("converted %s to a Hugging Face checkpoint at %s", checkpoint.weights_dir, out)
    return out


def _save_generation_config(policy: PolicyConfig, out: Path) -> None:
    """Copy the base model's generation config (its EOS tokens, sampling defaults) when it has one."""
    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(
            policy.model_name, trust_remote_code=policy.trust_remote_code
        )
    except OSError:
        # The base model ships none: save_pretrained already wrote one derived from its config.
        return
    generation_config.save_pretrained(str(out))
