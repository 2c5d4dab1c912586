"""Refit (weight sync): moving and resharding weights from the policy workers to the generation workers.

Driver (:mod:`.refitter`: built once at setup, it checks both ends' manifests, picks the transport and each
refit's scope, and offloads the policy around the copy)::

    refitter = Refitter.create(policy_cfg, policy, generation)   # RefitSource, RefitTarget
    metrics = refitter.refit_if_stale()                           # after refitter.mark_stale()

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
from nemo_rl.weight_sync.refitter import RefitSource, RefitTarget, Refitter, check_refit_manifests
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
    "RefitSource",
    "RefitTarget",
    "RefitTransport",
    "Refitter",
    "ShardFn",
    "SharedMemoryTransport",
    "TensorSpec",
    "TransferStats",
    "TransportSettings",
    "WeightManifest",
    "WeightReceiver",
    "WeightSender",
    "build_refit_transport",
    "check_refit_manifests",
    "close_refit_groups",
    "close_store_clients",
    "create_refit_transport",
    "generation_dtype",
    "iter_full_tensors",
    "refit",
    "sweep_segments",
    "tp_shard_fn",
]
