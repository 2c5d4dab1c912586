"""One replica of the embedded engine: a :class:`~.model.DecoderLM`, its :class:`~.engine.EmbeddedEngine` and
the seed derivation, whichever process holds it.

A separate generation worker (:class:`~.worker.EmbeddedGenerationWorker`) is a replica in a Ray actor of its
own; with ``policy.generation.embedded_cfg.in_policy_workers`` each DTensor policy worker holds one next to
its training model (:mod:`.in_policy`). Both run this code, so for the same weights, data shard, call seed and
data-parallel rank they sample the same tokens bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.device import cuda_available
from nemo_rl.models.generation.embedded.engine import EmbeddedEngine, SamplingParams
from nemo_rl.models.generation.embedded.images import PromptImages
from nemo_rl.models.generation.embedded.model import DecoderLM
from nemo_rl.models.generation.embedded.routing import ROUTED_EXPERTS_DTYPE
from nemo_rl.models.generation.embedded.vision import decoder_class
from nemo_rl.models.generation.interfaces import (
    WeightManifestDict,
    check_generation_input,
    empty_generation_output,
)
from nemo_rl.models.generation.lora import AdapterLayout, MergedAdapters, base_manifest_for
from nemo_rl.models.hf_decoder import resolve_checkpoint_dir
from nemo_rl.models.hf_moe import per_expert_weights
from nemo_rl.models.tokenizer import eos_token_ids, require_pad_token_id
from nemo_rl.weight_sync.checksums import Checksum, named_checksums
from nemo_rl.weight_sync.manifest import WeightManifest, dtype_from_name
from nemo_rl.weight_sync.scope import RefitScope

# Mixes (call seed, dp rank, chunk) into one generator seed; a large odd multiplier keeps them apart.
_SEED_MIX = 1_000_003


class EmbeddedReplica:
    """One engine replica generating for the shard of a batch it is handed.

    Args:
        cfg: the ``policy`` section (sampling settings, sequence limits, ``generation_batch_size``).
        tokenizer: pad and EOS ids, and decoding for stop strings.
        model: the engine's model (loaded, or to be loaded by a refit before the first call).
        checkpoint_dir: the model's local checkpoint folder (its ``generation_config.json`` adds EOS ids).
        dp_rank: this replica's data-parallel rank, mixed into its sampling seeds.
        device: where the weights live while generating.
    """

    def __init__(
        self,
        cfg: PolicyConfig,
        tokenizer: PreTrainedTokenizerBase,
        model: DecoderLM,
        *,
        checkpoint_dir: Path | None,
        dp_rank: int,
        device: torch.device,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.dp_rank = dp_rank
        self.device = device
        self.model = model
        self.sampling = SamplingParams.from_policy_config(cfg, eos_token_ids(tokenizer, checkpoint_dir))
        self.engine = EmbeddedEngine(
            model,
            pad_token_id=require_pad_token_id(tokenizer),
            max_sequence_length=cfg.max_total_sequence_length,
            decode_fn=self._decode,
        )
        self.engine.record_routing = cfg.router_replay.enabled
        layout = AdapterLayout.from_policy_config(
            cfg, self._base_manifest(), cfg.generation.embedded_cfg.precision
        )
        self.adapters: MergedAdapters | None = None if layout is None else MergedAdapters(layout)
        """With LoRA: the base copies of the adapted layers, which the adapters are merged into."""

    @classmethod
    def without_weights(
        cls, cfg: PolicyConfig, tokenizer: PreTrainedTokenizerBase, *, dp_rank: int, device: torch.device
    ) -> EmbeddedReplica:
        """A replica of ``cfg.model_name``'s architecture whose weights a refit loads before it generates
        (the in-policy replicas, which take their weights from the policy they live next to)."""
        from nemo_rl.models.hf_config import load_hf_config

        checkpoint_dir = resolve_checkpoint_dir(cfg.model_name)
        config = load_hf_config(checkpoint_dir, overrides=cfg.hf_config_overrides)
        model = decoder_class(config).from_config(
            config, dtype=dtype_from_name(cfg.generation.embedded_cfg.precision), device=device
        )
        return cls(cfg, tokenizer, model, checkpoint_dir=checkpoint_dir, dp_rank=dp_rank, device=device)

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    # ---------------------------------------------------------------------------------------- generate
    def generate(self, data: BatchedDataDict[Any], greedy: bool, seed: int) -> BatchedDataDict[Any]:
        """Generate for this replica's shard (see ``GenerationInterface.generate``), in chunks of
        ``policy.generation_batch_size`` rows; ``seed`` is the driver's per-call seed."""
        if data.size == 0:
            return self._empty_output(data)
        check_generation_input(data)
        chunk_size = self.cfg.generation_batch_size or data.size
        outputs = []
        for chunk_index, chunk in enumerate(data.make_microbatch_iterator(chunk_size)):
            chunk_seed = ((seed * _SEED_MIX + self.dp_rank) * _SEED_MIX + chunk_index) % (2**63)
            result = self.engine.generate(
                chunk["input_ids"],
                chunk["input_lengths"],
                self.sampling,
                greedy=greedy,
                seed=chunk_seed,
                stop_strings=chunk.get("stop_strings"),
                images=PromptImages.of_batch(chunk.get("pixel_values"), chunk.get("image_grid_thw")),
            )
            outputs.append(BatchedDataDict({k: v for k, v in vars(result).items() if v is not None}))
        if len(outputs) == 1:
            return outputs[0]
        return BatchedDataDict.from_batches(
            outputs, pad_value_dict={"output_ids": self.engine.pad_token_id, "routed_experts": -1}
        )

    def _empty_output(self, data: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
        """The output of an empty shard, with an empty ``routed_experts`` when the engine records routing."""
        out = empty_generation_output(data)
        moe = self.model.arch.moe
        if self.engine.record_routing and moe is not None:
            shape = (0, out["output_ids"].shape[1], sum(moe.sparse_layers), moe.top_k)
            out["routed_experts"] = torch.zeros(shape, dtype=ROUTED_EXPERTS_DTYPE)
        return out

    def prepare_for_generation(self) -> None:
        """Move offloaded weights back onto the device."""
        self.model.to(self.device)

    def finish_generation(self) -> None:
        """Drop the KV cache; on CUDA also offload the weights to host memory for colocated training."""
        self.engine.release_cache()
        if cuda_available():
            self.model.to("cpu")
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------------ weights
    def _base_manifest(self) -> WeightManifestDict:
        return {
            name: (shape, str(dtype).removeprefix("torch."))
            for name, (shape, dtype) in self.model.weights_manifest().items()
        }

    def expected_weights_manifest(self, scope: RefitScope = "full") -> WeightManifestDict:
        """``{hf_name: (full shape, dtype name)}`` of every weight a refit of ``scope`` must deliver (tied
        ones once; with LoRA the adapters too, see :mod:`nemo_rl.models.generation.lora`)."""
        layout = None if self.adapters is None else self.adapters.layout
        return base_manifest_for(layout, self._base_manifest(), scope)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Host copies of the held weights under their Hugging Face names (for checks and debugging)."""
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in self.model.named_weights()}

    def weight_checksums(self) -> dict[str, Checksum] | None:
        """The refit guard's checksums of the held weights under their Hugging Face names, as a refit sends
        them; with LoRA each adapted layer reports its kept base weight and adapters while it holds their merge
        (:meth:`~nemo_rl.models.generation.lora.MergedAdapters.as_sent`)."""
        weights = dict(self.model.named_weights())
        held = named_checksums(weights.items(), self.model.dtype)
        return held if self.adapters is None else self.adapters.as_sent(held, weights, self.model.dtype)

    def merged_stream(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], scope: RefitScope
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A refit stream of ``scope`` as the model loads it: with LoRA, the adapters merged into their layers."""
        if self.adapters is None:
            return iter(named_tensors)
        return self.adapters.merge(named_tensors, scope)

    def load_hf_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], scope: RefitScope = "full"
    ) -> None:
        """Copy a refit stream of ``scope`` (Hugging Face-named full tensors) into the model (the refit ``LoadFn``)."""
        self.model.load_weights(self.merged_stream(named_tensors, scope))

    def load_refit(self, named_tensors: Iterable[tuple[str, torch.Tensor]], scope: RefitScope) -> int:
        """Load an in-process refit stream of ``scope``, checking every expected weight arrives exactly once;
        return the payload's bytes in the generation dtype."""
        expected = WeightManifest.coerce(self.expected_weights_manifest(scope))
        seen: set[str] = set()

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            # 3-D expert weights (a policy's in-memory layout) are checked as the manifest's per-expert ones.
            for name, tensor in per_expert_weights(named_tensors):
                if name in seen:
                    raise ValueError(f"weight {name!r} was sent twice")
                seen.add(name)
                yield name, tensor

        self.load_hf_weights(checked(), scope)
        missing = sorted(set(expected) - seen)
        if missing:
            raise ValueError(f"the weight update lacks {len(missing)} weights, e.g. {missing[:5]}")
        return sum(expected[name].nbytes for name in seen if name in expected)

    def load_weights_from_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load ``named_tensors`` (the model's plain weights, e.g. a merged checkpoint) and check every
        expected weight arrived exactly once; return bytes loaded. With LoRA the kept base copies no longer
        describe the model, so only a full refit may follow."""
        if self.adapters is not None:
            self.adapters.forget_base()
        expected = set(self.model.weights_manifest())
        seen: set[str] = set()
        num_bytes = 0
        for name, tensor in per_expert_weights(named_tensors):
            if name in seen:
                raise ValueError(f"weight {name!r} was sent twice")
            num_bytes += self.model.load_weight(name, tensor)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(f"the weight update lacks {len(missing)} weights, e.g. {missing[:5]}")
        return num_bytes
