"""The refit methods vLLM adds to its own GPU worker: the reload of a refit's stream and the refit guard's
checksums of what the worker then holds.

``vllm.LLM(worker_extension_cls=WORKER_EXTENSION_CLS)`` makes :class:`VllmWorkerExtension` a base class of
vLLM's worker, so ``LLM.collective_rpc("nemo_rl_reload_hf_weights", args=(stream,))`` runs that method on
every vLLM worker of the engine with ``self`` being that worker. nemo_rl's engines run vLLM's worker in the
actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni-process or external-launcher executor), so
the argument is the caller's live iterator, not a pickled copy.

Method names carry a ``nemo_rl_`` prefix: vLLM refuses an extension whose attributes clash with its worker's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from nemo_rl.models.hf_moe import per_expert_weights
from nemo_rl.weight_sync.checksums import Checksum, tensor_checksum
from nemo_rl.weight_sync.errors import RefitIntegrityError
from nemo_rl.weight_sync.manifest import format_names

logger = logging.getLogger(__name__)


@contextmanager
def reported_loaded_names(model: Any) -> Iterator[list[set[str] | None]]:
    """While open, record what ``model.load_weights`` (a vLLM model) reports as loaded (vLLM's own reload
    discards it).

    Yields a one-element list that receives the union of the reported names, or ``None`` when the model's
    loader reports nothing. The wrapper sits on the instance and is removed on exit.
    """
    original: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] = model.load_weights
    reported: list[set[str] | None] = [set()]

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        names = original(weights)
        if names is None:
            reported[0] = None
        elif reported[0] is not None:
            reported[0].update(names)
        return names

    # A plain function is neither a Parameter nor a Module: nn.Module stores it in the instance __dict__,
    # where it shadows the class method until deleted.
    model.load_weights = load_weights
    try:
        yield reported
    finally:
        del model.load_weights


def check_all_loaded(expected: set[str], reported: set[str] | None, where: str) -> None:
    """Raise :class:`RefitIntegrityError` naming the vLLM parameters of ``expected`` that the model's loader
    did not report as loaded (they would keep stale values); ``reported=None`` (no report) passes."""
    if reported is None:
        logger.warning("%s: the model's load_weights reports no names; the loaded set is not checked", where)
        return
    not_loaded = expected - reported
    if not_loaded:
        raise RefitIntegrityError(
            f"{where}: vLLM's load_weights did not load {len(not_loaded)} parameters of the model, which keep "
            f"their old values: {format_names(not_loaded)} (does the refit stream carry every weight under "
            "its Hugging Face name?)"
        )


def keep_cpu_linear_weights_in_place() -> None:
    """On vLLM's CPU platform, run 2-D linear layers on their own weight parameters (call before the engine).

    vLLM's CPU build packs each linear weight into a kernel-private buffer after loading (oneDNN or SGL
    kernels) and empties the parameter. Its in-place reload then writes new values that those kernels never
    read: a refitted CPU engine would keep generating from its first weights. Routing 2-D linear layers
    through ``torch.nn.functional.linear`` on ``layer.weight`` keeps the parameters the kernels use, so a
    reload updates what generation reads. Other layers (MoE expert tensors, convolutions) keep vLLM's dispatch.
    """
    from vllm.model_executor.layers import utils as layer_utils

    packing_dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(packing_dispatch, "nemo_rl_in_place", False):
        return

    def dispatch_in_place(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            packing_dispatch(layer, remove_weight)
            return
        # Called as (x, layer.weight, bias). setattr: nn.Module's attribute typing admits tensors and modules.
        setattr(layer, "cpu_linear", torch.nn.functional.linear)  # noqa: B010

    dispatch_in_place.nemo_rl_in_place = True  # type: ignore[attr-defined]
    # linear.py and vocab_parallel_embedding.py import the dispatch from this module at each call.
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_in_place


@contextmanager
def repacked_cpu_moe_experts(model: torch.nn.Module) -> Iterator[int]:
    """While open, make vLLM's in-place reload repack the expert weights of its CPU MoE kernel.

    vLLM 0.32's CPU MoE experts (``CPUUnquantizedExperts`` and subclasses) repack ``w13_weight`` and
    ``w2_weight`` into the kernel's grouped-gemm layout (``cpu_prepack_moe_weight``) in their
    ``process_weights_after_loading``, which the unquantized MoE method calls on the first load only: on a
    weight update it copies the new, unpacked, weights over the packed ones, and the kernel reads them in its
    packed order. Each such layer's method instance gets a wrapper that runs the experts' own post-load step
    (pad, then repack) on the freshly loaded weights after the method's, before the reload copies them into
    the kernel's storage. Yields the number of layers wrapped; the wrappers are removed on exit.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    methods: list[Any] = []
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is None or not isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            continue
        original: Callable[[torch.nn.Module], None] = method.process_weights_after_loading

        def process_and_repack(
            layer: torch.nn.Module,
            original: Callable[[torch.nn.Module], None] = original,
            method: Any = method,
        ) -> None:
            original(layer)
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        # An instance attribute shadows the class method until deleted (the method is no nn.Module).
        method.process_weights_after_loading = process_and_repack
        methods.append(method)
    try:
        yield len(methods)
    finally:
        for method in methods:
            del method.process_weights_after_loading


