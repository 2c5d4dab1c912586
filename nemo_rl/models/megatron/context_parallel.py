"""Context parallelism on the Megatron backend (``policy.megatron_cfg.context_parallel_size``), with
megatron-core's own context-parallel attention: Transformer Engine's, so CUDA only.

Megatron's layout is the DTensor backend's (``nemo_rl/models/policy/context_parallel.py``): a row of ``T``
tokens is cut into ``2 x CP`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2 CP - 1 - r`` (what
megatron-core's ``get_batch_on_this_cp_rank`` gives, and what its rotary embedding slices for each rank). So the
worker feeds each rank its tokens (:meth:`MegatronContextParallel.split`), megatron-core's attention exchanges
keys and values between the ranks, and the last stage's output is gathered back to full rows
(:meth:`MegatronContextParallel.gather`, the DTensor backend's gather: every CP rank then computes the same loss
on the same rows, and the gather's backward keeps each rank's slice of its gradient). Megatron's data-parallel
gradient reduction already runs over ``DP x CP``, where the ranks' gradients (each from its own tokens) sum to
the unsplit one.

Not built on CPU: megatron-core's local attention asserts CP = 1, and Transformer Engine has no CPU build (the
config refuses CP > 1 where Transformer Engine is not installed; the worker where it would not be used).
``tools/gpu_check.sh`` compares a CP=2 step with CP=1 on two GPUs.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from nemo_rl.models.policy.context_parallel import (
    ContextParallelLayout,
    chunk_indices,
    gather_identical_output,
    gathered_order,
)


class MegatronContextParallel:
    """This rank's share of each row, and the gather of the last stage's output back to full rows."""

    def __init__(self) -> None:
        self.group = parallel_state.get_context_parallel_group()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self._layout: ContextParallelLayout | None = None

    def split(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens and their global positions (``T`` must be a multiple of ``2 x CP``); the
        layout is kept for the next :meth:`gather`."""
        seq_len = ids_BT.shape[1]
        local_S = chunk_indices(seq_len, self.cp_size, self.cp_rank, ids_BT.device)
        self._layout = ContextParallelLayout(
            self.group, self.cp_rank, local_S, gathered_order(seq_len, self.cp_size, ids_BT.device), None
        )
        return ids_BT[:, local_S], positions_BT[:, local_S]

    def gather(self, output_BS: torch.Tensor) -> torch.Tensor:
        """The last stage's ``[B, S, ...]`` output of the last :meth:`split` rows -> ``[B, T, ...]``."""
        assert self._layout is not None, "gather() before split()"
        return gather_identical_output(output_BS, self._layout)


def context_parallel_for(cp_size: int, uses_transformer_engine: bool) -> MegatronContextParallel | None:
    """The worker's context parallelism (None at CP = 1); refuses CP > 1 without Transformer Engine layers."""
    if cp_size == 1:
        return None
    if not uses_transformer_engine:
        raise ValueError(
            f"policy.megatron_cfg.context_parallel_size={cp_size} needs Transformer Engine's attention, which "
            "this worker does not build (no CUDA, transformer_impl=local, LoRA or a mixture-of-experts model): "
            "set it to 1, or use policy.dtensor_cfg.context_parallel_size"
        )
    return MegatronContextParallel()
