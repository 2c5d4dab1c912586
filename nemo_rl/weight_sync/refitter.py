"""The one refit path: :class:`Refitter` plans and runs every refit from the policy into the generation engines.

Built once at setup (:meth:`Refitter.create`) from the policy (a :class:`RefitSource`), the generation backend
(a :class:`RefitTarget`) and the ``policy`` config, it owns everything a refit decides:

- the manifest check: what the policy sends against what the engines expect, at setup, so a mismatch (an
  other architecture, a wrong generation dtype) fails before the first step instead of at the first refit;
- the transport (:func:`~nemo_rl.weight_sync.factory.create_refit_transport`, chosen from the workers' nodes),
  none for engines that live in the policy's own processes (:attr:`RefitTarget.hosted_in_policy`: they copy
  in process);
- the scope of each refit (:class:`~nemo_rl.weight_sync.scope.RefitScopePlanner`): ``"adapters"`` after the
  first when the policy says its adapters may travel alone (:meth:`RefitSource.adapter_refits`);
- the offloads around it (optimizer state to the host before, weights after);
- the staleness flag: :meth:`mark_stale` after a training step, :meth:`refit_if_stale` before sampling;
- the refit guard (:mod:`~nemo_rl.weight_sync.guard`, ``policy.refit.guard``): after each refit through a
  transport, :meth:`verify` compares what arrived with what every engine holds.

The policy and the generation backends live a layer above (``nemo_rl.models``); they implement the two
Protocols below, which are this layer's contract with them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.weight_sync.factory import create_refit_transport, generation_dtype
from nemo_rl.weight_sync.guard import EngineChecksums, RefitDivergenceError, RefitGuard
from nemo_rl.weight_sync.interfaces import RefitTransport
from nemo_rl.weight_sync.manifest import SpecLike, WeightManifest
from nemo_rl.weight_sync.refit import refit_with_stats
from nemo_rl.weight_sync.scope import RefitScope, RefitScopePlanner, worker_identities


class RefitSource(Protocol):
    """The sending side of a refit: the trained policy (``nemo_rl.models.policy.lm_policy.Policy``)."""

    @property
    def workers(self) -> Sequence[Any]:
        """The policy's Ray actors in rank order; each has ``refit_send(sender, scope) -> TransferStats``."""
        ...

    @property
    def worker_node_ids(self) -> list[str]:
        """Ray node id of each worker, in rank order (for choosing the transport)."""
        ...

    def refit_streams(self) -> list[int]:
        """The refit stream each worker sends, in rank order (its pipeline stage; 0 for a whole model)."""
        ...

    def adapter_refits(self) -> bool:
        """Whether refits after the first may move the LoRA adapters alone (the base weights never change and
        the workers send the adapters unmerged)."""
        ...

    def weights_manifest(self, dtype: torch.dtype, scope: RefitScope = "full") -> Mapping[str, SpecLike]:
        """``{hf_name: (full shape, dtype name)}`` of what a refit of ``scope`` sends, cast to ``dtype``."""
        ...

    def offload_before_refit(self) -> None:
        """Optimizer state to the host, so the gathers of the refit fit on the devices."""
        ...

    def offload_after_refit(self) -> None:
        """Weights (and optimizer state) to the host, leaving the devices to generation."""
        ...


class RefitTarget(Protocol):
    """The receiving side of a refit: a generation backend
    (``nemo_rl.models.generation.interfaces.GenerationInterface``)."""

    @property
    def workers(self) -> Sequence[Any]:
        """The generation actors in rank order; each has ``refit_receive(receiver, scope) -> TransferStats``."""
        ...

    @property
    def worker_node_ids(self) -> list[str]:
        """Ray node id of each worker, in rank order."""
        ...

    @property
    def hosted_in_policy(self) -> bool:
        """Whether the engines live in the policy's worker processes: then :meth:`refit_in_process` copies the
        weights and no transport is built."""
        ...

    def refit_in_process(self, scope: RefitScope) -> dict[str, float]:
        """Copy the policy's weights of ``scope`` into engines hosted in the policy's processes; returns the
        ``refit/*`` metrics (only called when :attr:`hosted_in_policy`)."""
        ...

    def expected_weights_manifest(self, scope: RefitScope = "full") -> Mapping[str, SpecLike]:
        """What a refit of ``scope`` must deliver: full shapes, in the generation dtype."""
        ...

    def held_weight_checksums(self) -> list[EngineChecksums]:
        """For the refit guard: per engine replica, the checksums (:mod:`nemo_rl.weight_sync.checksums`) of
        every weight each of its ranks holds, under the engine's own parameter names, in the dtype refits
        send; ``None`` for an engine that cannot report now. Engines hosted in the policy report none."""
        ...

    def set_refill(self, refill: Callable[[Sequence[int]], None] | None) -> None:
        """Take the function that loads the policy's weights into the workers of the given ranks, called by
        the target after it replaced them (:meth:`Refitter.refill`)."""
        ...

    def replace_lost_workers(self) -> bool:
        """Replace the workers that died or hang; whether any was (a failed refit is then made again)."""
        ...


