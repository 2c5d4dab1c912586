"""The placement groups ("bundles") that worker groups are scheduled onto (Ray itself starts in
:mod:`nemo_rl.distributed.ray_start`).

A :class:`RayVirtualCluster` reserves ``cluster.num_nodes`` placement groups of ``cluster.gpus_per_node`` bundles
each (one group per node, ``STRICT_PACK``). A bundle is ``{"GPU": 1, "CPU": 1}`` when the Ray cluster has GPUs
and ``{"CPU": 1}`` otherwise, so on a machine without CUDA every "GPU" is a CPU worker slot and the same
recipe runs unchanged.

Bundles are numbered globally, node-major: bundle ``b`` is bundle ``b % gpus_per_node`` of the placement
group of node ``b // gpus_per_node``. Worker groups share bundles in colocated mode (each actor takes
``1 / max_colocated_worker_groups`` of its bundle). For non-colocated generation, either

- give the two :class:`~nemo_rl.distributed.worker_groups.RayWorkerGroup` objects disjoint ``bundle_indices``
  of one cluster (e.g. policy ``[0, 1]``, generation ``[2, 3]``), or
- build a second :class:`RayVirtualCluster` for generation, which reserves placement groups of its own.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.distributed.lost_calls import LostCalls
from nemo_rl.distributed.ray_start import init_ray


class PlacementTimeoutError(TimeoutError):
    """The Ray cluster could not place the requested bundles within ``cluster.placement_timeout_s``."""


@dataclass(frozen=True)
class BundleLocation:
    """Where one bundle of a :class:`RayVirtualCluster` lives."""

    bundle_index: int
    """Global index of the bundle in the cluster (node-major)."""

    placement_group: PlacementGroup
    """The placement group holding the bundle."""

    pg_bundle_index: int
    """Index of the bundle inside its placement group."""

    node_id: str
    """Ray node id (hex) of the node the bundle was placed on."""

    node_ip: str
    """IP address of that node."""


# Ports handed out by free_port start here: above Ray's default worker ports (10002-19999).
_FREE_PORT_LOW = 20000


def _ephemeral_port_start() -> int:
    """First port of the range the kernel gives sockets bound to port 0 (Linux's default range starts at 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port that is free on this machine, for a rendezvous another process binds later.

    Taken below the kernel's ephemeral range where there is room: between this choice and the bind, any
    connection's automatic port (gloo opens many) could otherwise land on it.
    """
    high = _ephemeral_port_start()
    candidates = [random.randrange(_FREE_PORT_LOW, high) for _ in range(32)] if high > _FREE_PORT_LOW else []
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError("no free TCP port on this machine")


_find_free_port = ray.remote(num_cpus=0)(free_port)
"""``free_port`` as a task, to run on another node."""


def _fmt_resources(resources: Mapping[str, float], keys: Sequence[str]) -> str:
    """``{CPU: 8, GPU: 0}`` for the resource ``keys`` that bundles use."""
    return "{" + ", ".join(f"{key}: {resources.get(key, 0.0):g}" for key in keys) + "}"


class RayVirtualCluster:
    """The placement groups of one run: ``cfg.num_nodes`` x ``cfg.gpus_per_node`` bundles.

    The constructor starts Ray if needed (:func:`~nemo_rl.distributed.ray_start.init_ray`) and blocks until every bundle is placed, raising
    :class:`PlacementTimeoutError` after ``cfg.placement_timeout_s`` with the resources asked for and the
    resources Ray has. Call :meth:`shutdown` to release the bundles.
    """

    def __init__(
        self, cfg: ClusterConfig, name: str = "nemo_rl", max_colocated_worker_groups: int = 2
    ) -> None:
        if max_colocated_worker_groups < 1:
            raise ValueError(f"max_colocated_worker_groups must be >= 1, got {max_colocated_worker_groups}")
        init_ray(cfg)
        self.cfg = cfg
        self.name = name
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.use_gpus = ray.cluster_resources().get("GPU", 0.0) >= 1.0
        self.bundle_resources: dict[str, float] = {"GPU": 1.0, "CPU": 1.0} if self.use_gpus else {"CPU": 1.0}
        self._placement_groups: list[PlacementGroup] = [
            placement_group(
                [dict(self.bundle_resources) for _ in range(cfg.gpus_per_node)],
                strategy="STRICT_PACK",
                name=f"{name}-node{node}",
            )
            for node in range(cfg.num_nodes)
        ]
        # Before the wait: a placement that times out shuts the cluster down, which reads it.
        self.lost_calls = LostCalls()
        """Failed worker calls nobody waited for, raised by :meth:`shutdown`."""
        self._wait_for_placement()
        self._locations = self._resolve_locations()
        # Which worker groups hold each bundle, so a group too many fails at once instead of never scheduling.
        self._occupants: list[list[str]] = [[] for _ in range(self.world_size)]

    @property
    def world_size(self) -> int:
        """Number of bundles (worker slots) in the cluster."""
        return self.cfg.world_size

    @property
    def placement_groups(self) -> list[PlacementGroup]:
        """The placement groups, one per node, in node order."""
        return list(self._placement_groups)

    def bundle_locations(self) -> list[BundleLocation]:
        """Where every bundle lives, indexed by global bundle index."""
        return list(self._locations)

    def actor_resources(self) -> dict[str, float]:
        """Resources one actor of a colocated worker group takes from its bundle: a share of each resource."""
        share = 1.0 / self.max_colocated_worker_groups
        return {
            "num_cpus": self.bundle_resources["CPU"] * share,
            "num_gpus": self.bundle_resources.get("GPU", 0.0) * share,
        }

    def get_master_address_and_port(self, bundle_index: int = 0) -> tuple[str, int]:
        """IP of the node of bundle ``bundle_index`` and a TCP port found free on that node."""
        location = self._location(bundle_index)
        if location.node_id == ray.get_runtime_context().get_node_id():
            # The driver's own node: no task, whose worker process would take a second or more to start.
            return location.node_ip, free_port()
        task = _find_free_port.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(location.node_id, soft=False)
        )
        port = ray.get(task.remote(), timeout=self.cfg.placement_timeout_s)
        return location.node_ip, int(port)

    def reserve_bundles(self, bundle_indices: Sequence[int], owner: str) -> None:
        """Record that worker group ``owner`` runs one actor on each of ``bundle_indices``.

        Raises ``ValueError`` when a bundle already holds ``max_colocated_worker_groups`` groups, since the
        actor would never be scheduled.
        """
        for index in bundle_indices:
            self._location(index)
        full = [i for i in bundle_indices if len(self._occupants[i]) >= self.max_colocated_worker_groups]
        if full:
            raise ValueError(
                f"worker group {owner!r} cannot share bundles {full} of cluster {self.name!r}: they already hold "
                f"{self.max_colocated_worker_groups} worker groups ({sorted({o for i in full for o in self._occupants[i]})}). "
                "Shut one of them down, raise max_colocated_worker_groups, or use other bundle_indices"
            )
        for index in bundle_indices:
            self._occupants[index].append(owner)

    def release_bundles(self, bundle_indices: Sequence[int], owner: str) -> None:
        """Undo :meth:`reserve_bundles` for ``owner`` (a no-op for bundles it does not hold)."""
        for index in bundle_indices:
            if owner in self._occupants[index]:
                self._occupants[index].remove(owner)

    def shutdown(self) -> None:
        """Remove the placement groups (killing any actor still on them); safe to call twice.

        Raises:
            LostCallError: worker calls on this cluster failed that nobody waited for (see
                :mod:`nemo_rl.distributed.lost_calls`); raised once, after the placement groups are gone.
        """
        for pg in self._placement_groups:
            remove_placement_group(pg)
        self._placement_groups = []
        self.lost_calls.raise_reported()

    def _location(self, bundle_index: int) -> BundleLocation:
        if not 0 <= bundle_index < self.world_size:
            raise IndexError(
                f"bundle index {bundle_index} is outside cluster {self.name!r} of {self.world_size} bundles"
            )
        return self._locations[bundle_index]

    def _wait_for_placement(self) -> None:
        timeout_s = self.cfg.placement_timeout_s
        ready_refs = [pg.ready() for pg in self._placement_groups]
        _, not_ready = ray.wait(ready_refs, num_returns=len(ready_refs), timeout=timeout_s)
        if not not_ready:
            return
        message = self._placement_failure_message(len(not_ready))
        self.shutdown()
        raise PlacementTimeoutError(message)

    def _placement_failure_message(self, num_unplaced: int) -> str:
        cfg = self.cfg
        keys = list(self.bundle_resources)
        asked = {key: value * cfg.world_size for key, value in self.bundle_resources.items()}
        available = ray.available_resources()
        missing = {key: value - available.get(key, 0.0) for key, value in asked.items()}
        short = {key: value for key, value in missing.items() if value > 0}
        nodes = [_fmt_resources(node["Resources"], keys) for node in ray.nodes() if node.get("Alive")]
        slot = "GPUs" if self.use_gpus else "CPU worker slots"
        return (
            f"cluster {self.name!r}: {num_unplaced} of {cfg.num_nodes} placement groups were not placed within "
            f"cluster.placement_timeout_s={cfg.placement_timeout_s:g} s. "
            f"Asked for cluster.num_nodes={cfg.num_nodes} x cluster.gpus_per_node={cfg.gpus_per_node} bundles of "
            f"{_fmt_resources(self.bundle_resources, keys)}, {_fmt_resources(asked, keys)} in total, each node's "
            f"bundles on one node. Ray has {_fmt_resources(ray.cluster_resources(), keys)} in total and "
            f"{_fmt_resources(available, keys)} available"
            f"{f' (short by {_fmt_resources(short, list(short))})' if short else ''}; "
            f"its nodes have {', '.join(nodes)}. Lower cluster.gpus_per_node (the {slot} one node must hold) or "
            "cluster.num_nodes, free resources held by other placement groups or actors, or attach to a bigger "
            "Ray cluster with RAY_ADDRESS."
        )

    def _resolve_locations(self) -> list[BundleLocation]:
        node_ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        locations: list[BundleLocation] = []
        for node, pg in enumerate(self._placement_groups):
            bundle_nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
            for pg_bundle in range(self.cfg.gpus_per_node):
                node_id = bundle_nodes[pg_bundle]
                locations.append(
                    BundleLocation(
                        bundle_index=node * self.cfg.gpus_per_node + pg_bundle,
                        placement_group=pg,
                        pg_bundle_index=pg_bundle,
                        node_id=node_id,
                        node_ip=node_ips[node_id],
                    )
                )
        return locations
