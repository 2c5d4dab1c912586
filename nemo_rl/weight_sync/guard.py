"""The refit guard: after a refit, does every engine hold what the policy sent?

The receivers already check every bucket against the sender's checksum, so what arrives is what was sent.
What can still go wrong happens after: a loader that writes a tensor into the wrong parameter or skips it, a
cast or a repacking that changes values, a kernel that keeps reading an old copy, memory corrupted in place.
With ``policy.refit.guard.checksums`` the first receiver of each refit takes an order-free
:data:`~nemo_rl.weight_sync.checksums.Checksum` of every tensor that arrived, and after the refit every
engine reports the same checksum of each parameter it holds (:meth:`RefitTarget.held_weight_checksums
<nemo_rl.weight_sync.refitter.RefitTarget.held_weight_checksums>`), in its own names.

The two sides are compared as trees of dotted names (:func:`find_divergence`): checksums add up, so every
prefix (``model.layers.3.self_attn``) has a checksum on both sides, and the comparison descends from the
root into the children both sides share. Where the engine fuses tensors (vLLM's ``qkv_proj`` for ``q_proj``,
``k_proj``, ``v_proj``; stacked experts) the children differ, and the tensors the engine fuses are compared
as one group. A difference names the deepest prefix that explains it: the tensor itself, or the fused group.

An engine hosted in the policy's worker is copied inside that process, without a transport: the worker takes
the checksums of the stream it copies (:func:`recording`) and compares them with the engine's right after
(:func:`check_in_process`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from nemo_rl.config.errors import UserError
from nemo_rl.config.refit import RefitGuardConfig
from nemo_rl.weight_sync.checksums import Checksum, combine_ranks, tensor_checksum, total
from nemo_rl.weight_sync.errors import RefitIntegrityError
from nemo_rl.weight_sync.interfaces import TransferStats
from nemo_rl.weight_sync.scope import RefitScope

EngineChecksums = list[dict[str, Checksum]] | None
"""One engine's report: the checksums of each of its tensor-parallel ranks, or ``None`` when it cannot report
now (in-flight weight updates may still be staged; a quantised engine holds other values)."""

_ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
_MAX_NAMED = 5


class RefitDivergenceError(RefitIntegrityError, UserError):
    """An engine holds other weights than the policy sent (one line, naming them: the script exits 2)."""


class _Tree:
    """Checksums of every dotted prefix of a set of named tensors, and each prefix's children."""

    def __init__(self, checksums: Mapping[str, Checksum]) -> None:
        self.sums: dict[tuple[str, ...], Checksum] = {}
        self.children: dict[tuple[str, ...], set[str]] = {}
        for name, checksum in checksums.items():
            parts = tuple(name.split("."))
            for depth in range(len(parts) + 1):
                prefix = parts[:depth]
                self.sums[prefix] = total([self.sums.get(prefix, (0, 0)), checksum])
                if depth < len(parts):
                    self.children.setdefault(prefix, set()).add(parts[depth])

    def sum_of(self, prefix: tuple[str, ...], children: set[str]) -> Checksum:
        return total(self.sums[(*prefix, child)] for child in children)


def find_divergence(expected: Mapping[str, Checksum], held: Mapping[str, Checksum]) -> list[str]:
    """What differs between the checksums of the tensors sent (``expected``, by Hugging Face name) and those
    an engine holds (``held``, by its own parameter names): the deepest names that explain each difference
    (see the module docstring). Empty when they agree."""
    return _diverging(_Tree(expected), _Tree(held), ())


def _diverging(sent: _Tree, held: _Tree, prefix: tuple[str, ...]) -> list[str]:
    if sent.sums.get(prefix) == held.sums.get(prefix):
        return []
    sent_children = sent.children.get(prefix, set())
    held_children = held.children.get(prefix, set())
    if not sent_children or not held_children:
        return [".".join(prefix)]
    common = sent_children & held_children
    problems = [p for child in sorted(common) for p in _diverging(sent, held, (*prefix, child))]
    sent_rest, held_rest = sent_children - common, held_children - common
    if (sent_rest or held_rest) and sent.sum_of(prefix, sent_rest) != held.sum_of(prefix, held_rest):
        problems.append(_describe_group(prefix, sent_rest, held_rest))
    return problems or [".".join(prefix) or "(the whole model)"]


