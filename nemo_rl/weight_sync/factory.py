"""Choosing a refit transport from the config and the workers' placement."""

from __future__ import annotations

from collections.abc import Sequence

import ray
import torch

from nemo_rl.config.policy import PolicyConfig, RefitConfig
from nemo_rl.weight_sync.collective import CollectiveTransport
from nemo_rl.weight_sync.interfaces import RefitTransport, TransportKind, TransportSettings
from nemo_rl.weight_sync.manifest import dtype_from_name
from nemo_rl.weight_sync.shm import SharedMemoryTransport

_MIB = 1024 * 1024


def generation_dtype(policy_cfg: PolicyConfig) -> torch.dtype:
    """The dtype the generation backend holds its weights in (refit casts to it on the sender)."""
    generation = policy_cfg.generation
    if generation.backend == "vllm":
        return dtype_from_name(generation.vllm_cfg.precision)
    return dtype_from_name(generation.embedded_cfg.precision)


def refit_store_host() -> str:
    """The address workers reach the driver's refit store on: this node's Ray IP, or loopback without Ray."""
    if ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    return "127.0.0.1"


def create_refit_transport(
    policy_cfg: PolicyConfig,
    refit_cfg: RefitConfig,
    *,
    policy_node_ids: Sequence[str],
    generation_node_ids: Sequence[str],
    policy_streams: Sequence[int] | None = None,
) -> RefitTransport:
    """The transport for moving weights from these policy workers to these generation workers.

    ``policy_node_ids[r]`` / ``generation_node_ids[j]`` are the (Ray) node ids of policy worker ``r`` and
    generation worker ``j``; ``policy_streams[r]`` is the stream policy worker ``r`` sends (its pipeline
    stage, ``Policy.refit_streams()``; default one stream). With ``refit_cfg.transport == "auto"``: shared
    memory when generation is colocated (``policy.generation.colocated.enabled``) and every generation node
    hosts a policy worker of every stream, a collective broadcast otherwise.
    """
    if not policy_node_ids or not generation_node_ids:
        raise ValueError("a refit needs at least one policy worker and one generation worker")
    kind = refit_cfg.transport
    if kind == "auto":
        same_nodes = SharedMemoryTransport.supports(policy_node_ids, generation_node_ids, policy_streams)
        kind = "shared_memory" if policy_cfg.generation.colocated.enabled and same_nodes else "collective"
    settings = TransportSettings(
        dtype=generation_dtype(policy_cfg),
        bucket_size_bytes=policy_cfg.refit_buffer_size_mb * _MIB,
        timeout_s=refit_cfg.timeout_s,
        store_host=refit_store_host(),
        tensor_checksums=refit_cfg.guard.checksums,
    )
    return build_refit_transport(
        kind,
        settings,
        policy_node_ids=policy_node_ids,
        generation_node_ids=generation_node_ids,
        policy_streams=policy_streams,
    )


def build_refit_transport(
    kind: TransportKind,
    settings: TransportSettings,
    *,
    policy_node_ids: Sequence[str],
    generation_node_ids: Sequence[str],
    policy_streams: Sequence[int] | None = None,
) -> RefitTransport:
    """The transport ``kind`` with ``settings`` between these policy and generation workers (node ids and
    streams as in :func:`create_refit_transport`)."""
    if kind == "shared_memory":
        return SharedMemoryTransport(
            settings,
            policy_node_ids=policy_node_ids,
            generation_node_ids=generation_node_ids,
            policy_streams=policy_streams,
        )
    return CollectiveTransport(
        settings,
        num_policy_workers=len(policy_node_ids),
        num_generation_workers=len(generation_node_ids),
        policy_streams=policy_streams,
    )
