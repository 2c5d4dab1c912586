"""Batched sampling with a preallocated KV cache over :class:`~.model.DecoderLM`.

One :meth:`EmbeddedEngine.generate` call runs the right-padded prompts through one prefill (each distinct
prompt once: GRPO's repeats of a prompt get copies of its cache row), then decodes one token per step for
every unfinished sequence. Rows whose sequences finished keep their slot until a
quarter of the rows are finished, then the cache and the step state are compacted so finished sequences
stop costing compute (compacting at every finish would copy the cache more often than it saves).

A decode step is a fixed, short list of tensor ops: at batch 64 on a ~1M-parameter model the Python and
dispatcher cost of each op is a sizeable share of the step. So the prompts are left-aligned in the KV cache
(every row writes each step's keys into the same slot, see :class:`~.kv_cache.KVCache`), sampled tokens go
into a per-row buffer by plain column copies, a row's results are copied out once when it finishes, and the
checks for finished rows run only when they can fire (stop tokens or strings configured, or a step where some
row's budget runs out).

Prompts may carry images (a vision-language model, :mod:`.vision`): the vision tower then encodes each distinct
prompt's images once, in the prefill, and decoding rotates each row at its prompt's multimodal offset
(:mod:`.mrope`). A text batch runs exactly the text path.

Sampling and the log-probabilities it returns are :mod:`.sampler`'s.

Tensor legend: B = sequences (or cache rows), T = tokens, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from nemo_rl.models.generation.embedded.images import PromptImages
from nemo_rl.models.generation.embedded.model import DecoderLM, KVCache
from nemo_rl.models.generation.embedded.mrope import ImagePrefill
from nemo_rl.models.generation.embedded.routing import RoutingLog
from nemo_rl.models.generation.embedded.rows import Generated, Rows
from nemo_rl.models.generation.embedded.sampler import SamplingParams, sample_tokens
from nemo_rl.models.generation.embedded.vision import VisionLanguageLM
from nemo_rl.models.generation.in_flight import InFlightWeights

__all__ = ["EmbeddedEngine", "EngineOutput", "SamplingParams", "sample_tokens"]

# Compact the active rows once this fraction of them has finished.
_COMPACT_FRACTION = 0.25
# Extra tokens decoded in front of the newest one when looking for a stop string: tokens that decode to
# nothing (special tokens) or to partial characters could otherwise hide the start of a match.
_STOP_STRING_SLACK_TOKENS = 4


@dataclass
class EngineOutput:
    """Result of one :meth:`EmbeddedEngine.generate` call, in the layout of the generation contract.

    ``output_ids[b]`` is the prompt (its first ``input_lengths[b]`` tokens), then the ``generation_lengths[b]``
    generated tokens, then pad; the width is the input width plus the longest generation.
    """

    output_ids: torch.Tensor
    """``[B, T_in + max generation length]`` long, prompt + response, right-padded with the pad id."""
    logprobs: torch.Tensor
    """``[B, T_in + max generation length]`` float32, sampled tokens' log-probs, 0 at prompt and pad."""
    generation_lengths: torch.Tensor
    """``[B]`` long, tokens generated per sequence (a stop token counts)."""
    unpadded_sequence_lengths: torch.Tensor
    """``[B]`` long, prompt length + generation length."""
    truncated: torch.Tensor
    """``[B]`` bool, the sequence ran out of budget (max_new_tokens or max sequence length) without a stop."""
    routed_experts: torch.Tensor | None = None
    """``[B, T_in + max generation length, MoE layers, top_k]`` int16, the experts each token was routed to,
    -1 where no forward ran it (see :mod:`.routing`); only when the engine records routing."""