def _describe_group(prefix: tuple[str, ...], sent: set[str], held: set[str]) -> str:
    """A fused group: the sent tensors and the parameter(s) the engine holds them in."""
    base = ".".join(prefix) + "." if prefix else ""

    def names(group: set[str]) -> str:
        return base + (next(iter(group)) if len(group) == 1 else "{" + ", ".join(sorted(group)) + "}")

    if not held:
        return f"{names(sent)} (not held)"
    if not sent:
        return f"{names(held)} (held, never sent)"
    return f"{names(sent)} (held as {names(held)})"


class RefitGuard:
    """The guard of one run's refits: what the engines should hold, and the comparison with what they do.

    Args:
        cfg: ``policy.refit.guard``.
    """

    def __init__(self, cfg: RefitGuardConfig) -> None:
        self.cfg = cfg
        self._expected: dict[str, Checksum] = {}

    @property
    def enabled(self) -> bool:
        """Whether refits are checked."""
        return self.cfg.checksums

    def record(self, received: Sequence[TransferStats], scope: RefitScope) -> None:
        """Remember what a refit of ``scope`` delivered (from the receiver that took checksums); an
        adapters-only refit replaces the adapters of the last full one."""
        arrived = next((stats.checksums for stats in received if stats.checksums is not None), None)
        if arrived is None:
            raise RefitIntegrityError("refit guard: no receiver took the checksums of what arrived")
        if scope == "full":
            self._expected = {}
        self._expected.update(arrived)

    def forget(self) -> None:
        """After a failed refit: nothing is known of what the engines should hold until the next full one."""
        self._expected = {}

    def problems(self, engines: Sequence[EngineChecksums]) -> list[str]:
        """One line per engine whose weights differ from what was sent (engines that cannot report are
        skipped)."""
        if not self._expected:
            return []
        lines = []
        for index, report in enumerate(engines):
            if report is None:
                continue
            held = combine_ranks(report)
            expected = self._expected
            if not any(name.endswith(_ADAPTER_SUFFIXES) for name in held):
                # The engine keeps its adapters outside its parameters (vLLM): its base weights are checked.
                expected = {n: c for n, c in expected.items() if not n.endswith(_ADAPTER_SUFFIXES)}
            names = find_divergence(expected, held)
            if names:
                shown = "; ".join(names[:_MAX_NAMED])
                more = f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
                lines.append(f"generation engine {index} holds {shown}{more} unlike what the policy sent")
        return lines

    def message(self, lines: Sequence[str], *, after_retry: bool = False) -> str:
        """The one line a difference prints."""
        retried = " after sending every weight again" if after_retry else ""
        return (
            f"refit guard: {'; '.join(lines)}{retried} (checksums of what arrived and of what the engine holds "
            "differ): the engine's weight loading or memory is at fault, not the training; the last checkpoint "
            "is intact (policy.refit.guard.on_mismatch chooses stop, refit or warn)"
        )


def recording(
    named_tensors: Iterable[tuple[str, torch.Tensor]], into: dict[str, Checksum], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_tensors`` unchanged, with the checksum of each (as sent: in ``dtype``) put ``into`` a dict: the
    sending side of a copy made inside one process (an engine hosted in the policy's worker)."""
    for name, tensor in named_tensors:
        into[name] = tensor_checksum(tensor, dtype)
        yield name, tensor


def check_in_process(
    cfg: RefitGuardConfig,
    sent: Mapping[str, Checksum],
    held: Mapping[str, Checksum] | None,
    scope: RefitScope,
) -> None:
    """The guard of a copy made inside one process: what :func:`recording` saw against what the engine then
    holds (``None``: it cannot report). An adapters-only copy is compared on the adapters alone. Raises
    :class:`RefitDivergenceError` (``on_mismatch`` stop or refit; the copy is not repeated here) or warns."""
    if held is None or not cfg.checksums:
        return
    if scope == "adapters":
        held = {name: checksum for name, checksum in held.items() if name.endswith(_ADAPTER_SUFFIXES)}
    names = find_divergence(sent, held)
    if not names:
        return
    shown = "; ".join(names[:_MAX_NAMED]) + (
        f" and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
    )
    message = RefitGuard(cfg).message(
        [f"the engine in this policy worker holds {shown} unlike what it was sent"]
    )
    if cfg.on_mismatch == "warn":
        print(f"WARNING: {message}; going on", flush=True)
        return
    raise RefitDivergenceError(message)
