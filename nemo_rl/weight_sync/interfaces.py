"""The refit contract: a sender streams ``(hf_name, full tensor)`` pairs, a receiver loads them.

Refit moves the policy's weights into the generation workers. Every transport (shared memory, collective
broadcast) implements the same three small pieces:

- :class:`WeightSender`, run inside each policy worker. Every policy rank calls ``send`` with its stream of
  full (gathered) tensors, because gathering a sharded parameter is a collective over the policy's own
  process group; only the ranks the transport designates put bytes on the wire.
- :class:`WeightReceiver`, run inside each generation worker: ``receive`` checks every bucket against the
  worker's :class:`~nemo_rl.weight_sync.manifest.WeightManifest`, optionally keeps a slice of each tensor
  (``shard_fn``) and hands a stream of ``(hf_name, tensor)`` to the worker's own loader.
- :class:`RefitTransport`, held by the driver: it hands out one picklable sender per policy worker and one
  receiver per generation worker for each refit, and cleans up after a failed one.

**Streams.** The weights may arrive as several *streams*, each sent by its own policy ranks: a pipeline-parallel
policy sends one stream per pipeline stage (the stage's own layers), so no rank ever holds another stage's
weights. Every rank of a stream iterates that stream's tensors in the same order; a receiver takes every
stream and checks their union against its manifest. A policy whose every rank holds the whole model (DTensor)
is one stream. The driver passes each policy rank's stream to the transport (``policy_streams``).

Senders and receivers are plain picklable values: the driver ships them to the workers with each refit call,
and they connect lazily (and once per process) to what they need, so a worker needs only one thin method::

    def refit_send(self, sender: WeightSender, scope: RefitScope) -> TransferStats:
        return sender.send(self.iter_hf_weights(sender.dtype, scope))

    def refit_receive(self, receiver: WeightReceiver, scope: RefitScope) -> TransferStats:
        return receiver.receive(self.load_hf_weights, self.expected_weights_manifest(scope))

``scope`` (:mod:`nemo_rl.weight_sync.scope`) is what this refit moves, chosen by the driver: every weight, or
the LoRA adapters only; both ends build their stream and manifest for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from nemo_rl.weight_sync.checksums import Checksum
from nemo_rl.weight_sync.errors import RefitError
from nemo_rl.weight_sync.manifest import ManifestLike

__all__ = [
    "LoadFn",
    "NamedTensors",
    "RefitError",
    "RefitTransport",
    "ShardFn",
    "TransferStats",
    "TransportKind",
    "WeightReceiver",
    "WeightSender",
]

NamedTensors = Iterable[tuple[str, torch.Tensor]]
"""A stream of ``(hf_name, tensor)`` pairs. Tensors may be DTensors; the sender gathers them."""

LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
"""A generation worker's loader: consumes the whole stream and copies each tensor into its weights.
The tensors it sees are views into transfer buffers, valid only until it takes the next pair: copy them."""

ShardFn = Callable[[str, torch.Tensor], torch.Tensor]
"""``shard_fn(hf_name, full_tensor) -> local tensor``: the slice a tensor-parallel receiver keeps."""

TransportKind = Literal["shared_memory", "collective"]


@dataclass(frozen=True)
class TransportSettings:
    """How a transport moves the weights, whatever the workers' placement (every transport takes them)."""

    dtype: torch.dtype
    """The dtype the generation workers hold their weights in; senders cast to it."""

    bucket_size_bytes: int
    """Bytes per bucket of the stream (``policy.refit_buffer_size_mb``)."""

    timeout_s: float
    """A refit that has not finished after this many seconds fails (``policy.refit.timeout_s``)."""

    store_host: str
    """The address the workers reach the driver's refit store on."""

    tensor_checksums: bool = False
    """The first receiver takes the checksum of every tensor that arrives, for the refit guard
    (``policy.refit.guard.checksums``)."""


@dataclass(frozen=True)
class TransferStats:
    """What one worker moved during one refit."""

    role: Literal["sender", "receiver"]
    """Which side of the refit this worker was."""

    wire_bytes: int
    """Payload bytes this worker put on (sender) or took off (receiver) the wire; 0 for a policy rank that
    only helped gather the weights."""

    num_buckets: int
    """Buckets this worker sent or received."""

    num_tensors: int
    """Tensors this worker sent or received."""

    time_s: float
    """Seconds this worker spent in the refit."""

    stream: int = 0
    """The stream a sender belongs to (0 for receivers and single-stream policies)."""

    checksums: dict[str, Checksum] | None = None
    """A receiver taking them for the refit guard: the checksum of every tensor that arrived, by name
    (:mod:`nemo_rl.weight_sync.checksums`); ``None`` otherwise."""


class WeightSender(Protocol):
    """The policy-worker side of one refit."""

    @property
    def dtype(self) -> torch.dtype:
        """The generation dtype: tensors are cast to it before they go on the wire."""
        ...

    def send(self, weights: NamedTensors) -> TransferStats:
        """Stream ``weights`` (HF names, full or DTensor-sharded tensors) to the receivers.

        Every policy rank of one stream must call this with the same names in the same order.
        """
        ...


class WeightReceiver(Protocol):
    """The generation-worker side of one refit."""

    def receive(
        self, load_fn: LoadFn, manifest: ManifestLike, shard_fn: ShardFn | None = None
    ) -> TransferStats:
        """Receive every bucket, check it against ``manifest`` and feed its tensors to ``load_fn``.

        ``manifest`` lists the full (unsharded) weights in the generation dtype: a :class:`WeightManifest`
        or a ``{hf_name: (shape, dtype or dtype name)}`` dict.

        ``shard_fn`` (for tensor-parallel receivers) maps each full tensor to the slice this worker keeps.
        Raises :class:`RefitError` naming the parameters when a bucket is corrupt or missing, or when a
        name is missing, duplicated, unexpected or has the wrong shape or dtype; the stream is drained first
        so the senders and the other receivers are not left waiting.
        """
        ...


class RefitTransport(Protocol):
    """The driver side of a transport: hands out endpoints and cleans up after refits."""

    @property
    def kind(self) -> TransportKind:
        """Which transport this is."""
        ...

    @property
    def num_senders(self) -> int:
        """Policy workers taking part (all of them: they gather the weights together)."""
        ...

    @property
    def num_streams(self) -> int:
        """Streams the weights arrive in (one per pipeline stage of the policy)."""
        ...

    @property
    def num_receivers(self) -> int:
        """Generation workers receiving the weights."""
        ...

    def endpoints(self, refit_id: str) -> tuple[list[WeightSender], list[WeightReceiver]]:
        """One sender per policy worker (by rank) and one receiver per generation worker for a refit."""
        ...

    def abort(self, refit_id: str) -> None:
        """Tell every endpoint of ``refit_id`` still running to give up (after a worker died)."""
        ...

    def cleanup(self, refit_id: str) -> None:
        """Release what ``refit_id`` may have left behind (shared-memory segments on every node)."""
        ...

    def shutdown(self) -> None:
        """Release everything the transport holds; it cannot be used afterwards."""
        ...
