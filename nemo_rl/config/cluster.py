"""Schema of the ``cluster`` section: how many worker slots the run reserves, and how long it waits for them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nemo_rl.config.base import ConfigModel


class ClusterConfig(ConfigModel):
    """The worker slots of a run: ``num_nodes`` x ``gpus_per_node`` Ray placement-group bundles."""

    gpus_per_node: int = Field(default=1, ge=1)
    """Worker slots per node. With CUDA each slot is one GPU (plus one CPU); on a machine without CUDA
    each slot is one CPU worker process, so the same recipe runs on a laptop."""

    num_nodes: int = Field(default=1, ge=1)
    """Nodes to reserve; each gets one placement group of ``gpus_per_node`` bundles packed on one node."""

    placement_timeout_s: float = Field(default=180.0, gt=0.0)
    """Seconds to wait for the placement groups before failing with a message naming the missing resources."""

    device_memory_gb: float | None = Field(default=None, gt=0.0)
    """Memory of one device in GiB, for the memory plan ``--dry-run`` prints and checks
    (``docs/memory.md``); ``None`` reads it from the first GPU ``nvidia-smi`` reports, and without one the plan
    is printed unchecked. Set it to plan for other GPUs than this machine's (e.g. ``80`` for an 80 GB H100)."""

    segment_size: int | None = None
    """Accepted, no effect here: nodes per NVLink domain, for topology-aware placement (a speed knob)."""

    master_port_range_low: int | None = None
    """Accepted, no effect here: rendezvous ports are picked free by the worker group."""

    master_port_range_high: int | None = None
    """Accepted, no effect here (see ``master_port_range_low``)."""

    single_process: Literal["auto"] | bool = "auto"
    """Run the whole job in the driver's process, without Ray, when its work fits one worker slot (one slot, the
    policy's worker hosting its generation engine, environments in the driver, no second model): the start then
    pays for no Ray daemons and no worker process. ``auto`` does so on a machine without CUDA where the run
    fits; ``true`` insists (a run that does not fit stops with the reason); ``false`` always starts Ray (to
    attach to a cluster, set ``RAY_ADDRESS``, which also rules it out). See docs/design.md."""

    @property
    def world_size(self) -> int:
        """Total worker slots: ``num_nodes * gpus_per_node``."""
        return self.num_nodes * self.gpus_per_node