def check_refit_manifests(
    source: RefitSource, target: RefitTarget, dtype: torch.dtype, scopes: Sequence[RefitScope]
) -> None:
    """Raise :class:`~nemo_rl.weight_sync.errors.RefitIntegrityError` naming the missing, unexpected and
    mis-shaped weights when what ``source`` sends for a scope of ``scopes`` differs from what ``target``
    expects."""
    for scope in scopes:
        expected = WeightManifest(target.expected_weights_manifest(scope))
        expected.check_matches(
            source.weights_manifest(dtype, scope),
            f"the policy's {scope} refit (is policy.model_name the generation model's architecture?)",
        )


class Refitter:
    """Plans and runs the refits of one run (see the module docstring); build it with :meth:`create`.

    Args:
        source: the policy.
        target: the generation backend.
        transport: moves the weights; ``None`` for a target hosted in the policy's processes.
        timeout_s: a refit that has not finished after this many seconds fails.
        adapter_refits: refits after the first may move the LoRA adapters alone.
        guard: checks after each refit through a transport that the engines hold what was sent
            (:mod:`nemo_rl.weight_sync.guard`); ``None`` checks nothing.
        transport_factory: builds a transport to the generation workers on the given nodes: for the workers
            that replace lost ones (:meth:`refill`), and again whenever the generation workers changed.
            ``None``: ``transport`` serves every refit.

    Thread-safe: asynchronous GRPO's rollout thread refills replaced workers while the trainer refits.
    """

    def __init__(
        self,
        source: RefitSource,
        target: RefitTarget,
        transport: RefitTransport | None,
        *,
        timeout_s: float,
        adapter_refits: bool,
        guard: RefitGuard | None = None,
        transport_factory: Callable[[list[str]], RefitTransport] | None = None,
    ) -> None:
        if transport is None and not target.hosted_in_policy:
            raise ValueError("generation workers in processes of their own need a refit transport")
        self.source = source
        self.target = target
        self.transport = transport
        self.timeout_s = timeout_s
        self._scopes = RefitScopePlanner(adapter_refits)
        self.guard = guard if guard is not None and guard.enabled and transport is not None else None
        """The refit guard, when refits are checked (never for engines hosted in the policy)."""
        self._guard_cfg = None if guard is None else guard.cfg
        self.stale = True
        """Whether the policy trained since the engines last received its weights."""
        self._transport_factory = transport_factory
        self._transport_workers = worker_identities(target.workers)
        self._lock = threading.RLock()
        if transport_factory is not None:
            # Replaced generation workers get the policy's weights over a transport of their own.
            target.set_refill(self.refill)

    @classmethod
    def create(cls, cfg: PolicyConfig, source: RefitSource, target: RefitTarget) -> Refitter:
        """Check the manifests of both ends (:func:`check_refit_manifests`) and build the transport
        ``cfg.refit`` selects between the workers' nodes (none for engines hosted in the policy)."""
        adapter_refits = source.adapter_refits()
        scopes: list[RefitScope] = ["full", "adapters"] if adapter_refits else ["full"]
        check_refit_manifests(source, target, generation_dtype(cfg), scopes)
        if target.hosted_in_policy:
            return cls(
                source,
                target,
                None,
                timeout_s=cfg.refit.timeout_s,
                adapter_refits=adapter_refits,
                guard=RefitGuard(cfg.refit.guard),
            )

        def transport_to(generation_node_ids: list[str]) -> RefitTransport:
            return create_refit_transport(
                cfg,
                cfg.refit,
                policy_node_ids=source.worker_node_ids,
                generation_node_ids=generation_node_ids,
                policy_streams=source.refit_streams(),
            )

        return cls(
            source,
            target,
            transport_to(target.worker_node_ids),
            timeout_s=cfg.refit.timeout_s,
            adapter_refits=adapter_refits,
            guard=RefitGuard(cfg.refit.guard),
            transport_factory=transport_to,
        )

    def mark_stale(self) -> None:
        """Record that the policy trained: the next :meth:`refit_if_stale` refits."""
        self.stale = True

    def refit(self) -> dict[str, float]:
        """Copy the policy's current weights into the engines; returns the ``refit/*`` metrics.

        The scope is ``"full"`` the first time, after a failed refit and whenever the generation workers
        changed; with adapter refits ``"adapters"`` otherwise (``refit/adapters_only`` says which). With the
        guard on, the engines' weights are then checked (:meth:`verify`; ``refit/guard_s`` is its time)."""
        metrics = self._copy()
        if self.guard is None:
            return metrics
        return {**metrics, **self.verify()}

    def _copy(self) -> dict[str, float]:
        """:meth:`_copy_once`; when it fails because generation workers were lost (the target replaces them, or
        another thread did meanwhile), once more to the pool as it is then."""
        workers = worker_identities(self.target.workers)
        try:
            with self._lock:
                return self._copy_once()
        except Exception:
            # Outside the lock: replacing workers refills them, which takes it.
            replaced = self.target.replace_lost_workers()
            if not replaced and worker_identities(self.target.workers) == workers:
                raise
        with self._lock:
            return self._copy_once()

    def _copy_once(self) -> dict[str, float]:
        workers = worker_identities(self.target.workers)
        if workers != self._transport_workers and self._transport_factory is not None:
            # Other generation workers (replaced, or fewer): the transport's groups and receivers change.
            if self.transport is not None:
                self.transport.shutdown()
            self.transport = self._transport_factory(self.target.worker_node_ids)
            self._transport_workers = workers
        scope = self._scopes.scope_for(workers)
        try:
            self.source.offload_before_refit()
            if self.transport is None:
                metrics = self.target.refit_in_process(scope)
            else:
                metrics, received = refit_with_stats(
                    self.source.workers,
                    self.target.workers,
                    self.transport,
                    timeout_s=self.timeout_s,
                    scope=scope,
                )
                if self.guard is not None:
                    self.guard.record(received, scope)
            self.source.offload_after_refit()
        except BaseException:
            # The engines may be half loaded: the next refit is due, and full.
            self._engines_in_doubt()
            raise
        self._scopes.succeeded(workers, scope)
        self.stale = False
        return {**metrics, "refit/adapters_only": float(scope == "adapters")}

    def refill(self, ranks: Sequence[int]) -> None:
        """Send the policy's current weights (every one) to the generation workers of ``ranks`` alone, just
        started in place of lost ones, over a transport of their own; the others keep what they hold. The next
        refit is full (the guard checks every engine again after it)."""
        if self._transport_factory is None:  # registered only with one (see __init__)
            raise RuntimeError("Refitter.refill needs a transport_factory (Refitter.create makes one)")
        workers = [self.target.workers[r] for r in ranks]
        nodes = self.target.worker_node_ids
        with self._lock:
            transport = self._transport_factory([nodes[r] for r in ranks])
            try:
                refit_with_stats(
                    self.source.workers, workers, transport, timeout_s=self.timeout_s, scope="full"
                )
            finally:
                transport.shutdown()
            self._scopes.failed()
            if self.guard is not None:
                self.guard.forget()

    def _engines_in_doubt(self) -> None:
        """What the engines hold is not known to be the policy's weights: the next refit is due, and full."""
        self._scopes.failed()
        if self.guard is not None:
            self.guard.forget()
        self.stale = True

    def verify(self) -> dict[str, float]:
        """The refit guard's check of what the engines hold against what the last refits sent; acts as
        ``policy.refit.guard.on_mismatch`` says on a difference (raising :class:`RefitDivergenceError` for
        ``stop``). Returns ``refit/guard_s``; nothing without a guard."""
        if self.guard is None:
            return {}
        start_s = time.perf_counter()
        lines = self.guard.problems(self.target.held_weight_checksums())
        retried = False
        if lines and self.guard.cfg.on_mismatch == "refit":
            print(f"WARNING: {self.guard.message(lines)}; sending every weight again", flush=True)
            self._scopes.failed()
            self._copy()
            lines = self.guard.problems(self.target.held_weight_checksums())
            retried = True
        if lines:
            message = self.guard.message(lines, after_retry=retried)
            if self.guard.cfg.on_mismatch != "warn":
                self._engines_in_doubt()
                raise RefitDivergenceError(message)
            print(f"WARNING: {message}; going on (the next refit sends every weight)", flush=True)
            self._scopes.failed()
        return {"refit/guard_s": time.perf_counter() - start_s}

    def probe(self, gen_kl_error: float) -> None:
        """The refit guard's probe (``policy.refit.guard.max_gen_kl_error``): a synchronous step's
        ``gen_kl_error`` past the limit (or NaN) names the tensors whose checksums differ, or says that none
        does, and acts as ``on_mismatch`` says (``refit`` and ``warn`` go on; the next refit is full)."""
        cfg = self._guard_cfg
        if cfg is None or cfg.max_gen_kl_error is None or gen_kl_error <= cfg.max_gen_kl_error:
            return
        lines = [] if self.guard is None else self.guard.problems(self.target.held_weight_checksums())
        if lines:
            found = "; ".join(lines)
        elif self.guard is not None:
            found = (
                "every tensor the engines hold matches what was sent, so the engines compute differently from "
                "the policy (a kernel, a dtype, sampling settings)"
            )
        else:
            found = (
                "the engines' weights are not checksummed (engines in the policy, or guard.checksums=false)"
            )
        message = (
            f"refit guard: gen_kl_error {gen_kl_error:.3g} exceeds policy.refit.guard.max_gen_kl_error="
            f"{cfg.max_gen_kl_error:g}: {found}; the last checkpoint is intact"
        )
        self._scopes.failed()
        if cfg.on_mismatch == "stop":
            self._engines_in_doubt()
            raise RefitDivergenceError(message)
        print(f"WARNING: {message}; going on (the next refit sends every weight)", flush=True)

    def refit_if_stale(self) -> dict[str, float]:
        """:meth:`refit` when the policy trained since the last one; no metrics (an empty dict) otherwise."""
        return self.refit() if self.stale else {}

    def shutdown(self) -> None:
        """Release the transport (its store, groups and segments)."""
        with self._lock:
            if self.transport is not None:
                self.transport.shutdown()
                self.transport = None
