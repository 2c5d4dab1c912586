"""Pure conversions between nemo_rl's generation contract and vLLM's objects.

Nothing here imports vLLM: the worker hands in vLLM's ``SamplingParams`` class and the ``CompletionOutput``
objects vLLM returns, so every conversion runs (and is tested) on a machine without vLLM or a GPU. What an
engine is started with (build checks, engine arguments, ports, environment) is :mod:`.engine_setup`'s.
``tests/unit/test_vllm_contract.py`` checks the same functions against vLLM's real classes.

Legend: ``B`` rows of a batch, ``T`` input width, ``T'`` output width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

from nemo_rl.config.policy import GenerationConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.interfaces import WeightManifestDict
from nemo_rl.models.hf_moe import per_expert_manifest
from nemo_rl.models.vlm import is_vision_language
from nemo_rl.weight_sync.manifest import dtype_name

RELOAD_WEIGHTS_RPC = "nemo_rl_reload_hf_weights"
"""The :class:`~nemo_rl.models.generation.vllm.worker_extension.VllmWorkerExtension` method refit calls."""

WEIGHT_CHECKSUMS_RPC = "nemo_rl_weight_checksums"
"""The :class:`~nemo_rl.models.generation.vllm.worker_extension.VllmWorkerExtension` method the refit guard
calls."""

FINISH_STOP = "stop"
"""A stop token or stop string ended the response."""
FINISH_LENGTH = "length"
"""The response used its whole token budget (``max_tokens``) or reached ``max_model_len``."""
FINISH_REPETITION = "repetition"
"""vLLM's repetition detection cut the response (only with ``SamplingParams.repetition_detection``)."""
TRUNCATING_FINISH_REASONS = (FINISH_LENGTH, FINISH_REPETITION)
"""Finish reasons of a response that did not end by itself: it counts as ``truncated``."""
RETRIED_FINISH_REASONS = ("error", "abort")
"""Finish reasons of a request that produced no usable response: vLLM's retryable request-level error
(e.g. a failed KV-cache load) and an aborted request. The worker sends such rows again."""

# Per-request seeds stay below 2**31: vLLM keeps them in fixed-width integer tensors.
_SEED_MODULUS = 2**31
# Mixes (call seed, dp rank, row) into one request seed; a large odd multiplier keeps them apart.
_SEED_MIX = 1_000_003


def prompt_token_ids(input_ids_BT: torch.Tensor, input_lengths_B: torch.Tensor) -> list[list[int]]:
    """The prompts of a right-padded batch as token id lists (padding dropped)."""
    return [row[:length].tolist() for row, length in zip(input_ids_BT, input_lengths_B.tolist(), strict=True)]


def generation_budgets(
    input_lengths_B: torch.Tensor, max_new_tokens: int, max_sequence_length: int
) -> list[int]:
    """Most tokens each row may generate: ``max_new_tokens``, less when the sequence limit is closer (>= 0)."""
    return [max(0, min(max_new_tokens, max_sequence_length - length)) for length in input_lengths_B.tolist()]


def request_seeds(seed: int, dp_rank: int, num_rows: int) -> list[int]:
    """One sampling seed per row, from the driver's per-call ``seed``, the replica and the row."""
    return [((seed * _SEED_MIX + dp_rank) * _SEED_MIX + row) % _SEED_MODULUS for row in range(num_rows)]


def row_stop_strings(
    configured: Sequence[str] | None, per_row: Sequence[Sequence[str] | None] | None, num_rows: int
) -> list[list[str]]:
    """Each row's stop strings: the configured ones then the row's own, without repeats."""
    if per_row is not None and len(per_row) != num_rows:
        raise ValueError(f"stop_strings has {len(per_row)} entries for {num_rows} rows")
    rows = [
        list(dict.fromkeys([*(configured or ()), *((per_row[b] or ()) if per_row is not None else ())]))
        for b in range(num_rows)
    ]
    if any(stop == "" for row in rows for stop in row):
        raise ValueError("stop strings must be non-empty")
    return rows


def sampling_params_for_rows(
    sampling_params_cls: Any,
    gen_cfg: GenerationConfig,
    *,
    budgets: Sequence[int],
    stop_strings: Sequence[Sequence[str] | None] | None,
    stop_token_ids: Sequence[int],
    greedy: bool,
    seeds: Sequence[int],
) -> list[Any | None]:
    """One ``sampling_params_cls`` (``vllm.SamplingParams``) per row; ``None`` for rows with no budget.

    Greedy rows take temperature 0 (vLLM's greedy decoding) with no top-k/top-p and no seed. Sampled rows
    use ``policy.generation``'s temperature, top-p and top-k (``0`` = off) with their own seed, so a call
    replays exactly whatever else vLLM batches with it. Every row asks for ``logprobs=0``: only the sampled
    token's log-prob. Stop tokens and stop strings stay in the output (the contract counts them); rows
    without stop strings are not detokenized (nemo_rl reads token ids only).
    """
    if len(budgets) != len(seeds):
        raise ValueError(f"got {len(budgets)} budgets for {len(seeds)} seeds")
    stops = row_stop_strings(gen_cfg.stop_strings, stop_strings, len(budgets))
    params: list[Any | None] = []
    for budget, row_stops, seed in zip(budgets, stops, seeds, strict=True):
        if budget <= 0:
            params.append(None)
            continue
        params.append(
            sampling_params_cls(
                n=1,
                max_tokens=budget,
                temperature=0.0 if greedy else gen_cfg.temperature,
                top_p=1.0 if greedy else gen_cfg.top_p,
                top_k=0 if greedy or gen_cfg.top_k is None else gen_cfg.top_k,
                seed=None if greedy else seed,
                stop_token_ids=list(stop_token_ids),
                stop=row_stops or None,
                include_stop_str_in_output=True,
                # Only stop strings need text; without them vLLM skips its per-token detokenization.
                detokenize=bool(row_stops),
                logprobs=0,
            )
        )
    return params


