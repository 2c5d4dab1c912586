"""Methods vLLM adds to its own GPU worker class, for refit.

``vllm.LLM(worker_extension_cls=WORKER_EXTENSION_CLS)`` makes :class:`VllmWorkerExtension` a base class of
vLLM's worker, so ``LLM.collective_rpc("nemo_rl_load_hf_weights", args=(stream,))`` runs the method below on
every vLLM worker of the engine with ``self`` being that worker. nemo_rl's engines run vLLM's worker in the
actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni-process or external-launcher executor), so
the argument is the caller's live iterator, not a pickled copy.

Method names carry a ``nemo_rl_`` prefix: vLLM refuses an extension whose attributes clash with its worker's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch


class VllmWorkerExtension:
    """Refit hooks mixed into vLLM's GPU worker (see the module docstring)."""

    if TYPE_CHECKING:
        # Set by vLLM's worker, of which this class becomes a base. Declared for the type checker only:
        # vLLM rejects an extension class that defines attributes its worker already has.
        model_runner: Any

    def nemo_rl_load_hf_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a stream of Hugging Face-named FULL tensors with the model's own ``load_weights``.

        vLLM's loader maps HF names onto its fused parameters (e.g. q/k/v into ``qkv_proj``) and, on a
        tensor-parallel rank, keeps the slice that rank owns. Returns the bytes received.
        """
        model = self.model_runner.model
        device = next(model.parameters()).device
        num_bytes = 0

        def on_device() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal num_bytes
            for name, tensor in named_tensors:
                num_bytes += tensor.numel() * tensor.element_size()
                # A copy: refit hands out views into transfer buffers that the next pair reuses, and some
                # vLLM loaders hold on to a tensor until the weights it is fused with have arrived.
                yield name, tensor.to(device=device, copy=True)

        model.load_weights(weights=on_device())
        return num_bytes
