"""Refit (weight sync): moving and resharding weights from the policy workers to the generation workers.

Driver::

    transport = create_refit_transport(policy_cfg, refit_cfg, policy_node_ids=..., generation_node_ids=...)
    metrics = refit(policy_group.workers, generation_group.workers, transport, timeout_s=refit_cfg.timeout_s)

Workers (one thin method each)::

    def refit_send(self, sender: WeightSender, scope: RefitScope) -> TransferStats:          # policy worker
        return sender.send(self.iter_hf_weights(sender.dtype, scope))

    def refit_receive(self, receiver: WeightReceiver, scope: RefitScope) -> TransferStats:   # generation worker
        return receiver.receive(self.load_hf_weights, self.expected_weights_manifest(scope))
"""

from nemo_rl.config.policy import RefitConfig
from nemo_rl.weight_sync.collective import CollectiveTransport, close_refit_groups
from nemo_rl.weight_sync.errors import RefitError, RefitIntegrityError
from nemo_rl.weight_sync.factory import build_refit_transport, create_refit_transport, generation_dtype
from nemo_rl.weight_sync.interfaces import (
    LoadFn,
    RefitTransport,
    ShardFn,
    TransferStats,
    TransportSettings,
    WeightReceiver,
    WeightSender,
)
from nemo_rl.weight_sync.manifest import ManifestLike, TensorSpec, WeightManifest
from nemo_rl.weight_sync.refit import refit
from nemo_rl.weight_sync.resharding import iter_full_tensors, tp_shard_fn
from nemo_rl.weight_sync.scope import RefitScope, RefitScopePlanner
from nemo_rl.weight_sync.shm import SharedMemoryTransport
from nemo_rl.weight_sync.shm_segments import sweep_segments
from nemo_rl.weight_sync.store import close_store_clients

__all__ = [
    "CollectiveTransport",
    "LoadFn",
    "ManifestLike",
    "RefitConfig",
    "RefitError",
    "RefitIntegrityError",
    "RefitScope",
    "RefitScopePlanner",
    "RefitTransport",
    "ShardFn",
    "SharedMemoryTransport",
    "TensorSpec",
    "TransferStats",
    "TransportSettings",
    "WeightManifest",
    "WeightReceiver",
    "WeightSender",
    "build_refit_transport",
    "close_refit_groups",
    "close_store_clients",
    "create_refit_transport",
    "generation_dtype",
    "iter_full_tensors",
    "refit",
    "sweep_segments",
    "tp_shard_fn",
]
