"""The embedded engine hosted in the DTensor policy workers (``policy.generation.embedded_cfg.in_policy_workers``).

With colocated generation the policy and the generation workers take turns on the same slots anyway; a
separate generation process per slot then only costs its own start (imports and model load) and a refit
through a transport every step. Here each data-parallel group of the policy holds one
:class:`~.replica.EmbeddedReplica` (on its first tensor-parallel rank) in the policy worker process itself:

- generating deals the rows to the policy's dp groups exactly as separate workers would (same call seeds,
  same per-rank and per-chunk seeds: the same tokens for the same weights);
- a refit is an in-process copy (:meth:`InPolicyEmbeddedGeneration.refit_in_process`, which the
  :class:`~nemo_rl.weight_sync.refitter.Refitter` calls instead of building a transport): every rank gathers the full weights (with FSDP alone in one all-gather, with
  TP as a refit sender does) and the replica copies them into its fused storage; nothing crosses a process
  boundary;
- ``prepare_for_generation`` / ``finish_generation`` bring the engine's weights back and drop its KV cache
  (offloading the weights on CUDA), as in separate workers.

The policy owns the processes: a dead policy worker ends both roles, and errors say so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.actor import ActorHandle
from transformers import PreTrainedTokenizerBase

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.interfaces import WeightManifestDict
from nemo_rl.models.generation.replicated import SeededReplicas
from nemo_rl.models.tokenizer import require_pad_token_id
from nemo_rl.weight_sync.guard import EngineChecksums
from nemo_rl.weight_sync.scope import RefitScope

if TYPE_CHECKING:
    from nemo_rl.models.policy.lm_policy import Policy

IN_POLICY_KEY = "policy.generation.embedded_cfg.in_policy_workers"


class InPolicyEmbeddedGeneration(SeededReplicas):
    """:class:`~nemo_rl.models.generation.interfaces.GenerationInterface` over engine replicas hosted in the
    workers of ``policy`` (a started DTensor :class:`~nemo_rl.models.policy.lm_policy.Policy` whose config
    sets ``policy.generation.embedded_cfg.in_policy_workers``).

    The replicas hold no weights until the first :meth:`refit` (or :meth:`update_weights`).

    Args:
        policy: the policy whose workers host the replicas.
        tokenizer: pad/EOS ids and stop-string decoding.
        seed: seeds the sampling as :class:`~.generation.EmbeddedGeneration`'s ``seed`` does.
    """

    backend_name = "embedded"

    def __init__(self, policy: Policy, tokenizer: PreTrainedTokenizerBase, *, seed: int) -> None:
        if not policy.cfg.generation.embedded_cfg.in_policy_workers:
            raise ValueError(f"InPolicyEmbeddedGeneration needs a policy started with {IN_POLICY_KEY}=true")
        super().__init__(pad_token_id=require_pad_token_id(tokenizer), seed=seed)
        self.policy = policy
        policy.worker_group.death_note = (
            f"these policy workers also host the embedded generation engine ({IN_POLICY_KEY}=true), so "
            "generation stopped with them; rerun to resume from the last checkpoint"
        )
        self._on_all("init_embedded_generation", tokenizer)

    def _on_all(self, method: str, *args: Any) -> list[Any]:
        group = self.policy.worker_group
        refs = group.run_all_workers_single_data(method, *args)
        return group.get_all_worker_results(refs, self.policy.call_timeout_s)

    @property
    def dp_size(self) -> int:
        """Number of replicas: the policy's data-parallel size."""
        return self.policy.dp_size

    def generate(
        self, data: BatchedDataDict[Any], greedy: bool = False, seed: int | None = None
    ) -> BatchedDataDict[Any]:
        """Sample a response per row; see :class:`~nemo_rl.models.generation.interfaces.GenerationInterface`."""
        return self._generate_on(
            self.policy.worker_group, "generate", data, greedy, self.policy.call_timeout_s, seed
        )

    def prepare_for_generation(self) -> None:
        """The engines' weights back onto the devices (no call on CPU workers, where they never leave)."""
        # finish_generation offloads the weights only on CUDA; on CPU the call would move nothing and cost
        # a round trip to every worker each step.
        if self.policy.worker_group.cluster.use_gpus:
            self._on_all("prepare_for_generation")

    def finish_generation(self) -> None:
        """Drop the engines' KV caches (and offload their weights on CUDA) so training gets the memory. Not
        waited for: the policy workers run it before the next call made on them (the training step)."""
        self.policy.worker_group.run_all_workers_deferred("finish_generation")

    def shutdown(self) -> None:
        """Nothing to stop: the replicas live in the policy's workers and go with ``Policy.shutdown``."""

    # --------------------------------------------------------------------------------------- refit
    @property
    def hosted_in_policy(self) -> bool:
        """True: the replicas live in the policy's workers and refits copy in process."""
        return True

    def refit_in_process(self, scope: RefitScope) -> dict[str, float]:
        """Copy the policy's current weights of refit ``scope`` into every replica, in process (one call to the
        workers; the :class:`~nemo_rl.weight_sync.refitter.Refitter` offloads around it); returns ``refit/*``
        metrics (``refit/bytes``: what one replica received; ``refit/bytes_received``: summed over them)."""
        start_s = time.perf_counter()
        loaded = [int(n) for n in self._on_all("refit_embedded_generation", scope)]
        time_s = time.perf_counter() - start_s
        return {
            "refit/bytes": float(max(loaded)),
            "refit/time_s": time_s,
            "refit/gbps": max(loaded) / time_s / 1e9,
            "refit/bytes_received": float(sum(loaded)),
        }

    @property
    def workers(self) -> list[ActorHandle]:
        """The policy's workers, which host the replicas."""
        return self.policy.workers

    @property
    def worker_node_ids(self) -> list[str]:
        """Ray node id of each hosting worker, in rank order."""
        group = self.policy.worker_group
        locations = group.cluster.bundle_locations()
        return [locations[b].node_id for b in group.bundle_indices]

    def expected_weights_manifest(self, scope: RefitScope = "full") -> WeightManifestDict:
        """``{hf_name: (full shape, dtype name)}`` the replicas expect from a refit of ``scope``."""
        group = self.policy.worker_group
        ref = group.run_single_worker("embedded_weights_manifest", 0, scope)
        manifest: WeightManifestDict = group.get_all_worker_results([ref], self.policy.call_timeout_s)[0]
        return manifest

    def held_weight_checksums(self) -> list[EngineChecksums]:
        """No reports to the driver: each replica copies the weights in its policy worker's process and checks
        the copy there, right after it (``nemo_rl.weight_sync.guard.check_in_process``)."""
        return []

    def set_refill(self, refill: Callable[[Sequence[int]], None] | None) -> None:
        """Nothing to refill: the replicas live in the policy's workers, whose death ends the run."""

    def replace_lost_workers(self) -> bool:
        """False: the replicas live in the policy's workers, whose death ends the run."""
        return False

    def take_metrics(self) -> dict[str, float]:
        """Nothing measured here."""
        return {}

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full weights held by the driver into every replica (each weight exactly once)."""
        tensors = [(name, tensor.detach().cpu()) for name, tensor in named_tensors]
        # Stored once for every Ray worker; a worker in this process takes the list itself.
        group = self.policy.worker_group
        self._on_all("load_embedded_generation_weights", tensors if group.in_process else ray.put(tensors))

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Host copies of the first replica's weights under their Hugging Face names (for checks)."""
        group = self.policy.worker_group
        ref = group.run_single_worker("embedded_generation_weights", 0)
        weights: dict[str, torch.Tensor] = group.get_all_worker_results([ref], self.policy.call_timeout_s)[0]
        return weights
