"""The Megatron policy worker's weights in and out: checkpoints, the Hugging Face export and the refit sender.

A mixin of :class:`~nemo_rl.models.policy.megatron_worker.MegatronPolicyWorker`, kept apart so that the worker
module stays about building and stepping the model: every method here is a collective of the worker's ranks,
as the worker's are. Each pipeline stage (and expert-parallel rank) reads, writes and sends its own layers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nemo_rl.config.policy import PolicyConfig, TokenizerConfig
from nemo_rl.models.dtypes import PRECISION_DTYPES
from nemo_rl.models.lora import adapter_state, check_checkpoint_kind, write_lora_metadata
from nemo_rl.models.megatron import checkpoint, cpu_compat, value_head
from nemo_rl.models.megatron.weights import (
    StageWeights,
    hf_weights_manifest,
    write_hf_metadata,
    write_stage_safetensors,
)
from nemo_rl.models.policy.hf_io import LORA_ADAPTER_SUBDIR, load_hf_config
from nemo_rl.models.policy.interfaces import LoraSummary
from nemo_rl.weight_sync.interfaces import TransferStats, WeightSender
from nemo_rl.weight_sync.scope import RefitScope

if TYPE_CHECKING:
    from nemo_rl.config.model_arch import ModelArch
    from nemo_rl.models.megatron.families import DecoderFamily
    from nemo_rl.models.megatron.lora import MegatronLoRA


def _full_only(scope: RefitScope) -> None:
    if scope != "full":
        raise ValueError(
            f"the Megatron policy folds its LoRA adapters into the weights it sends: every refit is full, "
            f"not {scope!r}"
        )


class MegatronWeightsMixin:
    """Checkpoints, export and the refit sender of a Megatron policy worker (see the module docstring)."""

    # Set by the worker's _build.
    cfg: PolicyConfig
    tokenizer_source: str
    lora: MegatronLoRA | None
    weights: StageWeights
    optimizer: Any
    scheduler: Any
    hf_config: Any
    arch: ModelArch
    family: DecoderFamily
    is_value_model: bool
    checkpoint_dir: Path
    rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    pp_size: int
    ep_rank: int
    ep_size: int

    # -------------------------------------------------------------------------------------- checkpoints
    def _layout(self) -> dict[str, Any]:
        """What optimizer state depends on: the parallel layout and the optimizer's own settings."""
        megatron = self.cfg.megatron_cfg
        return {
            "tensor_model_parallel_size": megatron.tensor_model_parallel_size,
            "pipeline_model_parallel_size": megatron.pipeline_model_parallel_size,
            "num_layers_in_first_pipeline_stage": megatron.num_layers_in_first_pipeline_stage,
            "num_layers_in_last_pipeline_stage": megatron.num_layers_in_last_pipeline_stage,
            "data_parallel_size": self.dp_size,
            "optimizer": megatron.optimizer.optimizer,
            "use_distributed_optimizer": megatron.optimizer.use_distributed_optimizer,
            "precision": self.cfg.precision,
            "lora_layers": self.lora.hf_targets if self.lora is not None else None,
            # Only when set, so checkpoints of dense layouts written before the key existed still resume.
            **({"expert_model_parallel_size": self.ep_size} if self.ep_size > 1 else {}),
            **({"value_head": True} if self.is_value_model else {}),
        }

    def _checkpoint_parts(self) -> checkpoint.CheckpointParts:
        """What a checkpoint holds of this rank: its stage's weights, the optimizer, the schedule, the layout."""
        return checkpoint.CheckpointParts(self.weights, self.optimizer, self.scheduler, self._layout())

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Save the weights as Hugging Face safetensors (any layout loads them; with LoRA the adapters and
        ``lora.json``) and, with ``optimizer_path``, each rank's optimizer state and the schedule (see
        :mod:`nemo_rl.models.megatron.checkpoint`)."""
        if self.lora is not None and self.rank == 0:
            os.makedirs(weights_path, exist_ok=True)
            write_lora_metadata(weights_path, self.lora.lora_config, self.cfg.model_name)
        checkpoint.save(
            self._checkpoint_parts(),
            weights_path=weights_path,
            optimizer_path=optimizer_path,
            writer=self._is_stage_writer,
            file_index=self.refit_stream(),
            num_files=self.pp_size * self.ep_size,
        )

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load what :meth:`save_checkpoint` wrote (optimizer and schedule only with ``optimizer_path``)."""
        check_checkpoint_kind(weights_path, self.lora is not None, "policy.megatron_cfg.peft.enabled")
        with cpu_compat.device_redirect():
            checkpoint.load(
                self._checkpoint_parts(), weights_path=weights_path, optimizer_path=optimizer_path
            )

    @property
    def _is_stage_writer(self) -> bool:
        """Whether this rank writes its stream's file (one rank per pipeline stage and expert-parallel rank:
        the first of the ranks holding the same experts)."""
        return self.tp_rank == 0 and self.dp_rank // self.ep_size == 0

    def export_hf(self, path: str) -> None:
        """Write a Hugging Face checkpoint in ``policy.precision``, one safetensors file per pipeline stage; with
        LoRA the merged weights, and the adapters alone as a PEFT folder in ``path``/``lora_adapter``."""
        dtype = PRECISION_DTYPES[self.cfg.precision]
        named: Iterable[tuple[str, torch.Tensor]] = self.weights.iter_hf_tensors(None if self.lora else dtype)
        if self.lora is not None:
            named = list(named)  # the stage's tensors: the adapters go to the PEFT folder, then are merged
            self.lora.save_peft(
                os.path.join(path, LORA_ADAPTER_SUBDIR),
                adapter_state(named) if self._is_stage_writer else {},
                self.cfg.model_name,
            )
        write_stage_safetensors(
            ((name, tensor.to(dtype)) for name, tensor in self._merged(named)),
            path,
            writer=self._is_stage_writer,
            file_index=self.refit_stream(),
            num_files=self.pp_size * self.ep_size,
        )
        if self.rank == 0:
            write_hf_metadata(
                path,
                dtype=dtype,
                hf_config=self._export_hf_config(),
                checkpoint_dir=Path(self.checkpoint_dir),
                tokenizer_cfg=TokenizerConfig(
                    name=self.tokenizer_source, chat_template=self.cfg.tokenizer.chat_template
                ),
                trust_remote_code=self.cfg.trust_remote_code,
            )
        dist.barrier()

    def _export_hf_config(self) -> Any:
        """The Hugging Face config exports carry: the model's, or for a value model its
        ``*ForSequenceClassification`` config with one label."""
        if not self.is_value_model:
            return self.hf_config
        return value_head.export_config(load_hf_config(self.cfg), self.family.architecture)

    # -------------------------------------------------------------------------------- refit (sender)
    def iter_hf_weights(
        self, dtype: torch.dtype, scope: RefitScope = "full"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's pipeline stage's weights under their Hugging Face names, as FULL tensors cast to ``dtype``.

        A collective over the tensor-parallel group (each parameter is gathered when it is reached); each
        pipeline stage yields only its own layers (its refit stream, see :meth:`refit_stream`). With LoRA the
        adapters are folded into their layers' weights (in the training dtype, then cast), so ``scope`` is
        always ``"full"`` (:meth:`adapter_refits`).
        """
        _full_only(scope)
        if self.lora is None:
            return self.weights.iter_hf_tensors(dtype)
        return ((name, tensor.to(dtype)) for name, tensor in self._merged(self.weights.iter_hf_tensors(None)))

    def _merged(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``named`` with the LoRA adapters folded into their layers' weights; unchanged without LoRA."""
        return iter(named) if self.lora is None else self.lora.merged(named)

    def refit_stream(self) -> int:
        """The refit stream this rank belongs to: its pipeline stage and expert-parallel rank (each stage sends
        its own layers, each expert-parallel rank its own experts; the first also the weights they share)."""
        return self.pp_rank * self.ep_size + self.ep_rank

    def weights_manifest(
        self, dtype: torch.dtype, scope: RefitScope = "full"
    ) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (full shape, dtype name)}`` of the whole model's weights (all stages); no communication."""
        _full_only(scope)
        return hf_weights_manifest(self._export_hf_config(), dtype, value_head=self.is_value_model)

    def refit_send(self, sender: WeightSender, scope: RefitScope = "full") -> TransferStats:
        """Stream this stage's weights through ``sender`` (every rank calls it with its own sender); every
        refit is ``"full"`` (LoRA adapters travel folded into the weights)."""
        return sender.send(self.iter_hf_weights(sender.dtype, scope))

    def adapter_refits(self) -> bool:
        """False: refits send the weights with the LoRA adapters folded in, never the adapters alone."""
        return False

    def lora_summary(self) -> LoraSummary | None:
        """The adapters' size (full counts, from the model's config and the adapted layers); ``None`` without
        LoRA."""
        if self.lora is None:
            return None
        base = sum(
            math.prod(shape) for shape, _ in hf_weights_manifest(self.hf_config, torch.float32).values()
        )
        adapters = self.lora.num_params(self.arch)
        return LoraSummary(
            self.cfg.megatron_cfg.peft.dim, len(self.lora.hf_targets), adapters, base + adapters
        )

    def trains_with_dropout(self) -> bool:
        """False: the Megatron backend builds its models with dropout off (hidden and attention dropout 0)."""
        return False