class _LogprobLike(Protocol):
    logprob: float


class CompletionLike(Protocol):
    """What :func:`assemble_outputs` reads of a vLLM ``CompletionOutput``."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def logprobs(self) -> Sequence[Mapping[int, _LogprobLike] | None] | None: ...

    @property
    def finish_reason(self) -> str | None: ...


def rows_to_retry(completions: Sequence[CompletionLike]) -> list[int]:
    """Indices of the completions that finished with one of :data:`RETRIED_FINISH_REASONS`."""
    return [
        i for i, completion in enumerate(completions) if completion.finish_reason in RETRIED_FINISH_REASONS
    ]


def _sampled_logprobs(row: int, completion: CompletionLike, token_ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs of one completion (vLLM's ``list[dict]`` or ``FlatLogprobs``)."""
    positions = completion.logprobs
    if positions is None:
        raise RuntimeError(f"vLLM returned no logprobs for row {row}; the request must set logprobs=0")
    if len(positions) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {len(positions)} logprob positions for the {len(token_ids)} tokens of row {row}"
        )
    values = []
    for step, token in enumerate(token_ids):
        candidates = positions[step]
        if not candidates or token not in candidates:
            raise RuntimeError(f"vLLM's logprobs for row {row}, step {step} lack the sampled token {token}")
        values.append(float(candidates[token].logprob))
    return values


def assemble_outputs(
    input_ids_BT: torch.Tensor,
    input_lengths_B: torch.Tensor,
    completions: Sequence[CompletionLike | None],
    pad_token_id: int,
) -> BatchedDataDict[Any]:
    """The generation contract's output batch from one vLLM completion per row (``None``: no budget).

    ``output_ids[b]`` holds the prompt, the generated tokens right after it, then ``pad_token_id``;
    ``logprobs`` the sampled tokens' log-probs at the same positions (0 elsewhere). A row without a
    completion generated nothing and counts as truncated (its prompt already fills the sequence limit), as
    does a completion that finished for one of :data:`TRUNCATING_FINISH_REASONS`. Any finish reason but
    those and ``"stop"`` (retried rows that failed again, an unfinished request) is an error.
    """
    num_rows, input_width = input_ids_BT.shape
    if len(completions) != num_rows:
        raise ValueError(f"got {len(completions)} completions for {num_rows} rows")
    tokens: list[list[int]] = []
    logprobs: list[list[float]] = []
    truncated: list[bool] = []
    for row, completion in enumerate(completions):
        if completion is None:
            tokens.append([])
            logprobs.append([])
            truncated.append(True)
            continue
        if completion.finish_reason not in (FINISH_STOP, *TRUNCATING_FINISH_REASONS):
            raise RuntimeError(
                f"vLLM finished row {row} with reason {completion.finish_reason!r}; expected one of "
                f"{(FINISH_STOP, *TRUNCATING_FINISH_REASONS)}"
            )
        row_tokens = [int(t) for t in completion.token_ids]
        tokens.append(row_tokens)
        logprobs.append(_sampled_logprobs(row, completion, row_tokens))
        truncated.append(completion.finish_reason in TRUNCATING_FINISH_REASONS)

    generation_lengths_B = torch.tensor([len(t) for t in tokens], dtype=torch.long)
    lengths_B = input_lengths_B.to(dtype=torch.long, device="cpu")
    width = input_width + (int(generation_lengths_B.max()) if num_rows else 0)
    output_ids_BT = torch.full((num_rows, width), pad_token_id, dtype=torch.long)
    logprobs_BT = torch.zeros((num_rows, width), dtype=torch.float32)
    for row in range(num_rows):
        start = int(lengths_B[row])
        end = start + len(tokens[row])
        output_ids_BT[row, :start] = input_ids_BT[row, :start].to(torch.long)
        output_ids_BT[row, start:end] = torch.tensor(tokens[row], dtype=torch.long)
        logprobs_BT[row, start:end] = torch.tensor(logprobs[row], dtype=torch.float32)
    return BatchedDataDict(
        output_ids=output_ids_BT,
        logprobs=logprobs_BT,
        generation_lengths=generation_lengths_B,
        unpadded_sequence_lengths=lengths_B + generation_lengths_B,
        truncated=torch.tensor(truncated, dtype=torch.bool),
    )


def hf_weights_manifest(
    config: PretrainedConfig, dtype: torch.dtype, *, trust_remote_code: bool
) -> WeightManifestDict:
    """``{hf_name: (full shape, dtype name)}`` of the weights a policy sends for the model of ``config``
    (a MoE model's experts one by one, :func:`~nemo_rl.models.hf_moe.per_expert_manifest`).

    The model is built on the meta device (no memory, no weights): its parameters (a tied output
    embedding appears once, under the input embedding's name) and persistent buffers, exactly what a
    policy's Hugging Face state streams. Floating-point weights travel in ``dtype`` (the generation dtype).
    """
    # A vision-language model is transformers' image-text class, the policy's (tower and projection included).
    auto_cls = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto_cls.from_config(config, trust_remote_code=trust_remote_code)
    manifest: WeightManifestDict = {
        name: (tuple(param.shape), dtype_name(dtype)) for name, param in model.named_parameters()
    }
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            wire_dtype = dtype if buffer.is_floating_point() else buffer.dtype
            manifest[full_name] = (tuple(buffer.shape), dtype_name(wire_dtype))
    # Experts travel one tensor per expert (what the worker extension hands vLLM's loaders anyway).
    return per_expert_manifest(manifest)
