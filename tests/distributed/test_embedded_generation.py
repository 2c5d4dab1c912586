"""The embedded engine as Ray replicas: sharding and gathering, weight updates and a real refit.

Two replicas on a two-bundle CPU cluster serve the tiny Qwen2 checkpoint; their results must equal a local
engine on the same checkpoint, row for row in the input order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from nemo_rl.config.cluster import ClusterConfig
from nemo_rl.config.policy import PolicyConfig, RefitConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.device import configure_worker_threads
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.embedded.engine import EmbeddedEngine, SamplingParams
from nemo_rl.models.generation.embedded.generation import EmbeddedGeneration
from nemo_rl.models.generation.embedded.model import DecoderLM
from nemo_rl.models.generation.factory import create_generation
from nemo_rl.models.generation.interfaces import GENERATION_OUTPUT_KEYS, GenerationInterface
from nemo_rl.weight_sync import (
    RefitIntegrityError,
    TransferStats,
    WeightManifest,
    WeightSender,
    create_refit_transport,
    refit,
)

TIMEOUT_S = 300.0
MAX_NEW_TOKENS = 8


def policy_cfg(model_dir: Path, **generation: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "max_total_sequence_length": 64,
            "generation": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, **generation},
        }
    )


@pytest.fixture(scope="module")
def generation(
    ray_cluster: dict[str, float], tiny_assets: tuple[Path, PreTrainedTokenizerBase]
) -> Iterator[GenerationInterface]:
    model_dir, tokenizer = tiny_assets
    cluster = RayVirtualCluster(ClusterConfig(gpus_per_node=2), name="embedded_gen_test")
    gen = None
    try:
        # Through the factory: the default backend is the embedded engine.
        gen = create_generation(cluster, policy_cfg(model_dir), tokenizer, seed=11)
        yield gen
    finally:
        if gen is not None:
            gen.shutdown()
        cluster.shutdown()


def local_engine(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> tuple[EmbeddedEngine, SamplingParams]:
    cfg = policy_cfg(model_dir)
    model = DecoderLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = EmbeddedEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        max_sequence_length=cfg.max_total_sequence_length,
        decode_fn=None,
    )
    return engine, SamplingParams.from_policy_config(cfg, [tokenizer.eos_token_id])


def prompt_batch(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> BatchedDataDict[Any]:
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(r) for r in rows]))


TEXTS = ["What is 1+1?", "Hi", "What is 12+30? Answer:", "7-3=", "abc"]


def test_replicas_return_rows_in_input_order(
    generation: GenerationInterface, tiny_assets: tuple[Path, PreTrainedTokenizerBase]
) -> None:
    model_dir, tokenizer = tiny_assets
    assert isinstance(generation, EmbeddedGeneration) and generation.dp_size == 2
    data = prompt_batch(tokenizer, TEXTS)
    out = generation.generate(data, greedy=True)
    assert set(out.keys()) == set(GENERATION_OUTPUT_KEYS)
    engine, params = local_engine(model_dir, tokenizer)
    for b in range(len(TEXTS)):
        n = int(data["input_lengths"][b])
        alone = engine.generate(
            data["input_ids"][b : b + 1, :n], data["input_lengths"][b : b + 1], params, greedy=True, seed=0
        )
        end = int(alone.unpadded_sequence_lengths[0])
        assert int(out["unpadded_sequence_lengths"][b]) == end
        assert torch.equal(out["output_ids"][b, :end], alone.output_ids[0, :end])
        assert (out["output_ids"][b, end:] == tokenizer.pad_token_id).all()
        assert torch.allclose(out["logprobs"][b, :end], alone.logprobs[0, :end], atol=1e-5)
        assert bool(out["truncated"][b]) == bool(alone.truncated[0])
    assert out["output_ids"].shape[1] >= data["input_ids"].shape[1] + int(out["generation_lengths"].max())


def test_fewer_rows_than_replicas(
    generation: GenerationInterface, tiny_assets: tuple[Path, PreTrainedTokenizerBase]
) -> None:
    _, tokenizer = tiny_assets
    single = prompt_batch(tokenizer, TEXTS[2:3])
    out = generation.generate(single, greedy=True)
    assert out.size == 1
    full = generation.generate(prompt_batch(tokenizer, TEXTS), greedy=True)
    end = int(out["unpadded_sequence_lengths"][0])
    assert end == int(full["unpadded_sequence_lengths"][2])
    assert torch.equal(out["output_ids"][0, :end], full["output_ids"][2, :end])


def test_sampling_logprobs_match_hf_and_calls_draw_fresh_samples(
    generation: GenerationInterface, tiny_assets: tuple[Path, PreTrainedTokenizerBase]
) -> None:
    model_dir, tokenizer = tiny_assets
    data = prompt_batch(tokenizer, TEXTS * 2)
    first = generation.generate(data, greedy=False)
    second = generation.generate(data, greedy=False)
    assert not torch.equal(first["output_ids"], second["output_ids"])
    hf = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
    for b in range(data.size):
        start, end = int(data["input_lengths"][b]), int(first["unpadded_sequence_lengths"][b])
        ids = first["output_ids"][b : b + 1, :end]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(ids).logits[0], dim=-1)
        expected = logprobs[start - 1 : end - 1].gather(-1, ids[0, start:end, None]).squeeze(-1)
        assert torch.allclose(first["logprobs"][b, start:end], expected, atol=1e-4)


def test_an_explicit_seed_replays_its_samples_whatever_calls_came_before(
    generation: GenerationInterface, tiny_assets: tuple[Path, PreTrainedTokenizerBase]
) -> None:
    # Asynchronous GRPO seeds each call itself; the per-call count (what checkpoints save) is left alone.
    _, tokenizer = tiny_assets
    data = prompt_batch(tokenizer, TEXTS * 2)
    position = dict(generation.state_dict())
    first = generation.generate(data, greedy=False, seed=1234)
    generation.generate(data, greedy=False, seed=99)
    again = generation.generate(data, greedy=False, seed=1234)
    assert torch.equal(first["output_ids"], again["output_ids"])
    assert torch.equal(first["logprobs"], again["logprobs"])
    assert dict(generation.state_dict()) == position


def test_finish_and_prepare_keep_generation_working(
    generation: GenerationInterface, tiny_assets: tuple[Path, PreTrainedTokenizerBase]
) -> None:
    _, tokenizer = tiny_assets
    data = prompt_batch(tokenizer, TEXTS[:3])
    before = generation.generate(data, greedy=True)
    generation.finish_generation()
    generation.prepare_for_generation()
    after = generation.generate(data, greedy=True)
    assert torch.equal(before["output_ids"], after["output_ids"])


def test_update_weights_and_manifest_checks(
    generation: GenerationInterface, tiny_assets: tuple[Path, PreTrainedTokenizerBase], tmp_path: Path
) -> None:
    model_dir, tokenizer = tiny_assets
    from nemo_rl.data.tiny import build_tiny_model

    hf = Qwen2ForCausalLM.from_pretrained(model_dir)
    manifest = generation.expected_weights_manifest()
    assert set(manifest) == {name for name, _ in hf.named_parameters()}  # tied: lm_head.weight is not sent
    assert manifest["model.embed_tokens.weight"] == ((len(tokenizer), 128), "float32")
    # The setup check of a Refitter: what a sender offers against what these workers expect.
    WeightManifest(manifest).check_matches(manifest, "the policy")
    wrong = dict(manifest)
    wrong["model.norm.weight"] = ((3,), "bfloat16")
    del wrong["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(
        RefitIntegrityError, match=r"missing: .*up_proj.*model.norm.weight \(expected .*bfloat16\[3\]"
    ):
        WeightManifest(manifest).check_matches(wrong, "the policy")

    data = prompt_batch(tokenizer, TEXTS)
    original = generation.generate(data, greedy=True)
    other = build_tiny_model(tmp_path / "other", model_dir, seed=5)
    try:
        generation.update_weights(other.named_parameters())
        updated = generation.generate(data, greedy=True)
        assert not torch.equal(updated["output_ids"], original["output_ids"])
        engine, params = local_engine(tmp_path / "other", tokenizer)
        expected = engine.generate(data["input_ids"], data["input_lengths"], params, greedy=True, seed=0)
        assert torch.equal(updated["generation_lengths"], expected.generation_lengths)
        for b in range(data.size):
            end = int(expected.unpadded_sequence_lengths[b])
            assert torch.equal(updated["output_ids"][b, :end], expected.output_ids[b, :end])
        with pytest.raises(ValueError, match="lacks 1 weights"):
            generation.update_weights((n, p) for n, p in hf.named_parameters() if n != "model.norm.weight")
    finally:
        generation.update_weights(hf.named_parameters())
    assert torch.equal(generation.generate(data, greedy=True)["output_ids"], original["output_ids"])


class HFSender:
    """A policy-side stand-in: holds a HF model and streams its parameters on a refit."""

    def __init__(self, model_dir: str, seed: int) -> None:
        configure_worker_threads()
        self.model = Qwen2ForCausalLM.from_pretrained(model_dir)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.05 * torch.randn_like(p))

    def refit_send(self, sender: WeightSender, scope: str = "full") -> TransferStats:
        return sender.send((n, p.detach().to(sender.dtype)) for n, p in self.model.named_parameters())

    def save(self, path: str) -> None:
        self.model.save_pretrained(path)


def test_refit_through_shared_memory_updates_every_replica(
    generation: GenerationInterface, tiny_assets: tuple[Path, PreTrainedTokenizerBase], tmp_path: Path
) -> None:
    model_dir, tokenizer = tiny_assets
    sender_cls: Any = ray.remote(num_cpus=0)(HFSender)
    sender = sender_cls.remote(str(model_dir), 3)
    cfg = policy_cfg(model_dir)
    node = ray.get_runtime_context().get_node_id()
    transport = create_refit_transport(
        cfg, RefitConfig(), policy_node_ids=[node], generation_node_ids=generation.worker_node_ids
    )
    data = prompt_batch(tokenizer, TEXTS)
    try:
        metrics = refit([sender], generation.workers, transport, timeout_s=TIMEOUT_S)
        assert metrics["refit/bytes"] > 0
        ray.get(sender.save.remote(str(tmp_path / "sent")), timeout=TIMEOUT_S)
        engine, params = local_engine(tmp_path / "sent", tokenizer)
        expected = engine.generate(data["input_ids"], data["input_lengths"], params, greedy=True, seed=0)
        out = generation.generate(data, greedy=True)
        assert torch.equal(out["generation_lengths"], expected.generation_lengths)
        for b in range(data.size):
            end = int(expected.unpadded_sequence_lengths[b])
            assert torch.equal(out["output_ids"][b, :end], expected.output_ids[b, :end])
            assert torch.allclose(out["logprobs"][b, :end], expected.logprobs[b, :end], atol=1e-5)
    finally:
        transport.shutdown()
        ray.kill(sender)
        hf = Qwen2ForCausalLM.from_pretrained(model_dir)
        generation.update_weights(hf.named_parameters())
