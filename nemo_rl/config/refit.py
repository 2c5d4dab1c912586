"""Schema of ``policy.refit``: how weights move from the policy workers to the generation workers, and the
refit guard that checks what the engines then hold (docs/reliability.md, "The refit guard")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nemo_rl.config.base import ConfigModel


class RefitGuardConfig(ConfigModel):
    """Checks, after each refit, that the generation engines hold what the policy sent (docs/reliability.md,
    "The refit guard")."""

    checksums: bool = True
    """After every refit through a transport, compare a checksum of each tensor that arrived (verified against
    the sender's bucket checksums) with the same checksum of what each engine then holds; a difference names
    the tensor (or the tensors an engine fuses into one parameter) and acts as ``on_mismatch`` says. Costs one
    pass over the weights on each side per refit (benchmarks/bench_refit_guard.py)."""

    max_gen_kl_error: float | None = Field(default=None, gt=0.0)
    """The probe: a synchronous GRPO step whose ``gen_kl_error`` (the KL between the engine's sampling
    log-probs and the policy's for the same tokens and weights) exceeds this acts as ``on_mismatch`` says,
    naming the tensors whose checksums differ, or saying that none does (then the engine computes differently:
    a kernel, a dtype, sampling settings). ``None``: no probe. Typical values: ~1e-6 in float32 on CPU, ~1e-3
    in bfloat16 (docs/reliability.md)."""

    on_mismatch: Literal["stop", "refit", "warn"] = "stop"
    """What a difference does: ``stop`` ends the run with one line naming the tensor (the last checkpoint is
    intact); ``refit`` sends every weight again and checks once more, stopping if the difference stays;
    ``warn`` prints the line and goes on."""


class RefitConfig(ConfigModel):
    """How weights move from the policy workers to the generation workers ("refit")."""

    transport: Literal["auto", "shared_memory", "collective"] = "auto"
    """``auto`` uses shared memory when generation is colocated with the policy (same nodes) and a
    collective broadcast otherwise; the other values force a transport."""

    timeout_s: float = Field(default=600.0, gt=0.0)
    """Seconds a refit may take before it fails, naming the workers it was waiting for."""

    guard: RefitGuardConfig = Field(default_factory=RefitGuardConfig)
    """Checks that the engines hold what was sent (on by default)."""
