"""The embedded engine's key/value cache: preallocated, one row per sequence, rows left-aligned so that all
rows advance in lockstep (see :class:`KVCache`).

Tensor legend: L = layers, B = rows (sequences), K = key/value heads, S = cache slots, D = head dim.
"""

from __future__ import annotations

import torch

from nemo_rl.config.model_arch import ModelArch


class KVCache:
    """Preallocated keys and values, ``[L, 2, B, K, S, D]``, one row per sequence, rows *left-aligned*.

    Row ``b`` keeps position ``p`` in slot ``start_B[b] + p``, where :meth:`.model.DecoderLM.prefill` chooses the starts
    so that every prompt ends in the same slot. From then on all rows advance in lockstep: each decode step
    writes every row's new keys and values into one slot (a plain strided copy, no per-row scatter) and
    attends over the slots written so far, slots before a row's start masked out by ``mask_BK1S``, which is
    built once per prefill instead of once per step.
    """

    def __init__(
        self, arch: ModelArch, num_rows: int, num_positions: int, dtype: torch.dtype, device: torch.device
    ):
        # Zeros, not empty: masked slots are still read, and garbage NaN/inf there would poison the attention
        # output (0 * NaN = NaN) even with a zero attention weight.
        self.data = torch.zeros(
            (arch.num_layers, 2, num_rows, arch.num_kv_heads, num_positions, arch.head_dim),
            dtype=dtype,
            device=device,
        )
        self.start_B = torch.zeros(num_rows, dtype=torch.long, device=device)
        """Slot of each row's position 0."""
        self.mask_BK1S = torch.zeros(
            (num_rows, arch.num_kv_heads, 1, num_positions), dtype=dtype, device=device
        )
        """Additive attention mask per row and key/value head: ``-inf`` at the slots before the row's start."""
        # Per-layer views, taken once rather than at every step.
        self.keys = [self.data[layer, 0] for layer in range(arch.num_layers)]
        self.values = [self.data[layer, 1] for layer in range(arch.num_layers)]

    @property
    def num_rows(self) -> int:
        """Rows (sequences) the cache can hold."""
        return self.data.shape[2]

    @property
    def num_positions(self) -> int:
        """Slots (tokens) per row the cache can hold."""
        return self.data.shape[4]

    def set_starts(self, start_B: torch.Tensor) -> None:
        """Left-align rows ``0..B-1``: row ``b``'s position 0 goes to slot ``start_B[b]``."""
        num_rows = start_B.shape[0]
        self.start_B[:num_rows] = start_B
        slots_S = torch.arange(self.num_positions, device=start_B.device)
        before_BS = slots_S[None, :] < start_B[:, None]
        self.mask_BK1S[:num_rows] = torch.where(before_BS, float("-inf"), 0.0)[:, None, None, :]

    def select_rows(self, rows_N: torch.Tensor, num_slots: int) -> None:
        """Make row ``i`` a copy of old row ``rows_N[i]`` for ``i < N``, first ``num_slots`` slots (rows may repeat:
        compaction keeps the live rows, a prefill of distinct prompts fans them out to their repeats)."""
        n = rows_N.numel()
        self.data[:, :, :n, :, :num_slots] = self.data[:, :, rows_N, :, :num_slots]
        self.start_B[:n] = self.start_B[rows_N]
        self.mask_BK1S[:n] = self.mask_BK1S[rows_N]


def prefill_attention_mask(start_B: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: which key slots each query slot of a prefill over left-aligned rows sees.

    Query slot ``i`` sees key slots ``start..i``; a pad query (``i < start``) sees only itself, to stay finite.
    """
    slots_T = torch.arange(width, device=start_B.device)
    causal_TT = slots_T[None, :] <= slots_T[:, None]
    after_start_B1T = slots_T[None, None, :] >= start_B[:, None, None]
    diagonal_TT = slots_T[None, :] == slots_T[:, None]
    return ((causal_TT & after_start_B1T) | diagonal_TT)[:, None]