def _seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """This call's random generator: equal inputs and seeds give equal samples."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _stop_token_ids(params: SamplingParams, device: torch.device) -> torch.Tensor | None:
    """The stop tokens as a tensor for ``torch.isin``, None when there are none (no per-step check)."""
    if not params.stop_token_ids:
        return None
    return torch.tensor(sorted(params.stop_token_ids), dtype=torch.long, device=device)


class EmbeddedEngine:
    """Samples continuations of right-padded prompts with a :class:`DecoderLM`.

    Args:
        model: the decoder (its device and dtype are the engine's).
        pad_token_id: id written into padding positions of the outputs.
        max_sequence_length: longest prompt + response; a sequence reaching it stops as truncated.
        decode_fn: token ids -> text, needed only when stop strings are used (e.g. ``tokenizer.decode``).
    """

    def __init__(
        self,
        model: DecoderLM,
        *,
        pad_token_id: int,
        max_sequence_length: int,
        decode_fn: Callable[[list[int]], str] | None,
    ):
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_sequence_length = max_sequence_length
        self.decode_fn = decode_fn
        self._cache: KVCache | None = None
        self.in_flight = InFlightWeights(model.load_weights)
        """Stages weights a refit delivers while this engine decodes; the decode loop applies them between
        two steps (asynchronous GRPO's in-flight updates)."""
        self.recompute_kv_cache = False
        """After an in-flight update, recompute the running rows' keys and values with the new weights."""
        self.record_routing = False
        """Return each token's experts per MoE layer (``EngineOutput.routed_experts``; routing replay)."""
        self._routing: RoutingLog | None = None
        self._images: PromptImages | None = None
        """The images of the running call's prompts (None for text)."""

    def release_cache(self) -> None:
        """Drop the preallocated KV cache (it is reallocated by the next call)."""
        self._cache = None

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a stream of Hugging Face-named full tensors: at once when no generation call runs, otherwise
        between two of its decode steps (see :class:`~nemo_rl.models.generation.in_flight.InFlightWeights`)."""
        self.in_flight.receive(named_tensors)

    def _cache_for(self, num_rows: int, num_positions: int) -> KVCache:
        """The retained cache if it is large enough, else a new one at least as large as both."""
        old = self._cache
        if old is not None and old.num_rows >= num_rows and old.num_positions >= num_positions:
            return old
        if old is not None:
            num_rows, num_positions = max(num_rows, old.num_rows), max(num_positions, old.num_positions)
        self._cache = None  # free the old buffer before allocating the new one
        self._cache = KVCache(self.model.arch, num_rows, num_positions, self.model.dtype, self.model.device)
        return self._cache

    def _check_inputs(self, input_ids_BT: torch.Tensor, input_lengths_B: torch.Tensor) -> None:
        if input_ids_BT.dim() != 2 or input_ids_BT.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"input_ids must be an integer [B, T] tensor, got {input_ids_BT.dtype} {tuple(input_ids_BT.shape)}"
            )
        if input_lengths_B.shape != input_ids_BT.shape[:1]:
            raise ValueError(
                f"input_lengths has shape {tuple(input_lengths_B.shape)}, expected [{input_ids_BT.shape[0]}] (one per row)"
            )
        if input_ids_BT.shape[0] and (
            int(input_lengths_B.min()) < 1 or int(input_lengths_B.max()) > input_ids_BT.shape[1]
        ):
            raise ValueError(
                f"input_lengths must be in [1, {input_ids_BT.shape[1]}] (prompts are non-empty and right-padded), "
                f"got values in [{int(input_lengths_B.min())}, {int(input_lengths_B.max())}]"
            )

    @torch.inference_mode()
    def generate(
        self,
        input_ids_BT: torch.Tensor,
        input_lengths_B: torch.Tensor,
        params: SamplingParams,
        *,
        greedy: bool,
        seed: int,
        stop_strings: Sequence[Sequence[str] | None] | None = None,
        images: PromptImages | None = None,
    ) -> EngineOutput:
        """Sample a response for every right-padded prompt.

        Args:
            input_ids_BT: prompts, right-padded.
            input_lengths_B: prompt lengths (>= 1).
            params: sampling settings.
            greedy: take the most likely token at every step (deterministic; ``seed`` unused).
            seed: seeds this call's random generator, so equal inputs and seeds give equal samples.
            stop_strings: optional per-sequence stop strings, added to ``params.stop_strings``.
            images: the prompts' images (a vision-language model only; ``None`` for text prompts).
        """
        self._check_inputs(input_ids_BT, input_lengths_B)
        if images is not None and not isinstance(self.model, VisionLanguageLM):
            raise ValueError(
                f"the prompts carry images, but the engine's {self.model.arch.model_type} model is a text model"
            )
        device = self.model.device
        num_seqs = input_ids_BT.shape[0]
        lengths_B = input_lengths_B.to(device=device, dtype=torch.long)
        budget_B = (self.max_sequence_length - lengths_B).clamp(min=0, max=params.max_new_tokens)
        row_stops = self._row_stop_strings(params, stop_strings, num_seqs)

        max_budget = int(budget_B.max()) if num_seqs else 0
        self._images = images
        try:
            with self.in_flight.generating():
                return self._generate(
                    input_ids_BT, lengths_B, budget_B, max_budget, params, greedy, seed, row_stops
                )
        finally:
            self._images = None

    def _generate(
        self,
        input_ids_BT: torch.Tensor,
        lengths_B: torch.Tensor,
        budget_B: torch.Tensor,
        max_budget: int,
        params: SamplingParams,
        greedy: bool,
        seed: int,
        row_stops: list[tuple[str, ...]],
    ) -> EngineOutput:
        device, pad = self.model.device, self.pad_token_id
        num_seqs = input_ids_BT.shape[0]
        generated = Generated(
            tokens_BT=torch.full((num_seqs, max_budget), pad, dtype=torch.long, device=device),
            logprobs_BT=torch.zeros((num_seqs, max_budget), dtype=torch.float32, device=device),
            lengths_B=torch.zeros(num_seqs, dtype=torch.long, device=device),
            truncated_B=budget_B == 0,
        )
        width = int(lengths_B.max()) + max_budget if num_seqs else 0
        self._routing = RoutingLog(self.model, num_seqs, width) if self.record_routing else None
        if max_budget > 0:
            self._decode_loop(
                input_ids_BT.to(device), lengths_B, budget_B, params, greedy, seed, row_stops, generated
            )
            # The sampler skips multinomial's per-step input checks (see sampler._draw); non-finite logits
            # would otherwise pass silently as NaN log-probs and arbitrary tokens. One check per call instead,
            # over the tokens rows kept (positions past a row's end may hold what its unused cache slots gave).
            kept_BT = torch.arange(max_budget, device=device)[None, :] < generated.lengths_B[:, None]
            if not bool(torch.isfinite(generated.logprobs_BT[kept_BT]).all()):
                raise FloatingPointError(
                    "the model produced non-finite logits while generating (NaN/inf weights or activations): "
                    "check the policy's last training step (train/nonfinite_steps) and its learning rate"
                )
        return self._assemble(input_ids_BT.to(device), lengths_B, generated)

    def _row_stop_strings(
        self, params: SamplingParams, stop_strings: Sequence[Sequence[str] | None] | None, num_seqs: int
    ) -> list[tuple[str, ...]]:
        if stop_strings is not None and len(stop_strings) != num_seqs:
            raise ValueError(f"stop_strings has {len(stop_strings)} entries for {num_seqs} sequences")
        rows = [
            tuple(dict.fromkeys([*params.stop_strings, *((stop_strings[i] or ()) if stop_strings else ())]))
            for i in range(num_seqs)
        ]
        if any(rows) and self.decode_fn is None:
            raise ValueError(
                "stop strings need a decode_fn (the tokenizer's decode) to be given to the engine"
            )
        if any(s == "" for row in rows for s in row):
            raise ValueError("stop strings must be non-empty")
        return rows

    def _decode_loop(
        self,
        input_ids_BT: torch.Tensor,
        lengths_B: torch.Tensor,
        budget_B: torch.Tensor,
        params: SamplingParams,
        greedy: bool,
        seed: int,
        row_stops: list[tuple[str, ...]],
        generated: Generated,
    ) -> None:
        """Prefill, then sample step by step into ``generated`` (indexed by sequence) until every row stops."""
        model, device = self.model, self.model.device
        num_seqs = input_ids_BT.shape[0]
        max_prompt = int(lengths_B.max())
        max_budget = generated.tokens_BT.shape[1]
        # Every prompt ends in slot max_prompt - 1 and step t's token is stored in slot max_prompt + t.
        cache = self._cache_for(num_seqs, max_prompt + max_budget)
        model.ensure_positions(max_prompt + max_budget)
        generator = _seeded_generator(seed, device) if not greedy else None
        stop_ids = _stop_token_ids(params, device)
        any_stop_strings = any(row_stops)
        max_stop_chars = max((len(s) for row in row_stops for s in row), default=0)
        # Steps after which some row has used its whole budget: the only steps that need a budget check.
        budget_ends = set(budget_B.tolist())
        logits_BV, rope_offset_B = self._prefill_distinct(input_ids_BT[:, :max_prompt], lengths_B, cache)
        rows = Rows.start(lengths_B, budget_B, max_budget, row_stops, rope_offset_B)
        num_alive = int(rows.alive_B.sum())
        for step in range(max_budget):
            tokens_B, logprobs_B = sample_tokens(logits_BV, params, greedy=greedy, generator=generator)
            # Every row writes its column; those of finished rows are never copied out.
            rows.tokens_BT[:, step] = tokens_B
            rows.logprobs_BT[:, step] = logprobs_B
            stopped_B = None if stop_ids is None else torch.isin(tokens_B, stop_ids)
            if any_stop_strings:
                hits_B = self._stop_string_hits(rows, step, max_stop_chars)
                stopped_B = hits_B if stopped_B is None else stopped_B | hits_B
            exhausted_B = rows.budget_B == step + 1 if step + 1 in budget_ends else None
            if stopped_B is not None or exhausted_B is not None:
                num_alive -= self._finish_rows(rows, generated, step, stopped_B, exhausted_B)
            if num_alive == 0:
                break
            num_rows = rows.alive_B.shape[0]
            num_slots = max_prompt + step + 1
            if num_rows - num_alive >= max(1, int(num_rows * _COMPACT_FRACTION)):
                keep = rows.alive_B.nonzero().squeeze(1)
                cache.select_rows(keep, num_slots)
                rows = rows.select(keep)
                tokens_B = tokens_B[keep]
            # Weights a refit delivered during this call (asynchronous GRPO's in-flight updates).
            if self.in_flight.has_pending and self.in_flight.apply_pending() and self.recompute_kv_cache:
                self._recompute_cache(input_ids_BT[:, :max_prompt], lengths_B, rows, step, cache)
            logits_BV = self._decode_step(tokens_B, rows, cache, num_slots)
            # Finished rows still in the batch advance too (their slot is shared); positions stay below slots.
            rows.positions_B += 1

    def _recompute_cache(
        self, prompts_BT: torch.Tensor, lengths_B: torch.Tensor, rows: Rows, step: int, cache: KVCache
    ) -> None:
        """Rebuild the keys and values of ``rows`` (prompt, then the tokens sampled before ``step``) with the
        current weights (the vision tower's too), in the slots the decode loop put them in."""
        model = self.model
        max_prompt = prompts_BT.shape[1]
        prompts_RT, lengths_R = prompts_BT[rows.orig_B], lengths_B[rows.orig_B]
        images = None
        if self._images is not None:
            images, _ = self._image_prefill(prompts_RT, lengths_R, self._images.select(rows.orig_B.tolist()))
        model.prefill(prompts_RT, lengths_R, cache, images)
        rope_positions_B = rows.rope_positions()
        for j in range(step):
            model.decode(rows.tokens_BT[:, j], rope_positions_B - (step - j), cache, max_prompt + j + 1)

    def _prefill_distinct(
        self, input_ids_BT: torch.Tensor, lengths_B: torch.Tensor, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`DecoderLM.prefill` of each distinct prompt once, its cache row then copied to its repeats;
        returns the last logits ``[B, V]`` and, for image prompts, each row's rotary offset ``[B]``.

        GRPO asks for several samples of every prompt, so a batch often holds each prompt 8 or 16 times; the
        prefill (and the vision tower) is most of a short generation's compute, and a row's keys, values and
        last logits depend on its own tokens (and images) only.
        """
        num_rows, width = input_ids_BT.shape
        keys_BT = torch.cat((input_ids_BT, lengths_B[:, None]), dim=1)
        if self._images is not None:
            keys_BT = torch.cat((keys_BT, self._images.identity_B().to(keys_BT.device)[:, None]), dim=1)
        distinct_UT, inverse_B = torch.unique(keys_BT, dim=0, return_inverse=True)
        num_distinct = distinct_UT.shape[0]
        if num_distinct == num_rows:
            every_B = torch.arange(num_rows, device=lengths_B.device)
            return self._prefill(input_ids_BT, lengths_B, cache, every_B, self._images)
        images_U = None
        if self._images is not None:
            first_U = torch.full((num_distinct,), num_rows, dtype=torch.long, device=inverse_B.device)
            first_U.scatter_reduce_(0, inverse_B, torch.arange(num_rows, device=inverse_B.device), "amin")
            images_U = self._images.select(first_U.tolist())
        logits_UV, offset_U = self._prefill(
            distinct_UT[:, :width], distinct_UT[:, width], cache, inverse_B, images_U
        )
        cache.select_rows(inverse_B, width)
        return logits_UV[inverse_B], None if offset_U is None else offset_U[inverse_B]

    def _prefill(
        self,
        input_ids_UT: torch.Tensor,
        lengths_U: torch.Tensor,
        cache: KVCache,
        inverse_B: torch.Tensor,
        images_U: PromptImages | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`DecoderLM.prefill` (with the prompts' images), its routing recorded for the sequences
        ``inverse_B`` maps to prompts; returns the last logits and the image prompts' rotary offsets."""
        images, offset_U = None, None
        if images_U is not None:
            images, offset_U = self._image_prefill(input_ids_UT, lengths_U, images_U)
        if self._routing is None:
            return self.model.prefill(input_ids_UT, lengths_U, cache, images), offset_U
        with self._routing.capture() as sink:
            logits_UV = self.model.prefill(input_ids_UT, lengths_U, cache, images)
        self._routing.record_prefill(sink, lengths_U, input_ids_UT.shape[1], inverse_B)
        return logits_UV, offset_U

    def _image_prefill(
        self, input_ids_UT: torch.Tensor, lengths_U: torch.Tensor, images_U: PromptImages
    ) -> tuple[ImagePrefill, torch.Tensor]:
        """The vision tower's features and the multimodal positions of prompts ``U``, and their rotary offsets."""
        assert isinstance(self.model, VisionLanguageLM), "generate() refuses images for a text model"
        pixel_values_ND, grid_thw_I3 = images_U.concatenated()
        return self.model.image_prefill(input_ids_UT, lengths_U, pixel_values_ND, grid_thw_I3)

    def _decode_step(
        self, tokens_B: torch.Tensor, rows: Rows, cache: KVCache, num_slots: int
    ) -> torch.Tensor:
        """:meth:`DecoderLM.decode` of the rows' newest tokens, its routing recorded by sequence and position."""
        if self._routing is None:
            return self.model.decode(tokens_B, rows.rope_positions(), cache, num_slots)
        with self._routing.capture() as sink:
            logits_BV = self.model.decode(tokens_B, rows.rope_positions(), cache, num_slots)
        self._routing.record_step(sink, rows.orig_B, rows.positions_B)
        return logits_BV

    @staticmethod
    def _finish_rows(
        rows: Rows,
        generated: Generated,
        step: int,
        stopped_B: torch.Tensor | None,
        exhausted_B: torch.Tensor | None,
    ) -> int:
        """Retire the live rows that stopped or used their budget at ``step``: copy their tokens and
        log-probs out, record length and truncation; return how many finished."""
        if stopped_B is None:
            assert exhausted_B is not None
            finished_B = exhausted_B & rows.alive_B
        elif exhausted_B is None:
            finished_B = stopped_B & rows.alive_B
        else:
            finished_B = (stopped_B | exhausted_B) & rows.alive_B
        if not bool(finished_B.any()):
            return 0
        idx = finished_B.nonzero().squeeze(1)
        seqs = rows.orig_B[idx]
        generated.tokens_BT[seqs] = rows.tokens_BT[idx]
        generated.logprobs_BT[seqs] = rows.logprobs_BT[idx]
        generated.lengths_B[seqs] = step + 1
        if exhausted_B is not None:
            truncated = exhausted_B[idx] if stopped_B is None else exhausted_B[idx] & ~stopped_B[idx]
            generated.truncated_B[seqs] = truncated
        rows.alive_B[idx] = False
        return idx.numel()

    def _stop_string_hits(self, rows: Rows, step: int, max_stop_chars: int) -> torch.Tensor:
        """Rows whose generated text now contains one of their stop strings (ending in the newest token)."""
        assert self.decode_fn is not None
        hits = torch.zeros_like(rows.alive_B)
        start = max(0, step + 1 - max_stop_chars - _STOP_STRING_SLACK_TOKENS)
        alive = rows.alive_B.tolist()
        live = [r for r, stops in enumerate(rows.stops) if stops and alive[r]]
        if not live:
            return hits
        tails = rows.tokens_BT[live, start : step + 1].tolist()
        for r, tail in zip(live, tails, strict=True):
            text = self.decode_fn(tail)
            if any(s in text for s in rows.stops[r]):
                hits[r] = True
        return hits

    def _assemble(
        self, input_ids_BT: torch.Tensor, lengths_B: torch.Tensor, generated: Generated
    ) -> EngineOutput:
        """Lay prompt and response side by side per row (response right after the prompt's last token)."""
        num_seqs, input_width = input_ids_BT.shape
        device = input_ids_BT.device
        gen_lengths_B = generated.lengths_B
        max_gen = int(gen_lengths_B.max()) if num_seqs else 0
        width = input_width + max_gen
        in_prompt = torch.arange(input_width, device=device)[None, :] < lengths_B[:, None]
        output_ids = torch.full((num_seqs, width + 1), self.pad_token_id, dtype=torch.long, device=device)
        output_ids[:, :input_width] = torch.where(in_prompt, input_ids_BT.long(), self.pad_token_id)
        logprobs = torch.zeros((num_seqs, width + 1), dtype=torch.float32, device=device)
        offsets = torch.arange(max_gen, device=device)[None, :]
        cols = torch.where(offsets < gen_lengths_B[:, None], lengths_B[:, None] + offsets, width)
        output_ids.scatter_(1, cols, generated.tokens_BT[:, :max_gen])
        logprobs.scatter_(1, cols, generated.logprobs_BT[:, :max_gen])
        truncated_B = generated.truncated_B
        routing, self._routing = self._routing, None
        return EngineOutput(
            output_ids=output_ids[:, :width].cpu(),
            logprobs=logprobs[:, :width].cpu(),
            generation_lengths=gen_lengths_B.cpu(),
            unpadded_sequence_lengths=(lengths_B + gen_lengths_B).cpu(),
            truncated=truncated_B.cpu(),
            routed_experts=None if routing is None else routing.output(lengths_B + gen_lengths_B, width),
        )
