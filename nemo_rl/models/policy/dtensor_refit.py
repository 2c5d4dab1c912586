"""The DTensor policy worker's refit side: streaming its weights to generation engines, and the embedded engine
it hosts with ``policy.generation.embedded_cfg.in_policy_workers``.

A mixin of :class:`~nemo_rl.models.policy.dtensor_worker.DTensorPolicyWorker`, kept apart so that the worker
module stays about training: every method here is a collective of the worker's ranks, as the worker's are.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from nemo_rl.models.dtypes import PRECISION_DTYPES
from nemo_rl.models.hf_moe import per_expert_manifest, per_expert_weights
from nemo_rl.models.lora import is_adapter_name
from nemo_rl.models.policy.parallelize import (
    fsdp_dim0_sharded,
    fsdp_units_of_parameters,
    gather_dim0_shards,
    local_tensor,
    reshard_all,
)
from nemo_rl.weight_sync.checksums import Checksum
from nemo_rl.weight_sync.guard import check_in_process, recording
from nemo_rl.weight_sync.interfaces import TransferStats, WeightSender
from nemo_rl.weight_sync.manifest import dtype_from_name, dtype_name
from nemo_rl.weight_sync.scope import RefitScope

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from transformers import PreTrainedTokenizerBase

    from nemo_rl.config.policy import PolicyConfig
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.generation.embedded.replica import EmbeddedReplica


class DTensorRefitMixin:
    """The refit sender and the hosted embedded engine of a DTensor policy worker (see the module docstring)."""

    # Set by the worker's _build.
    cfg: PolicyConfig
    model: nn.Module
    mesh: DeviceMesh
    device: torch.device
    world_size: int
    dp_size: int
    dp_rank: int
    lora_targets: list[str]
    _hosts_generation: bool
    _generation_replica: EmbeddedReplica | None

    # -------------------------------------------------------------------------------- refit (sender)
    def _persistent_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for module_name, module in self.model.named_modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    yield (f"{module_name}.{name}" if module_name else name), buffer

    @torch.no_grad()
    def iter_hf_weights(
        self, dtype: torch.dtype, scope: RefitScope = "full"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight under its Hugging Face name as a FULL tensor cast to ``dtype`` (floating point only).

        A collective: every rank must iterate to the end in lockstep, because gathering each sharded
        parameter (``DTensor.full_tensor()``) all-gathers over the dp and tp axes. Afterwards every rank
        holds the full tensor. Tied weights appear once (under the input embedding's name); persistent
        buffers follow the parameters. With LoRA, ``scope`` (:mod:`nemo_rl.weight_sync.scope`) picks the base
        weights and the adapters (unmerged: the engine merges them), or the adapters alone.
        """
        yield from self._iter_full_parameters(dtype, adapters_only=self._adapters_only(scope))
        if scope == "adapters":
            return
        for name, buffer in self._persistent_buffers():
            yield name, buffer.to(dtype) if buffer.is_floating_point() else buffer

    def adapter_refits(self) -> bool:
        """With LoRA: the base is frozen and refits send the adapters unmerged, so later refits may send them
        alone."""
        return bool(self.lora_targets)

    def _adapters_only(self, scope: RefitScope) -> bool:
        if scope == "adapters" and not self.lora_targets:
            raise ValueError("an adapters-only refit needs a policy with policy.dtensor_cfg.lora_cfg.enabled")
        return scope == "adapters"

    def _iter_full_parameters(
        self, dtype: torch.dtype, adapters_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter (or every LoRA adapter) as a full tensor cast to ``dtype``, gathered unit by unit
        (a collective); adapters alone are gathered one by one (unsharding a unit would gather its base too)."""
        from torch.distributed.tensor import DTensor

        reshard_all(self.model)
        names = [
            name for name, _ in self.model.named_parameters() if not adapters_only or is_adapter_name(name)
        ]
        unshards = self._refit_unshards(dtype) and not adapters_only
        owners = fsdp_units_of_parameters(self.model) if unshards else {}
        current: FSDPModule | None = None
        for name in names:
            unit = owners.get(name)
            if unit is not current:
                # One all-gather for all of a unit's parameters (a decoder layer's, or the root's) instead of one
                # per parameter; a layer is sharded again once its weights are out, the root at the end.
                if current is not None and current is not self.model:
                    current.reshard()
                if unit is not None:
                    unit.unshard()
                current = unit
            p = self.model.get_parameter(name)
            if isinstance(p, DTensor):
                yield name, p.full_tensor().to(dtype)
            else:
                # An unsharded parameter lives in the unit's all-gather buffer, which resharding frees, and a
                # one-rank policy's plain parameter changes with the next step: copy.
                yield name, p.detach().to(dtype, copy=True)
        reshard_all(self.model)

    def _refit_unshards(self, dtype: torch.dtype) -> bool:
        """Whether the refit may gather through FSDP's unshard, which all-gathers in ``policy.precision``:
        the same values as gathering the float32 master weights when the refit casts to that dtype or keeps
        float32 (a cast is element-wise, so gathering and casting commute); not with CPU offload."""
        param_dtype = PRECISION_DTYPES[self.cfg.precision]
        return (
            self.dp_size > 1
            and not self.cfg.dtensor_cfg.cpu_offload
            and param_dtype in (dtype, torch.float32)
        )

    def weights_manifest(
        self, dtype: torch.dtype, scope: RefitScope = "full"
    ) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (full shape, dtype name)}`` of what :meth:`refit_send` sends (:meth:`iter_hf_weights`'s
        weights, a MoE model's experts one by one); no communication."""
        adapters_only = self._adapters_only(scope)
        manifest: dict[str, tuple[tuple[int, ...], str]] = {
            name: (tuple(p.shape), dtype_name(dtype))
            for name, p in self.model.named_parameters()
            if not adapters_only or is_adapter_name(name)
        }
        if adapters_only:
            return manifest
        for name, buffer in self._persistent_buffers():
            out_dtype = dtype if buffer.is_floating_point() else buffer.dtype
            manifest[name] = (tuple(buffer.shape), dtype_name(out_dtype))
        return per_expert_manifest(manifest)

    def refit_stream(self) -> int:
        """The refit stream this rank sends: 0, the whole model (every rank gathers every weight)."""
        return 0

    def refit_send(self, sender: WeightSender, scope: RefitScope = "full") -> TransferStats:
        """Stream this policy's weights of refit ``scope`` through ``sender`` (every rank calls it with its own
        sender)."""
        # A MoE model's experts travel one tensor per expert, under their checkpoint names.
        return sender.send(per_expert_weights(self.iter_hf_weights(sender.dtype, scope)))

    # ------------------------------------------------- the embedded engine hosted here (in_policy_workers)
    def init_embedded_generation(self, tokenizer: PreTrainedTokenizerBase) -> None:
        """Hold a replica of the embedded engine (``policy.generation.embedded_cfg.in_policy_workers``).

        Only the first tensor- and context-parallel rank of each data-parallel group holds one and generates; the
        other ranks take part in the refit's gathers only. Its weights arrive with the first refit.
        """
        from nemo_rl.models.generation.embedded.replica import EmbeddedReplica

        # The first rank of the group's tensor- and context-parallel ranks (which hold the same rows).
        leads = self.mesh.get_local_rank("tp") == 0 and self.mesh.get_local_rank("cp") == 0
        self._hosts_generation = True
        self._generation_replica = (
            EmbeddedReplica.without_weights(self.cfg, tokenizer, dp_rank=self.dp_rank, device=self.device)
            if leads
            else None
        )

    def _embedded_replica(self) -> EmbeddedReplica | None:
        if not self._hosts_generation:
            raise RuntimeError(
                "this policy worker holds no embedded engine: start it with in-policy generation "
                "(policy.generation.embedded_cfg.in_policy_workers=true)"
            )
        return self._generation_replica

    def generate(self, data: BatchedDataDict[Any], greedy: bool, seed: int) -> BatchedDataDict[Any]:
        """Generate for this data-parallel group's shard with the hosted engine (``EmbeddedReplica.generate``);
        the other tensor-parallel ranks return an empty batch."""
        from nemo_rl.models.generation.interfaces import empty_generation_output

        replica = self._embedded_replica()
        return replica.generate(data, greedy, seed) if replica is not None else empty_generation_output(data)

    def prepare_for_generation(self) -> None:
        """The hosted engine's weights back onto the device."""
        if (replica := self._embedded_replica()) is not None:
            replica.prepare_for_generation()

    def finish_generation(self) -> None:
        """Drop the hosted engine's KV cache (and offload its weights on CUDA) before training."""
        if (replica := self._embedded_replica()) is not None:
            replica.finish_generation()

    def refit_embedded_generation(self, scope: RefitScope = "full") -> int:
        """Copy this policy's current weights of refit ``scope`` into the hosted engine (the driver's
        ``Refitter`` offloads around it, as around a refit through a transport); the bytes copied, in the
        generation dtype (0 on the ranks that hold none). A collective: with FSDP alone every rank all-gathers
        every weight at once, with TP each weight's shards in turn."""
        replica = self._embedded_replica()
        adapters_only = self._adapters_only(scope)
        weights: Iterator[tuple[str, torch.Tensor]]
        replicated = self.cfg.dtensor_cfg.data_parallel_mode == "replicate"
        if (self.world_size == 1 or replicated) and replica is not None:
            # One rank, or a replicated model, holds every weight whole: its local tensors are the full ones, so
            # the replica copies (and casts) them directly, with no gather; tied weights once, then the
            # persistent buffers.
            reshard_all(self.model)
            params = (
                (name, local_tensor(p).detach())
                for name, p in self.model.named_parameters()
                if not adapters_only or is_adapter_name(name)
            )
            weights = itertools.chain(params, () if adapters_only else self._persistent_buffers())
        else:
            weights = self._iter_full_weights_for_engine(
                dtype_from_name(self.cfg.generation.embedded_cfg.precision), scope
            )
        if replica is None:
            for _ in weights:  # the gathers are collectives: this rank takes part and drops the weights
                pass
            return 0
        # The refit guard (policy.refit.guard): what the engine holds after the copy against what it was given.
        sent: dict[str, Checksum] = {}
        dtype = dtype_from_name(self.cfg.generation.embedded_cfg.precision)
        guarded = self.cfg.refit.guard.checksums
        num_bytes = replica.load_refit(recording(weights, sent, dtype) if guarded else weights, scope)
        if guarded:
            check_in_process(self.cfg.refit.guard, sent, replica.weight_checksums(), scope)
        return num_bytes

    def _iter_full_weights_for_engine(
        self, dtype: torch.dtype, scope: RefitScope
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What :meth:`iter_hf_weights` yields, for an engine in this process that holds the whole model
        anyway: FSDP-only shards come with one all-gather for every parameter (:func:`gather_dim0_shards`)
        instead of one per FSDP unit; other layouts (TP) gather as :meth:`iter_hf_weights` does."""
        reshard_all(self.model)
        params = list(self.model.named_parameters())
        if scope == "adapters" or not fsdp_dim0_sharded(params):
            return self.iter_hf_weights(dtype, scope)
        full = gather_dim0_shards(params, dtype, self.device)
        buffers = (
            (name, buffer.to(dtype) if buffer.is_floating_point() else buffer)
            for name, buffer in self._persistent_buffers()
        )
        return itertools.chain(full, buffers)

    def load_embedded_generation_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load full weights given by the driver into the hosted engine (``GenerationInterface.update_weights``)."""
        replica = self._embedded_replica()
        return replica.load_weights_from_stream(named_tensors) if replica is not None else 0

    def embedded_generation_weights(self) -> dict[str, torch.Tensor]:
        """Host copies of the hosted engine's weights (empty on ranks that hold none), for checks."""
        replica = self._embedded_replica()
        return replica.named_weights() if replica is not None else {}

    def embedded_weights_manifest(self, scope: RefitScope = "full") -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (full shape, dtype name)}`` the hosted engine expects from a refit of ``scope`` (asked
        of a dp leader)."""
        replica = self._embedded_replica()
        assert replica is not None, "asked of a rank that holds no engine"
        return replica.expected_weights_manifest(scope)
