"""The embedded generation worker class in-process (no Ray): chunking, empty shards, stop strings, weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.tiny import build_tiny_model
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.embedded.replica import eos_token_ids
from nemo_rl.models.generation.embedded.worker import EmbeddedGenerationWorker
from nemo_rl.models.lora import merge_lora
from nemo_rl.weight_sync.errors import RefitIntegrityError
from nemo_rl.weight_sync.interfaces import TransferStats

TEXTS = ["What is 1+1?", "Hi", "What is 12+30? Answer:", "7-3=", "abc"]


def make_worker(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase, **policy: Any
) -> EmbeddedGenerationWorker:
    cfg = PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "max_total_sequence_length": 48,
            "generation": {"max_new_tokens": 10},
            **policy,
        }
    )
    return EmbeddedGenerationWorker(cfg, tokenizer)


def batch(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> BatchedDataDict[Any]:
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_token_id, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(r) for r in rows]))


def test_chunked_generation_equals_one_pass(tiny_assets: tuple[Path, PreTrainedTokenizerBase]) -> None:
    model_dir, tokenizer = tiny_assets
    whole = make_worker(model_dir, tokenizer).generate(batch(tokenizer, TEXTS), greedy=True, seed=0)
    chunked = make_worker(model_dir, tokenizer, generation_batch_size=2).generate(
        batch(tokenizer, TEXTS), greedy=True, seed=0
    )
    assert torch.equal(whole["unpadded_sequence_lengths"], chunked["unpadded_sequence_lengths"])
    for b in range(len(TEXTS)):
        end = int(whole["unpadded_sequence_lengths"][b])
        assert torch.equal(whole["output_ids"][b, :end], chunked["output_ids"][b, :end])
        assert (chunked["output_ids"][b, end:] == tokenizer.pad_token_id).all()


def test_empty_shard_gives_empty_outputs(tiny_assets: tuple[Path, PreTrainedTokenizerBase]) -> None:
    model_dir, tokenizer = tiny_assets
    worker = make_worker(model_dir, tokenizer)
    empty = batch(tokenizer, TEXTS).slice(0, 0)
    out = worker.generate(empty, greedy=False, seed=1)
    assert out.size == 0 and out["output_ids"].shape == (0, empty["input_ids"].shape[1])


def test_per_sample_stop_strings_reach_the_engine(tiny_assets: tuple[Path, PreTrainedTokenizerBase]) -> None:
    model_dir, tokenizer = tiny_assets
    worker = make_worker(model_dir, tokenizer)
    data = batch(tokenizer, TEXTS[:2])
    free = worker.generate(data, greedy=True, seed=0)
    start0 = int(data["input_lengths"][0])
    text0 = tokenizer.decode(free["output_ids"][0, start0 : int(free["unpadded_sequence_lengths"][0])])
    stop = text0[3]
    data["stop_strings"] = [[stop], None]
    out = worker.generate(data, greedy=True, seed=0)
    got0 = tokenizer.decode(out["output_ids"][0, start0 : int(out["unpadded_sequence_lengths"][0])])
    assert got0 == text0[: text0.index(stop) + 1]
    assert not bool(out["truncated"][0])


def test_weights_manifest_and_stream_loading(
    tiny_assets: tuple[Path, PreTrainedTokenizerBase], tmp_path: Path
) -> None:
    model_dir, tokenizer = tiny_assets
    worker = make_worker(model_dir, tokenizer, generation={"embedded_cfg": {"precision": "bfloat16"}})
    manifest = worker.expected_weights_manifest()
    hf = Qwen2ForCausalLM.from_pretrained(model_dir)
    assert manifest == {name: (tuple(p.shape), "bfloat16") for name, p in hf.named_parameters()}
    other = build_tiny_model(tmp_path / "other", model_dir, seed=3)
    num_bytes = worker.load_weights_from_stream(other.named_parameters())
    assert num_bytes == sum(p.numel() * 4 for p in other.parameters())  # fp32 tensors in, cast on copy
    weights = dict(worker.model.named_weights())
    for name, p in other.named_parameters():
        assert torch.equal(weights[name], p.detach().to(torch.bfloat16)), name
    with pytest.raises(ValueError, match="sent twice"):
        worker.load_weights_from_stream([("model.norm.weight", hf.model.norm.weight)] * 2)
    with pytest.raises(ValueError, match="lacks"):
        worker.load_weights_from_stream([("model.norm.weight", hf.model.norm.weight)])


def test_eos_ids_come_from_tokenizer_and_generation_config(
    tiny_assets: tuple[Path, PreTrainedTokenizerBase], tmp_path: Path
) -> None:
    model_dir, tokenizer = tiny_assets
    assert eos_token_ids(tokenizer, model_dir) == [tokenizer.eos_token_id]
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [5, 9]}')
    assert eos_token_ids(tokenizer, tmp_path) == sorted({tokenizer.eos_token_id, 5, 9})


class ListReceiver:
    """A refit receiver handing over a list of tensors (after checking their names against the manifest)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.tensors = tensors

    def receive(self, load_fn: Any, manifest: Any, shard_fn: Any = None) -> TransferStats:
        assert set(manifest) == {name for name, _ in self.tensors}
        load_fn(iter(self.tensors))
        return TransferStats("receiver", 0, 1, len(self.tensors), 0.0)


def test_lora_refits_merge_the_adapters_and_stage_them_in_flight(
    tiny_assets: tuple[Path, PreTrainedTokenizerBase],
) -> None:
    model_dir, tokenizer = tiny_assets
    lora = {"enabled": True, "dim": 4, "alpha": 8, "match_all_linear": False, "target_modules": ["q_proj"]}
    worker = make_worker(model_dir, tokenizer, dtensor_cfg={"lora_cfg": lora})
    base = {name: p.detach() for name, p in Qwen2ForCausalLM.from_pretrained(model_dir).named_parameters()}
    adapter_specs = worker.expected_weights_manifest("adapters")
    assert set(worker.expected_weights_manifest("full")) == set(base) | set(adapter_specs)

    def adapters(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {name: torch.randn(shape, generator=g) for name, (shape, _) in adapter_specs.items()}

    def q_proj() -> torch.Tensor:
        return dict(worker.model.named_weights())["model.layers.0.self_attn.q_proj.weight"].clone()

    def merged(adapter: dict[str, torch.Tensor]) -> torch.Tensor:
        module = "model.layers.0.self_attn.q_proj"
        return merge_lora(
            base[f"{module}.weight"], adapter[f"{module}.lora_A"], adapter[f"{module}.lora_B"], 2.0
        )

    first, second = adapters(1), adapters(2)
    with pytest.raises(RefitIntegrityError, match="holds no base weights"):
        worker.refit_receive(ListReceiver(list(first.items())), "adapters")
    worker.refit_receive(ListReceiver([*base.items(), *first.items()]), "full")
    assert torch.equal(q_proj(), merged(first))
    # Asynchronous GRPO's in-flight updates: adapters arriving during a generation call are merged, staged
    # and loaded between two decode steps (here: when the call ends).
    worker.enable_in_flight_weight_updates(recompute_kv_cache=False)
    with worker.engine.in_flight.generating():
        worker.refit_receive(ListReceiver(list(second.items())), "adapters")
        assert torch.equal(q_proj(), merged(first))
    assert torch.equal(q_proj(), merged(second))