LAYERWISE_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""vLLM's in-place reload, which warns "<Layer>: Failed to load weights" for every layer the stream holds no
tensor for (a tied output head, a rotary cache) and then keeps that layer's current tensors."""


class _DropExpectedReloadWarnings(logging.Filter):
    """Drops the layer-level "Failed to load weights" warnings of vLLM's reload: on each refit they name the
    tied head and the rotary cache, which a Hugging Face stream never carries. Parameters the stream should
    have loaded are still caught, by :func:`check_all_loaded`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in str(record.msg)


class VllmWorkerExtension:
    """Refit hook mixed into vLLM's GPU worker (see the module docstring)."""

    if TYPE_CHECKING:
        # Set by vLLM's worker, of which this class becomes a base. Declared for the type checker only:
        # vLLM rejects an extension class that defines attributes its worker already has.
        model_runner: Any
        vllm_config: Any

        def reload_weights(self, *args: Any, **kwargs: Any) -> None: ...

    def nemo_rl_reload_hf_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load a stream of Hugging Face-named FULL tensors through vLLM's in-place weight reload.

        ``Worker.reload_weights`` (vLLM 0.32) runs the model's ``load_weights`` (HF names onto vLLM's fused
        parameters, each tensor-parallel rank keeping its slice) layer by layer with the model's
        post-loading processing (quantisation, repacking) and copies the result into the existing
        parameter storage, so CUDA graphs stay valid. Every parameter the model had before must be reported
        loaded, else :class:`RefitIntegrityError`; vLLM itself only warns. Returns the bytes received.
        """
        model = self.model_runner.get_model()
        device = next(model.parameters()).device
        lora = self.vllm_config.lora_config is not None
        # vLLM's own completeness check uses the same names: kernel-format parameters before the reload.
        expected = {
            name.replace(".base_layer.", ".") if lora else name for name, _ in model.named_parameters()
        }
        num_bytes = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal num_bytes
            for name, tensor in named_tensors:
                num_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        def on_device() -> Iterator[tuple[str, torch.Tensor]]:
            # vLLM's MoE loaders read checkpoint names, one linear per expert: a refit sends experts so, and 3-D
            # expert tensors (transformers 5's in-memory layout) given any other way are split here.
            for name, tensor in per_expert_weights(counted()):
                # A copy: refit hands out views into transfer buffers that the next pair reuses, and vLLM's
                # layer-wise reload holds every tensor of a layer until the whole layer has arrived.
                yield name, tensor.to(device=device, copy=True)

        reload_logger = logging.getLogger(LAYERWISE_RELOAD_LOGGER)
        if not any(isinstance(f, _DropExpectedReloadWarnings) for f in reload_logger.filters):
            reload_logger.addFilter(_DropExpectedReloadWarnings())
        # Only vLLM's CPU build repacks MoE weights after loading; its CUDA kernels read the parameters.
        repacking = repacked_cpu_moe_experts(model) if device.type == "cpu" else nullcontext(0)
        with reported_loaded_names(model) as reported, repacking:
            self.reload_weights(weights_iterator=on_device(), is_checkpoint_format=True)
        if self.vllm_config.model_config.quantization is None:
            check_all_loaded(expected, reported[0], "vLLM refit")
        else:
            # Quantised kernels hold parameters under other names than the checkpoint (vLLM skips this check
            # too); the stream was still checked against the Hugging Face manifest.
            logger.debug("quantised vLLM model: the loaded-name check is skipped")
        return num_bytes

    def nemo_rl_weight_checksums(self) -> dict[str, Checksum] | None:
        """The refit guard's checksums of this worker's parameters (:mod:`nemo_rl.weight_sync.checksums`), in
        the model's dtype, named as vLLM names them (a LoRA layer's ``base_layer`` as the layer itself; the
        adapters, kept outside the parameters, are not reported). ``None`` for a quantised model."""
        if self.vllm_config.model_config.quantization is not None:
            return None
        model = self.model_runner.get_model()
        dtype = self.vllm_config.model_config.dtype
        return {
            name.replace(".base_layer.", "."): tensor_checksum(param, dtype)
            for name, param in model.named_parameters()
        }
