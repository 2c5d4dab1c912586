"""What a generation engine knows of the policy's LoRA adapters, and the exact merge the embedded engine uses.

A policy that sends its LoRA adapters apart from its base weights (:func:`unmerged_adapters`: the DTensor
backend with ``policy.dtensor_cfg.lora_cfg.enabled``) sends refits by scope (:mod:`nemo_rl.weight_sync.scope`):
a ``"full"`` refit carries the frozen base weights and the adapters (``<module>.lora_A`` [r, in],
``<module>.lora_B`` [out, r]), an ``"adapters"`` refit the adapters alone. :class:`AdapterLayout` is the
receiver's side of that contract: which layers are adapted (chosen from the engine's own layer names by the
policy's ``lora_cfg``, as the policy chose them), the adapters' shapes, and the manifest of each scope.

:class:`MergedAdapters` applies adapters the way the embedded engine does (the faster of the two ways measured
in ``benchmarks/bench_lora_generation.py``, see benchmarks/README.md): it keeps a copy of each adapted layer's
base weight and, when the adapters arrive, loads ``W = W_base + (alpha / r) B A`` (computed in float32, from
the kept base each time: exact, no drift over many refits).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NoReturn

import torch

from nemo_rl.config.lora import LoraConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.lora import merge_lora, select_lora_targets
from nemo_rl.weight_sync.checksums import Checksum, tensor_checksum
from nemo_rl.weight_sync.errors import RefitIntegrityError
from nemo_rl.weight_sync.manifest import format_names
from nemo_rl.weight_sync.scope import RefitScope, check_scope

ShapeManifest = Mapping[str, tuple[tuple[int, ...], str]]
"""``{hf_name: (full shape, dtype name)}``, the generation backends' manifest format."""


def unmerged_adapters(cfg: PolicyConfig) -> LoraConfig | None:
    """The LoRA adapters the policy of ``cfg`` sends apart from its base weights, which the engines must then
    hold and merge themselves; ``None`` when it sends plain weights: it trains no adapters, or it folds them
    into the weights before sending (the Megatron backend, whose refits are always full). The one place the
    generation side reads the policy's LoRA settings."""
    if cfg.dtensor_cfg.enabled and cfg.dtensor_cfg.lora_cfg.enabled:
        return cfg.dtensor_cfg.lora_cfg
    return None


def adaptable_linears(manifest: ShapeManifest) -> dict[str, tuple[int, int]]:
    """``{module: (out, in)}`` of the linear layers inside the decoder layers of a manifest of Hugging Face
    weights (every 2-D ``model.layers.*.weight``): the layers the policy's ``match_all_linear`` adapts (it
    never adapts the embedding or the output head, which lie outside the decoder layers)."""
    linears: dict[str, tuple[int, int]] = {}
    for name, (shape, _) in manifest.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and len(shape) == 2 and ".layers." in f".{module}.":
            linears[module] = (int(shape[0]), int(shape[1]))
    return linears


