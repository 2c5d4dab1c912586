"""The contract every generation backend (the embedded engine, vLLM) implements.

Data in (:class:`GenerationDatumSpec`): ``input_ids`` ``[B, T]`` right-padded prompts, ``input_lengths``
``[B]``, and optionally ``stop_strings``, a length-``B`` list of per-sample stop strings (or ``None``) added to
the configured ``policy.generation.stop_strings``. Prompts of a vision-language model may carry images:
``pixel_values`` and ``image_grid_thw``, length-``B`` lists holding each row's ``[patches, values per patch]``
and ``[images, 3]`` tensors (``None`` for a row without images), exactly as :mod:`nemo_rl.data.vlm` builds
them for the policy, the row's image placeholders already repeated once per merged patch. A batch without
them (or with every entry ``None``) is a text batch.

Data out (:class:`GenerationOutputSpec`), one row per input row, in the input order:

- ``output_ids`` ``[B, T']`` long: the prompt (its first ``input_lengths[b]`` tokens), then the generated tokens
  starting right at position ``input_lengths[b]``, then the tokenizer's pad id. ``T'`` is at least
  ``T + max(generation_lengths)`` (results gathered from several replicas are padded to a common width).
- ``logprobs`` ``[B, T']`` float32, aligned with ``output_ids``: each generated token's log-prob under the
  distribution it was sampled from (see "Log-probabilities" below). 0 at prompt and pad positions.
- ``generation_lengths`` ``[B]`` long: generated tokens, the stop token included.
- ``unpadded_sequence_lengths`` ``[B]`` long: ``input_lengths + generation_lengths``.
- ``truncated`` ``[B]`` bool: the response did not end with a stop token or stop string: it hit
  ``max_new_tokens`` or ``policy.max_total_sequence_length`` (or a backend cut it, e.g. vLLM's repetition
  detection).
- ``routed_experts`` ``[B, T', MoE layers, top_k]`` int16, only from an engine that records routing
  (``policy.router_replay.enabled``): aligned with ``output_ids``, the experts every MoE layer routed each
  token to, -1 where no forward ran the token (a response's last token, padding).

Log-probabilities: one contract for every backend and the policy. For a sampled token, its log-prob under
the distribution it was drawn from: the logits divided by ``policy.generation.temperature``, then top-k,
then top-p (on the top-k renormalised distribution), and ``log_softmax`` over the tokens kept::

    logprob(token) = log_softmax(filter_top_k_top_p(logits / temperature))[token]

(vLLM's ``logprobs_mode="processed_logprobs"``; the embedded engine's ``sample_tokens``). Greedy calls return
the raw model's ``log_softmax(logits)``. Policy workers score sequences under the same distribution
(:func:`nemo_rl.models.sampling.sampling_logits`, which shares the filter with the embedded engine), so the
two are equal for the same weights and GRPO's importance ratios and ``gen_kl_error`` compare like with like.

Refit (receiver side). On the wire weights carry their Hugging Face names. A backend exposes its workers as
Ray actors with a ``refit_receive(receiver) -> TransferStats`` method (the generation-worker side of
:func:`nemo_rl.weight_sync.refit.refit`), the Ray node of each worker (for
:func:`nemo_rl.weight_sync.factory.create_refit_transport`), and the manifest of the weights it expects;
:class:`nemo_rl.weight_sync.refitter.Refitter` checks that manifest against the policy's at setup. A backend
whose engines live in the policy's processes (:attr:`GenerationInterface.hosted_in_policy`) copies in process
instead (:meth:`GenerationInterface.refit_in_process`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NotRequired, Protocol, TypedDict, runtime_checkable

import torch
from ray.actor import ActorHandle

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.weight_sync.guard import EngineChecksums
from nemo_rl.weight_sync.scope import RefitScope

WeightManifestDict = dict[str, tuple[tuple[int, ...], str]]
"""``{hf_name: (full shape, dtype name)}``: every weight a generation backend needs, each exactly once,
in the generation dtype (the format of ``Policy.weights_manifest``)."""


class GenerationDatumSpec(TypedDict):
    """Keys of a batch handed to :meth:`GenerationInterface.generate`."""

    input_ids: torch.Tensor
    """``[B, T]`` long, prompts right-padded."""
    input_lengths: torch.Tensor
    """``[B]`` long, prompt lengths (>= 1)."""
    stop_strings: NotRequired[list[list[str] | None]]
    """Per-sample stop strings (or ``None``), added to ``policy.generation.stop_strings``."""
    pixel_values: NotRequired[list[torch.Tensor | None]]
    """Per-sample image patches ``[N, D]`` (the model's processor's), ``None`` for a sample without images."""
    image_grid_thw: NotRequired[list[torch.Tensor | None]]
    """Per-sample image patch grids ``[I, 3]``, ``None`` exactly where ``pixel_values`` is."""


class GenerationOutputSpec(TypedDict):
    """Keys of the batch :meth:`GenerationInterface.generate` returns (see the module docstring)."""

    output_ids: torch.Tensor
    """``[B, T']`` long, prompt then response, right-padded with the pad id."""
    logprobs: torch.Tensor
    """``[B, T']`` float32, generated tokens' log-probs under the sampling distribution; 0 elsewhere."""
    generation_lengths: torch.Tensor
    """``[B]`` long, tokens generated."""
    unpadded_sequence_lengths: torch.Tensor
    """``[B]`` long, prompt + response length."""
    truncated: torch.Tensor
    """``[B]`` bool, did not end with a stop token/string (length budget, or cut by the backend)."""


GENERATION_OUTPUT_KEYS = tuple(GenerationOutputSpec.__annotations__)


def empty_generation_output(data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    """The output batch of a shard with no rows (a replica that got no data), as wide as its ``input_ids``."""
    width = data["input_ids"].shape[1] if "input_ids" in data else 0
    return BatchedDataDict(
        output_ids=torch.zeros((0, width), dtype=torch.long),
        logprobs=torch.zeros((0, width), dtype=torch.float32),
        generation_lengths=torch.zeros(0, dtype=torch.long),
        unpadded_sequence_lengths=torch.zeros(0, dtype=torch.long),
        truncated=torch.zeros(0, dtype=torch.bool),
    )


def check_generation_input(data: BatchedDataDict[Any]) -> None:
    """Raise a ``ValueError`` saying what is wrong when ``data`` does not follow :class:`GenerationDatumSpec`."""
    missing = [key for key in ("input_ids", "input_lengths") if key not in data]
    if missing:
        raise ValueError(f"generation input lacks {missing}; it needs input_ids [B, T] and input_lengths [B]")
    input_ids, input_lengths = data["input_ids"], data["input_lengths"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("generation input_ids must be a [B, T] tensor of right-padded token ids")
    if not isinstance(input_lengths, torch.Tensor) or input_lengths.shape != input_ids.shape[:1]:
        raise ValueError(f"generation input_lengths must be a [B] tensor with B = {input_ids.shape[0]}")
    if input_ids.shape[0] == 0:
        raise ValueError("generation got an empty batch")
    if int(input_lengths.min()) < 1 or int(input_lengths.max()) > input_ids.shape[1]:
        raise ValueError(
            f"generation input_lengths must lie in [1, {input_ids.shape[1]}] (non-empty, right-padded prompts)"
        )
    stop_strings = data.get("stop_strings")
    if stop_strings is not None and (
        not isinstance(stop_strings, Sequence) or len(stop_strings) != input_ids.shape[0]
    ):
        raise ValueError(
            "generation stop_strings must be a list with one entry (list of strings or None) per sample"
        )
    _check_image_inputs(data.get("pixel_values"), data.get("image_grid_thw"), input_ids.shape[0])


def _check_image_inputs(pixel_values: Any, image_grid_thw: Any, num_rows: int) -> None:
    """Raise a ``ValueError`` when the per-row image fields do not pair up (see :class:`GenerationDatumSpec`)."""
    if pixel_values is None and image_grid_thw is None:
        return
    if not isinstance(pixel_values, list) or not isinstance(image_grid_thw, list):
        raise ValueError(
            "generation pixel_values and image_grid_thw come together, each a list with one entry per sample"
        )
    if len(pixel_values) != num_rows or len(image_grid_thw) != num_rows:
        raise ValueError(
            f"generation pixel_values and image_grid_thw need one entry per sample ({num_rows}), got "
            f"{len(pixel_values)} and {len(image_grid_thw)}"
        )
    for row, (pixels, grid) in enumerate(zip(pixel_values, image_grid_thw, strict=True)):
        if (pixels is None) != (grid is None):
            raise ValueError(f"generation row {row} has pixel_values or image_grid_thw but not both")
        if grid is not None and (
            grid.dim() != 2 or grid.shape[1] != 3 or int(grid.prod(-1).sum()) != pixels.shape[0]
        ):
            raise ValueError(
                f"generation row {row}: image_grid_thw {tuple(grid.shape)} does not describe its "
                f"{pixels.shape[0]} patches (it must be [images, 3] with t * h * w patches per image)"
            )


@runtime_checkable
class GenerationInterface(Protocol):
    """A generation backend: samples responses and receives refitted weights."""

    def generate(
        self, data: BatchedDataDict[Any], greedy: bool = False, seed: int | None = None
    ) -> BatchedDataDict[Any]:
        """Sample one response per row of ``data`` (:class:`GenerationDatumSpec`).

        Returns a batch of :class:`GenerationOutputSpec`, rows in the input order. ``greedy`` takes the most
        likely token at every step (deterministic, for evaluation). ``seed`` seeds this call's sampling: the
        same call with the same seed on the same replicas samples the same tokens, whatever calls came before
        (asynchronous GRPO derives it from the batch's prompts and policy version); by default the backend
        takes the next of its per-call seeds, whose position :meth:`state_dict` saves.
        """
        ...

    def prepare_for_generation(self) -> None:
        """Bring weights (and cache memory) back onto the devices before generating (colocated mode)."""
        ...

    def finish_generation(self) -> None:
        """Release memory after generating so colocated training gets the devices (drop KV caches, offload)."""
        ...

    def shutdown(self) -> None:
        """Stop the workers and release their bundles."""
        ...

    def state_dict(self) -> Mapping[str, Any]:
        """What a checkpoint must hold for a resumed run to sample as the uninterrupted one (the seed position)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back a :meth:`state_dict`."""
        ...

    # --- refit, receiver side ---------------------------------------------------------------------------
    @property
    def workers(self) -> list[ActorHandle]:
        """The generation actors in rank order; each has ``refit_receive(receiver) -> TransferStats``."""
        ...

    @property
    def worker_node_ids(self) -> list[str]:
        """Ray node id of each worker, in rank order (for choosing the refit transport)."""
        ...

    def expected_weights_manifest(self, scope: RefitScope = "full") -> WeightManifestDict:
        """The weights a refit of ``scope`` must deliver (:mod:`nemo_rl.weight_sync.scope`): full shapes, in
        the generation dtype."""
        ...

    @property
    def hosted_in_policy(self) -> bool:
        """Whether the engines live in the policy's worker processes (``embedded_cfg.in_policy_workers``):
        refits then copy in process (:meth:`refit_in_process`) instead of through a transport."""
        ...

    def refit_in_process(self, scope: RefitScope) -> dict[str, float]:
        """Copy the policy's current weights of ``scope`` into engines hosted in its processes; returns the
        ``refit/*`` metrics. Backends with workers of their own raise: they receive through a transport."""
        ...

    def held_weight_checksums(self) -> list[EngineChecksums]:
        """For the refit guard (:mod:`nemo_rl.weight_sync.guard`): per replica, the checksums of the weights
        each of its ranks holds (``None`` for one that cannot report now); engines in the policy report none."""
        ...

    # --- healing (docs/reliability.md, "A generation pool that heals itself") ------------------------------
    def set_refill(self, refill: Callable[[Sequence[int]], None] | None) -> None:
        """Give the run's function that loads its current weights into the workers of the given ranks after
        they were replaced (backends whose engines live in the policy's processes never replace one)."""
        ...

    def replace_lost_workers(self) -> bool:
        """Replace the workers that died or hang (after a call that failed without naming its worker, such as
        a refit); whether any was. False for engines that live in the policy's processes."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """What the backend measured since the last call, for the step's metrics (``generation/*``)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full weights held by the driver into every worker (small models, tests, checkpoints).

        Every expected weight must be given exactly once; large models should refit through
        :func:`nemo_rl.weight_sync.refit.refit` instead.
        """
        ...
