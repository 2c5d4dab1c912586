"""What a receiver expects from a refit: every HF parameter name once, with its shape and dtype.

The generation worker builds a :class:`WeightManifest` of the *full* (unsharded) tensors in the generation
dtype; the receiver checks each arriving bucket against it with a :class:`ManifestCheck`, so a missing,
duplicated, unexpected or mis-shaped weight fails the refit with an error that names it instead of silently
leaving a stale or garbage weight in the generation engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_rl.weight_sync.errors import RefitIntegrityError

_MAX_NAMES_IN_ERROR = 20


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ``ValueError`` for a name that is not a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (expected e.g. 'float32' or 'bfloat16')")
    return dtype


def format_names(names: Iterable[str]) -> str:
    """A readable, bounded list of parameter names for error messages."""
    names = sorted(names)
    shown = ", ".join(names[:_MAX_NAMES_IN_ERROR])
    if len(names) > _MAX_NAMES_IN_ERROR:
        shown += f", ... ({len(names) - _MAX_NAMES_IN_ERROR} more)"
    return shown


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one full (unsharded) weight."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in this dtype."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


SpecLike = TensorSpec | tuple[Sequence[int], torch.dtype | str]
"""A :class:`TensorSpec` or a ``(shape, dtype or dtype name)`` pair, as workers report their weights."""


def _to_spec(name: str, spec: SpecLike) -> TensorSpec:
    if isinstance(spec, TensorSpec):
        return spec
    shape, dtype = spec
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"manifest entry {name!r}: expected (shape, dtype), got {spec!r}")
    return TensorSpec(tuple(int(size) for size in shape), dtype)


class WeightManifest(Mapping[str, TensorSpec]):
    """An immutable mapping ``hf_name -> TensorSpec`` of the weights a refit moves."""

    def __init__(self, specs: Mapping[str, SpecLike]) -> None:
        self._specs = {name: _to_spec(name, spec) for name, spec in specs.items()}

    @classmethod
    def coerce(cls, manifest: ManifestLike) -> WeightManifest:
        """``manifest`` itself, or a manifest built from a ``{name: (shape, dtype or dtype name)}`` dict."""
        return manifest if isinstance(manifest, WeightManifest) else cls(manifest)

    @classmethod
    def from_named_tensors(
        cls, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
    ) -> WeightManifest:
        """Manifest of ``(name, tensor)`` pairs; ``dtype`` (unless ``None``) replaces floating-point dtypes.

        This mirrors refit's cast: floating-point weights travel in the generation dtype, integer buffers in
        their own.

        DTensors contribute their global shape, so a sharded policy and a replicated engine agree.
        Raises ``ValueError`` when a name appears twice.
        """
        specs: dict[str, TensorSpec] = {}
        for name, tensor in named_tensors:
            if name in specs:
                raise ValueError(f"weight {name!r} appears twice; a refit moves each weight once")
            spec_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            specs[name] = TensorSpec(tuple(tensor.shape), spec_dtype)
        return cls(specs)

    def __getitem__(self, name: str) -> TensorSpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        return f"WeightManifest({len(self)} tensors, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        """Total bytes of all weights."""
        return sum(spec.nbytes for spec in self._specs.values())

    def differences(self, other: WeightManifest) -> list[str]:
        """Human-readable differences between this (expected) manifest and ``other`` (offered)."""
        problems = []
        missing = self._specs.keys() - other.keys()
        extra = other.keys() - self._specs.keys()
        if missing:
            problems.append(f"missing: {format_names(missing)}")
        if extra:
            problems.append(f"unexpected: {format_names(extra)}")
        mismatched = [
            f"{name} (expected {spec}, got {other[name]})"
            for name, spec in self._specs.items()
            if name in other and other[name] != spec
        ]
        if mismatched:
            problems.append(f"wrong shape or dtype: {format_names(mismatched)}")
        return problems

    def check_matches(self, offered: ManifestLike, what: str) -> None:
        """Raise :class:`RefitIntegrityError` unless ``offered`` (described by ``what``) equals this one.

        The driver calls this once at setup with the sender's manifest, so a mismatch between the policy and
        the generation model is reported before any byte moves.
        """
        problems = self.differences(WeightManifest.coerce(offered))
        if problems:
            raise RefitIntegrityError(
                f"{what} does not match the weights the generation workers expect: " + "; ".join(problems)
            )


ManifestLike = WeightManifest | Mapping[str, SpecLike]
"""What the refit API accepts as a manifest: a :class:`WeightManifest` or a plain dict of specs."""


class ManifestCheck:
    """Receiver-side bookkeeping of one refit: which expected weights have arrived, and what went wrong."""

    def __init__(self, manifest: WeightManifest) -> None:
        self._manifest = manifest
        self._seen: set[str] = set()

    def admit(self, entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> list[str]:
        """Record a bucket's ``(name, shape, dtype)`` entries; returns the problems found (empty when fine).

        Every entry is recorded as arrived, even a faulty one, so the final :meth:`missing` report only
        names weights that never came.
        """
        unexpected, duplicated, mismatched = [], [], []
        for name, shape, dtype in entries:
            spec = self._manifest.get(name)
            if spec is None:
                unexpected.append(name)
                continue
            if name in self._seen:
                duplicated.append(name)
            self._seen.add(name)
            got = TensorSpec(tuple(shape), dtype)
            if got != spec:
                mismatched.append(f"{name} (expected {spec}, got {got})")
        problems = []
        if unexpected:
            problems.append(f"unexpected weights: {format_names(unexpected)}")
        if duplicated:
            problems.append(f"weights received twice: {format_names(duplicated)}")
        if mismatched:
            problems.append(f"weights with the wrong shape or dtype: {format_names(mismatched)}")
        return problems

    def missing(self) -> list[str]:
        """Expected weights that have not arrived."""
        return sorted(self._manifest.keys() - self._seen)