@dataclass(frozen=True)
class AdapterLayout:
    """The policy's LoRA adapters as a generation engine sees them."""

    scale: float
    """``alpha / dim``: the update is ``scale * B A``."""
    dim: int
    """The adapters' rank ``r``."""
    targets: dict[str, tuple[int, int]]
    """``{module: (out, in)}`` of the adapted layers, in module order."""
    dtype_name: str
    """The generation dtype (adapters travel in it)."""

    @classmethod
    def from_policy_config(
        cls, cfg: PolicyConfig, base_manifest: ShapeManifest, dtype_name: str
    ) -> AdapterLayout | None:
        """The layout of the policy's :func:`unmerged_adapters` on the engine whose weights ``base_manifest``
        lists, with adapters in the generation dtype ``dtype_name``; ``None`` when there are none."""
        lora_cfg = unmerged_adapters(cfg)
        if lora_cfg is None:
            return None
        linears = adaptable_linears(base_manifest)
        targets = select_lora_targets(list(linears), lora_cfg)
        return cls(
            scale=lora_cfg.alpha / lora_cfg.dim,
            dim=lora_cfg.dim,
            targets={module: linears[module] for module in targets},
            dtype_name=dtype_name,
        )

    def adapter_manifest(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (shape, dtype name)}`` of every adapter tensor."""
        manifest: dict[str, tuple[tuple[int, ...], str]] = {}
        for module, (out_features, in_features) in self.targets.items():
            manifest[f"{module}.lora_A"] = ((self.dim, in_features), self.dtype_name)
            manifest[f"{module}.lora_B"] = ((out_features, self.dim), self.dtype_name)
        return manifest

    def manifest(
        self, base_manifest: ShapeManifest, scope: RefitScope
    ) -> dict[str, tuple[tuple[int, ...], str]]:
        """What a refit of ``scope`` delivers: the base weights and the adapters, or the adapters alone."""
        if check_scope(scope) == "adapters":
            return self.adapter_manifest()
        return {**base_manifest, **self.adapter_manifest()}

    def adapter_nbytes(self) -> int:
        """Bytes of all adapter tensors in the generation dtype."""
        itemsize = getattr(torch, self.dtype_name).itemsize
        return sum((o + i) * self.dim * itemsize for o, i in self.targets.values())


def base_manifest_for(
    layout: AdapterLayout | None, base: ShapeManifest, scope: RefitScope
) -> dict[str, tuple[tuple[int, ...], str]]:
    """The manifest of a refit of ``scope`` into an engine with ``base`` weights and adapters ``layout``;
    raises ``ValueError`` for an adapters-only refit into an engine that knows no adapters."""
    if layout is not None:
        return layout.manifest(base, scope)
    if check_scope(scope) != "full":
        raise ValueError(
            "an adapters-only refit reached a generation engine without LoRA: "
            "policy.dtensor_cfg.lora_cfg.enabled must be the same for the policy and the generation workers"
        )
    return dict(base)


def refuse_after_draining(named: Iterable[tuple[str, torch.Tensor]], engine: str) -> NoReturn:
    """Refuse an adapters-only refit into ``engine``, which holds no base weights, once the whole stream is
    taken off the wire: the senders and the other receivers finish the refit instead of waiting on this one."""
    for _ in named:
        pass
    raise RefitIntegrityError(
        f"an adapters-only refit reached {engine} that holds no base weights (a fresh or restarted engine): "
        "the driver must send a full refit first"
    )


class MergedAdapters:
    """Folds arriving adapters into their layers' weights, exactly, from a kept copy of each base weight."""

    def __init__(self, layout: AdapterLayout) -> None:
        self.layout = layout
        self._base: dict[str, torch.Tensor] = {}
        # The adapters last merged into each layer (small): the refit guard re-derives the merge from them.
        self._adapters: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def holds_base(self) -> bool:
        """Whether every adapted layer's base weight is held (a full refit completed)."""
        return len(self._base) == len(self.layout.targets)

    def forget_base(self) -> None:
        """Drop the base copies (the engine's weights were replaced by other means): only a full refit may
        follow."""
        self._base.clear()
        self._adapters.clear()

    def merge(
        self, named: Iterable[tuple[str, torch.Tensor]], scope: RefitScope
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream a refit of ``scope`` delivers, with each adapted layer's ``weight`` replaced by the merged
        one and the adapters consumed; raises :class:`RefitIntegrityError` when an adapters-only refit reaches
        an engine that holds no base weights, or when a layer's parts do not all arrive."""
        if check_scope(scope) == "adapters" and not self.holds_base:
            refuse_after_draining(named, "a generation engine")
        if scope == "full":
            self._base.clear()
            self._adapters.clear()
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            module, _, leaf = name.rpartition(".")
            if module not in self.layout.targets or leaf not in ("weight", "lora_A", "lora_B"):
                yield name, tensor
                continue
            # Copies: refit hands out views into transfer buffers that the next pair reuses.
            if leaf == "weight":
                self._base[module] = tensor.detach().clone()
            else:
                parts.setdefault(module, {})[leaf] = tensor.detach().clone()
            held = parts.get(module, {})
            if module in self._base and len(held) == 2:
                self._adapters[module] = parts.pop(module)
                weight = merge_lora(self._base[module], held["lora_A"], held["lora_B"], self.layout.scale)
                yield f"{module}.weight", weight
        incomplete = sorted(parts) + (
            sorted(set(self.layout.targets) - set(self._base)) if scope == "full" else []
        )
        if incomplete:
            self._base.clear()
            raise RefitIntegrityError(
                f"adapted layers whose weight or adapters did not arrive: {format_names(incomplete)}"
            )

    def as_sent(
        self, held: Mapping[str, Checksum], weights: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> dict[str, Checksum]:
        """The refit guard's checksums ``held`` of the engine's ``weights`` as a refit sent them: an adapted
        layer that holds exactly the merge of its kept base and adapters reports those (as sent); one that does
        not keeps its merged weight's checksum, which matches nothing sent, so the guard names the layer."""
        as_sent = dict(held)
        for module, adapters in self._adapters.items():
            base = self._base[module]
            merged = merge_lora(base, adapters["lora_A"], adapters["lora_B"], self.layout.scale)
            weight = weights[f"{module}.weight"]
            if torch.equal(merged.to(device=weight.device, dtype=weight.dtype), weight):
                as_sent[f"{module}.weight"] = tensor_checksum(base, dtype)
            for leaf, tensor in adapters.items():
                as_sent[f"{module}.{leaf}"] = tensor_checksum(tensor, dtype)
        return as_sent
