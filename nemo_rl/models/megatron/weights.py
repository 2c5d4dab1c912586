"""One pipeline stage's weights as Hugging Face tensors: loading them, streaming them, writing them.

:class:`StageWeights` holds the :class:`~nemo_rl.models.megatron.convert.WeightRule` list of this rank's stage.
Loading reads each Hugging Face tensor the stage needs straight from the checkpoint's safetensors (every rank
reads its own; no rank holds more than one full tensor at a time) and keeps this rank's slice. Streaming
(:meth:`StageWeights.iter_hf_tensors`) gathers one parameter at a time over the tensor-parallel group and
rebuilds its full Hugging Face tensors, so a stage never holds more than one gathered parameter: refit and
the Hugging Face export both use it, each stage sending / writing only its own layers.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from nemo_rl.config.model_arch import ModelArch
from nemo_rl.config.policy import TokenizerConfig
from nemo_rl.models.hf_moe import per_expert_manifest
from nemo_rl.models.lora import is_adapter_name
from nemo_rl.models.megatron.convert import Kind, WeightRule, pad_vocab, to_hugging_face, to_megatron
from nemo_rl.models.megatron.families import DecoderFamily
from nemo_rl.models.tokenizer import get_tokenizer
from nemo_rl.weight_sync.manifest import dtype_name

logger = logging.getLogger(__name__)


class StageWeights:
    """The Hugging Face view of one rank's pipeline stage (``model`` is its unwrapped ``GPTModel``)."""

    def __init__(
        self,
        model: nn.Module,
        arch: ModelArch,
        family: DecoderFamily,
        *,
        first_stage: bool,
        last_stage: bool,
        te_norms: bool,
        tp_group: dist.ProcessGroup,
        adapted: Mapping[int, Collection[str]] | None = None,
        experts: Sequence[int] = (),
        streams_shared: bool = True,
        value_head: bool = False,
    ) -> None:
        """``adapted``: the LoRA-adapted linear layers by global decoder layer, whose adapters the model
        carries (:meth:`nemo_rl.models.megatron.lora.MegatronLoRA.attach`); ``experts``: the routed experts
        (global indices) this rank holds in each MoE layer; ``streams_shared``: whether this rank's streams
        (refit, export, checkpoint) carry the weights every expert-parallel rank holds alike, or only its
        experts (expert-parallel ranks but the first; they are never tensor-parallel, so skipping the rest
        leaves no gather unmatched); ``value_head``: the model ends in a value model's scalar head
        (:mod:`nemo_rl.models.megatron.value_head`)."""
        self.arch = arch
        self.family = family
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group)
        self.tp_rank = dist.get_rank(tp_group)
        decoder: Any = model.decoder
        # Megatron numbers layers globally from 1 (``layer_number``) and names them locally.
        self.layers = [int(layer.layer_number) - 1 for layer in decoder.layers]
        self.rules = family.stage_rules(
            arch,
            self.layers,
            first_stage=first_stage,
            last_stage=last_stage,
            te_norms=te_norms,
            adapted=adapted,
            experts=experts,
            value_head=value_head,
        )
        self.stream_rules = [rule for rule in self.rules if streams_shared or rule.expert]
        """Rules of the weights this rank's streams carry (:meth:`iter_hf_tensors`' default)."""
        self.adapter_rules = [rule for rule in self.rules if is_adapter_name(rule.hf[0])]
        """Rules of the LoRA adapters (none without LoRA)."""
        self.base_rules = [rule for rule in self.rules if not is_adapter_name(rule.hf[0])]
        """Rules of the model's own weights (those of its Hugging Face checkpoint)."""
        # A sigmoid router's expert bias is a buffer in megatron-core, a checkpoint weight in Hugging Face.
        self.params = dict(model.named_parameters()) | {
            name: buffer for name, buffer in model.named_buffers() if name.endswith("router.expert_bias")
        }
        covered = {rule.megatron for rule in self.rules}
        if covered != set(self.params):
            raise RuntimeError(
                f"the {family.model_type} weight rules and the Megatron model disagree: rules without a "
                f"parameter {sorted(covered - set(self.params))}, parameters without a rule "
                f"{sorted(set(self.params) - covered)}"
            )

    @property
    def trained_rules(self) -> list[WeightRule]:
        """Rules of the trained parameters this rank's checkpoint stream holds: the adapters with LoRA, else
        :attr:`stream_rules`."""
        return self.adapter_rules or self.stream_rules

    @property
    def hf_names(self) -> list[str]:
        """Hugging Face names this rank's stream exports, in stream order."""
        return [name for rule in self.stream_rules if rule.exported for name in rule.hf]

    @torch.no_grad()
    def load(self, get: Callable[[str], torch.Tensor], rules: Sequence[WeightRule] | None = None) -> None:
        """Copy this rank's slice of the Hugging Face tensors of ``rules`` (default: all of the stage's) into
        the model's parameters; ``get(name)`` reads a full Hugging Face tensor (``SafetensorsReader.get``)."""
        attention = self.family.attention_shape(self.arch)
        padded = pad_vocab(self.arch.vocab_size, self.tp_size)
        for rule in self.rules if rules is None else rules:
            local = to_megatron(
                rule,
                [get(name) for name in rule.hf],
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                attention=attention,
                padded_vocab=padded,
            )
            param = self.params[rule.megatron]
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(
                    f"{rule.hf} give a {tuple(local.shape)} slice for {rule.megatron}, which is {tuple(param.shape)}"
                )
            param.data.copy_(local)

    @torch.no_grad()
    def iter_hf_tensors(
        self, dtype: torch.dtype | None = None, rules: Sequence[WeightRule] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stage's exported Hugging Face tensors (of ``rules``; default :attr:`stream_rules`), full, cast
        to ``dtype`` (floating point; ``None`` keeps it).

        A collective over the tensor-parallel group: its ranks iterate in lockstep, each parameter is gathered
        when it is reached, and every rank of the group gets the full tensors.
        """
        attention = self.family.attention_shape(self.arch)
        for rule in self.stream_rules if rules is None else rules:
            if not rule.exported:
                continue
            shards = self._gather(rule)
            for name, tensor in zip(
                rule.hf,
                to_hugging_face(rule, shards, attention=attention, vocab_size=self.arch.vocab_size),
                strict=True,
            ):
                yield name, tensor if dtype is None else tensor.to(dtype)

    def _gather(self, rule: WeightRule) -> list[torch.Tensor]:
        local = self.params[rule.megatron].detach()
        if rule.kind is Kind.REPLICATED or self.tp_size == 1:
            return [local] * self.tp_size
        shards = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=self.tp_group)
        return shards

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A host copy of this rank's parameters (its shards), by Megatron name."""
        return {name: param.detach().to("cpu", copy=True) for name, param in self.params.items()}

    @torch.no_grad()
    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        """Copy a :meth:`snapshot` back into the parameters."""
        for name, param in self.params.items():
            param.data.copy_(snapshot[name])


def hf_weights_manifest(
    hf_config: Any, dtype: torch.dtype, value_head: bool = False
) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{hf_name: (full shape, dtype name)}`` of every weight of the model (as a Hugging Face checkpoint
    stores it: a tied LM head once, a MoE layer's experts one by one, persistent buffers), from its config
    alone; with ``value_head`` of its sequence-classification model (``score.weight`` for the LM head)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto_class = AutoModelForSequenceClassification if value_head else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto_class.from_config(hf_config)
    manifest = {name: (tuple(p.shape), dtype_name(dtype)) for name, p in skeleton.named_parameters()}
    for name, buffer in skeleton.state_dict().items():
        # Persistent buffers the checkpoint holds too (GLM's float32 e_score_correction_bias).
        if name not in manifest and not name.endswith("lm_head.weight"):
            manifest[name] = (
                tuple(buffer.shape),
                dtype_name(dtype if buffer.is_floating_point() else buffer.dtype),
            )
    return per_expert_manifest(manifest)


def write_stage_safetensors(
    named: Iterable[tuple[str, torch.Tensor]],
    path: str,
    *,
    writer: bool,
    file_index: int,
    num_files: int,
) -> None:
    """Write Hugging Face-named tensors as safetensors, one file per pipeline stage and expert-parallel rank
    (``file_index`` of ``num_files``), plus the index.

    A collective over all ranks: every rank consumes its stream ``named`` (e.g.
    :meth:`StageWeights.iter_hf_tensors`, gathered with its tensor-parallel group), ``writer`` ranks (one per
    file) write it, and global rank 0 writes ``model.safetensors.index.json``.
    """
    file_name = f"model-{file_index + 1:05d}-of-{num_files:05d}.safetensors"
    tensors = {name: tensor.contiguous() for name, tensor in named}
    if writer:
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, file_name), metadata={"format": "pt"})
    stage_nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    written: list[tuple[dict[str, str], int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(
        written, ({name: file_name for name in tensors}, stage_nbytes) if writer else ({}, 0)
    )
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        weight_map = {name: file for entry in written if entry for name, file in entry[0].items()}
        index = {
            "metadata": {"total_size": sum(entry[1] for entry in written if entry)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        Path(path, "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    dist.barrier()


def write_hf_metadata(
    path: str,
    *,
    dtype: torch.dtype,
    hf_config: Any,
    checkpoint_dir: Path,
    tokenizer_cfg: TokenizerConfig,
    trust_remote_code: bool,
) -> None:
    """Write what ``from_pretrained`` needs next to the weights: the config (with ``dtype``), the generation
    config (the source checkpoint's, from ``checkpoint_dir``, or one derived from the config) and the
    tokenizer ``tokenizer_cfg`` names. Call on one rank."""
    config: Any = copy.deepcopy(hf_config)
    config.dtype = dtype
    config.save_pretrained(path)
    _save_generation_config(hf_config, checkpoint_dir, path)
    # Through get_tokenizer, not AutoTokenizer: AutoTokenizer swaps in the model family's tokenizer class.
    get_tokenizer(tokenizer_cfg, model_name=None, trust_remote_code=trust_remote_code).save_pretrained(path)
    logger.info("exported a Hugging Face checkpoint to %s", path)


def _save_generation_config(hf_config: Any, checkpoint_dir: Path, path: str) -> None:
    from transformers import GenerationConfig

    if (checkpoint_dir / "generation_config.json").exists():
        generation_config = GenerationConfig.from_pretrained(checkpoint_dir)
    else:
        generation_config = GenerationConfig.from_model_config(hf_config)
    generation_config.save_pretrained(path)
