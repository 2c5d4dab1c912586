"""The torch dtypes of ``policy.precision``, at the floor of ``models/`` so every backend (DTensor, Megatron)
and the checkpoint readers below the policy reach them without importing the policy package."""

from __future__ import annotations

import torch

PRECISION_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""``policy.precision`` -> the dtype the model's parameters are kept in."""
