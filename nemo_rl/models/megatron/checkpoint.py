"""Megatron policy checkpoints (resume) and moving the training state between host and device.

A checkpoint has two parts:

- **weights** (``weights_path``): the model as Hugging Face-named safetensors, one file per pipeline stage, in
  the training dtype (:func:`~nemo_rl.models.megatron.weights.write_stage_safetensors`). Any TP / PP / DP
  layout loads them, and so does ``from_pretrained``. With LoRA only the adapters are written (under their
  Hugging Face names, :attr:`~nemo_rl.models.megatron.weights.StageWeights.trained_rules`); the frozen base
  is ``policy.model_name``'s, which the worker records next to them.
- **optimizer** (``optimizer_path``): one file per rank with its optimizer's own state (Adam moments, step,
  float32 master weights, loss scale), the schedule's step count and the rank's random-number state (the
  process's generators and Megatron's named tracker states, which dropout in tensor-parallel regions draws
  from), plus ``layout.json``. A resumed run continues every generator where the checkpoint left it.
  Megatron keeps optimizer state per rank in the rank's own layout (sharded over data-parallel ranks with the
  distributed optimizer), so it reloads into the same TP / PP / DP layout and optimizer settings only;
  loading it into another one fails with a message saying which.

Loading weights without the optimizer re-derives the float32 master weights from the loaded weights, so a
weights-only load never trains on stale masters.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from nemo_rl.models.hf_decoder import SafetensorsReader
from nemo_rl.models.megatron.weights import StageWeights, write_stage_safetensors
from nemo_rl.utils.rng import get_rng_state, set_rng_state

LAYOUT_FILE = "layout.json"


def _parts(optimizer: MegatronOptimizer) -> list[Any]:
    """The optimizers inside Megatron's chained optimizer (one per parameter group kind)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(part: Any) -> list[torch.Tensor]:
    return [p for group in part.optimizer.param_groups for p in group["params"]]


class CheckpointParts(NamedTuple):
    """What a checkpoint holds of one rank."""

    weights: StageWeights
    """The rank's stage of the model."""
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    layout: dict[str, Any]
    """The run's parallel layout and optimizer settings, written by rank 0 and checked on load."""


def save(
    parts: CheckpointParts,
    *,
    weights_path: str,
    optimizer_path: str | None,
    writer: bool,
    file_index: int,
    num_files: int,
) -> None:
    """Write a checkpoint; a collective over all ranks. ``writer`` ranks (one per pipeline stage and
    expert-parallel rank) write their weights as file ``file_index`` of ``num_files``."""
    weights, optimizer, scheduler, layout = parts
    write_stage_safetensors(
        weights.iter_hf_tensors(None, weights.trained_rules),
        weights_path,
        writer=writer,
        file_index=file_index,
        num_files=num_files,
    )
    if optimizer_path is not None:
        os.makedirs(optimizer_path, exist_ok=True)
        state = {
            "parts": [
                {
                    "optimizer": part.optimizer.state_dict(),
                    "main_params": [p.detach().cpu() for p in _main_params(part)],
                    "grad_scaler": part.grad_scaler.state_dict()
                    if getattr(part, "grad_scaler", None)
                    else None,
                }
                for part in _parts(optimizer)
            ],
            "scheduler": scheduler.state_dict(),
            "param_names": list(weights.params),
            "rng": {"process": get_rng_state(), "megatron": get_cuda_rng_tracker().get_states()},
        }
        torch.save(state, Path(optimizer_path, f"rank{dist.get_rank():05d}.pt"))
        if dist.get_rank() == 0:
            Path(optimizer_path, LAYOUT_FILE).write_text(json.dumps(layout, indent=2, sort_keys=True) + "\n")
    dist.barrier()


@torch.no_grad()
def load(
    parts: CheckpointParts,
    *,
    weights_path: str,
    optimizer_path: str | None,
) -> None:
    """Load what :func:`save` wrote (the optimizer part only with ``optimizer_path``)."""
    weights, optimizer, scheduler, layout = parts
    weights.load(SafetensorsReader(weights_path).get, weights.trained_rules)
    # Float32 master weights (bfloat16 training, distributed optimizer) follow the loaded weights...
    optimizer.reload_model_params()
    if optimizer_path is not None:
        saved_layout = json.loads(Path(optimizer_path, LAYOUT_FILE).read_text())
        if saved_layout != layout:
            changed = sorted(
                k for k in set(saved_layout) | set(layout) if saved_layout.get(k) != layout.get(k)
            )
            raise ValueError(
                f"the optimizer state in {optimizer_path} was saved with a different layout ("
                + ", ".join(f"{k}: saved {saved_layout.get(k)}, now {layout.get(k)}" for k in changed)
                + "); Megatron optimizer state reloads into the same layout only: restore those settings, "
                "or load the weights alone (weights_path without optimizer_path)"
            )
        state = torch.load(Path(optimizer_path, f"rank{dist.get_rank():05d}.pt"), weights_only=False)
        if state["param_names"] != list(weights.params):
            raise ValueError(
                f"the optimizer state in {optimizer_path} was saved for other parameters on this rank"
            )
        for part, saved in zip(_parts(optimizer), state["parts"], strict=True):
            # ...unless the checkpoint has them: they are exact where the weights may be rounded.
            for param, value in zip(_main_params(part), saved["main_params"], strict=True):
                param.copy_(value)
            part.optimizer.load_state_dict(saved["optimizer"])
            if saved["grad_scaler"] is not None:
                part.grad_scaler.load_state_dict(saved["grad_scaler"])
        scheduler.num_steps = int(state["scheduler"]["num_steps"])
        scheduler.step(increment=0)
        # Absent from older checkpoints: the generators then continue as seeded.
        if "rng" in state:
            set_rng_state(state["rng"]["process"])
            get_cuda_rng_tracker().set_states(dict(state["rng"]["megatron"]))
    dist.barrier()


# --------------------------------------------------------------------------------- host <-> device moves
def move_model(model: DistributedDataParallel, device: str) -> None:
    """Move the weights and gradient buffers of ``model`` to ``device`` (``"cpu"`` or ``"cuda"``; CUDA only)."""
    for buffer in model.buffers + model.expert_parallel_buffers:
        if device == "cpu":
            buffer.offload_to_cpu(move_params=True, move_grads=True)
        else:
            buffer.reload_from_cpu(move_params=True, move_grads=True)
    # Without the distributed optimizer the weights are not in the buffers: move them one by one.
    in_buffers = {id(p) for buffer in model.buffers + model.expert_parallel_buffers for p in buffer.params}
    has_param_buffer = any(buffer.param_data is not None for buffer in model.buffers)
    for param in model.parameters():
        if not has_param_buffer or id(param) not in in_buffers:
            param.data = param.data.to(device, non_blocking=True)


def move_optimizer_state(model: DistributedDataParallel, optimizer: MegatronOptimizer, device: str) -> None:
    """Move the optimizer's moments and its own float32 master weights to ``device`` (CUDA only).

    Master weights that are the model's own parameters (float32 training without the distributed optimizer)
    stay: they move with the model.
    """
    model_params = {id(p) for p in model.parameters()}
    for part in _parts(optimizer):
        for param in _main_params(part):
            if id(param) not in model_params:
                param.data = param.data.to(device, non_blocking=True)
        for state in part.optimizer.state.values():
            for key, value in state.items():
                # Adam's step counters stay where the optimizer created them.
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
