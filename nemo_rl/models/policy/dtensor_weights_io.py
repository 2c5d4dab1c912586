"""The DTensor policy worker's weights in and out: the reference weights, checkpoints and the Hugging Face export,
and what the driver asks about the model (its LoRA adapters, its dropout).

A mixin of :class:`~nemo_rl.models.policy.dtensor_worker.DTensorPolicyWorker`, kept apart so that the worker
module stays about building and stepping the model: every method here is a collective of the worker's ranks,
as the worker's are. torch.distributed.checkpoint is imported in the methods that use it (the driver imports
the worker module to start the workers).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nemo_rl.config.policy import PolicyConfig, TokenizerConfig
from nemo_rl.distributed.device import cuda_available
from nemo_rl.models.dtypes import PRECISION_DTYPES
from nemo_rl.models.lora import adapter_state, adapters_disabled, check_checkpoint_kind, write_lora_metadata
from nemo_rl.models.policy.hf_io import LoraExport, config_has_dropout, export_hf_checkpoint
from nemo_rl.models.policy.interfaces import LoraSummary
from nemo_rl.models.policy.parallelize import local_tensor, reshard_all
from nemo_rl.utils.rng import get_rng_state, set_rng_state

if TYPE_CHECKING:
    from torch import nn

SCHEDULER_STATE_FILE = "scheduler.pt"
RNG_STATE_FILE = "rng_rank{rank}.pt"
"""Each rank's RNG state (torch, numpy, python) in the optimizer folder, so a resumed run continues it."""


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` (pinned when CUDA is used, so copies back are fast)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=cuda_available())
    host.copy_(tensor.detach())
    return host


class DTensorWeightsMixin:
    """Reference weights, checkpoints, export and model facts of a DTensor policy worker (see the module
    docstring)."""

    # Set by the worker's _build.
    cfg: PolicyConfig
    tokenizer_source: str
    model: nn.Module
    optimizer: Any
    scheduler: Any
    rank: int
    lora_targets: list[str]
    has_reference: bool
    reference_shards: dict[str, torch.Tensor] | None

    # ------------------------------------------------------------------------------ what the driver asks
    def lora_summary(self) -> LoraSummary | None:
        """The adapters' size: full counts (a DTensor's ``numel`` is its global size); ``None`` without LoRA."""
        if not self.lora_targets:
            return None
        params = list(self.model.parameters())
        trained = sum(p.numel() for p in params if p.requires_grad)
        rank = self.cfg.dtensor_cfg.lora_cfg.dim
        return LoraSummary(rank, len(self.lora_targets), trained, sum(p.numel() for p in params))

    def trains_with_dropout(self) -> bool:
        """Whether the model's config (with ``policy.hf_config_overrides``) sets a positive dropout probability
        (see ``hf_io.trains_with_dropout``; asked here, where the config is loaded, not in the driver)."""
        return config_has_dropout(self.model.config)

    # ------------------------------------------------------------------------------ reference weights
    @torch.no_grad()
    def _snapshot_local_shards(self) -> dict[str, torch.Tensor]:
        reshard_all(self.model)
        return {name: _to_host(local_tensor(p)) for name, p in self.model.named_parameters()}

    @contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """Swap the reference weights into the model's shards for the duration of the block (with LoRA:
        switch the adapters off)."""
        if self.lora_targets and self.has_reference:
            with adapters_disabled(self.model):
                yield
            return
        if self.reference_shards is None:
            raise RuntimeError(
                "this policy was built with init_reference_model=False, so it has no reference weights"
            )
        current = self._snapshot_local_shards()
        self._copy_into_local_shards(self.reference_shards)
        try:
            yield
        finally:
            reshard_all(self.model)
            self._copy_into_local_shards(current)

    @torch.no_grad()
    def _copy_into_local_shards(self, shards: dict[str, torch.Tensor]) -> None:
        for name, p in self.model.named_parameters():
            local_tensor(p).copy_(shards[name], non_blocking=True)
        if cuda_available():
            torch.cuda.synchronize()

    # -------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Save this rank's shards with torch.distributed.checkpoint (any later layout can load them).

        ``optimizer_path`` also saves the optimizer state (sharded) and the scheduler state (rank 0).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        reshard_all(self.model)
        dcp.save(self._checkpointed(get_model_state_dict(self.model)), checkpoint_id=weights_path)
        if self.lora_targets and self.rank == 0:
            write_lora_metadata(weights_path, self.cfg.dtensor_cfg.lora_cfg, self.cfg.model_name)
        if optimizer_path is not None:
            optim_state = get_optimizer_state_dict(self.model, self.optimizer)
            dcp.save({"optim": optim_state}, checkpoint_id=optimizer_path)
            if self.rank == 0:
                torch.save(self.scheduler.state_dict(), os.path.join(optimizer_path, SCHEDULER_STATE_FILE))
            torch.save(get_rng_state(), os.path.join(optimizer_path, RNG_STATE_FILE.format(rank=self.rank)))
        dist.barrier()

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load what :meth:`save_checkpoint` wrote (optimizer and scheduler only with ``optimizer_path``)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        reshard_all(self.model)
        model_state = self._checkpointed(get_model_state_dict(self.model))
        check_checkpoint_kind(weights_path, bool(self.lora_targets), "policy.dtensor_cfg.lora_cfg.enabled")
        dcp.load(model_state, checkpoint_id=weights_path)
        set_model_state_dict(self.model, model_state, options=StateDictOptions(strict=not self.lora_targets))
        if optimizer_path is not None:
            optim_state = {"optim": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.load(optim_state, checkpoint_id=optimizer_path)
            set_optimizer_state_dict(self.model, self.optimizer, optim_state["optim"])
            scheduler_file = os.path.join(optimizer_path, SCHEDULER_STATE_FILE)
            self.scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
            # Absent from checkpoints of another layout (or older ones): the RNG then continues as seeded.
            rng_file = os.path.join(optimizer_path, RNG_STATE_FILE.format(rank=self.rank))
            if os.path.isfile(rng_file):
                set_rng_state(torch.load(rng_file, weights_only=True))
        dist.barrier()

    def _checkpointed(self, state: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint holds of the model's state: everything, or with LoRA the adapters only (the
        frozen base is ``policy.model_name``'s, recorded in the checkpoint's ``lora.json``)."""
        if not self.lora_targets:
            return state
        return adapter_state(state.items())

    def export_hf(self, path: str) -> None:
        """Write a Hugging Face checkpoint in ``policy.precision`` (rank 0 writes; all ranks must call)."""
        reshard_all(self.model)
        export_hf_checkpoint(
            self.model,
            path,
            PRECISION_DTYPES[self.cfg.precision],
            TokenizerConfig(name=self.tokenizer_source, chat_template=self.cfg.tokenizer.chat_template),
            self.cfg.trust_remote_code,
            lora=self._lora_export(),
        )

    def _lora_export(self) -> LoraExport | None:
        if not self.lora_targets:
            return None
        return LoraExport(self.cfg.dtensor_cfg.lora_cfg, self.lora_targets, self.cfg.model_name)
