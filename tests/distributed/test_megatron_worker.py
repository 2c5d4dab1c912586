"""MegatronPolicyWorker over gloo against the one-process DTensor worker and Hugging Face transformers.

Two groups of spawned processes run at once: the Megatron scenarios (tensor, pipeline and data parallel,
sequence parallel with recomputation, token-budget micro-batches through the pipeline, checkpoints, export,
refit streams; a TP=2 x PP=2 layout on four ranks) and, in one more process, the same training on a
one-process DTensor worker. Every process forks from one server that imported torch, transformers and
megatron-core once, which keeps the module's cost to its computation. The tests compare the saved results
(loss and grad norm of 3 optimizer steps of SFT, the clipped policy-gradient loss and DPO, rel 1e-5, fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rank_groups import SaveFn, load, run_groups
from safetensors.torch import load_file
from test_dtensor_worker import (
    DPO_CFG,
    GLOBAL_BATCH,
    LR,
    SEQ_LEN,
    build_tiny_model,
    make_batch,
    preference_data,
    reference_logprobs,
    train_data,
)
from transformers import AutoModelForCausalLM

from nemo_rl.algorithms.loss_functions import ClippedPGLossFn, DPOLossFn, NLLLoss
from nemo_rl.config.loss import ClippedPGLossConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
pytestmark = pytest.mark.mcore

CLIP = 0.05  # small enough that clipping is active
SPAWN_TIMEOUT_S = 300.0
PG_CFG = ClippedPGLossConfig(reference_policy_kl_penalty=0.05)


# ------------------------------------------------------------------------------------------ configs
def megatron_cfg(
    model_dir: Path, tp: int = 1, pp: int = 1, megatron: dict[str, Any] | None = None, **policy: Any
) -> PolicyConfig:
    """The DTensor reference's settings on the Megatron backend (AdamW, no weight decay, 2-step warm-up)."""
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "train_global_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size": 2,
            "logprob_batch_size": 3,
            "max_grad_norm": CLIP,
            "optimizer": None,
            "scheduler": None,
            "dtensor_cfg": {"enabled": False},
            "megatron_cfg": {
                "enabled": True,
                "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": pp,
                "optimizer": {"lr": LR, "min_lr": 0.0, "weight_decay": 0.0, "clip_grad": CLIP},
                "scheduler": {"lr_warmup_iters": 2, "lr_warmup_init": LR / 2},
            }
            | (megatron or {}),
        }
        | policy
    )


def dtensor_cfg(model_dir: Path, dtensor: dict[str, Any] | None = None) -> PolicyConfig:
    """One-process DTensor worker: AdamW without weight decay (Megatron does not decay norms and biases), the
    learning rate warming up linearly from LR / 2 to LR over two steps, as ``megatron_cfg`` does."""
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "dtensor_cfg": dtensor or {},
            "train_global_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size": 2,
            "logprob_batch_size": 3,
            "max_grad_norm": CLIP,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": LR, "weight_decay": 0.0}},
            "scheduler": [
                {
                    "name": "torch.optim.lr_scheduler.LinearLR",
                    "kwargs": {"start_factor": 0.5, "total_iters": 2},
                },
                {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 1}},
                {"milestones": [2]},
            ],
        }
    )


def score_data() -> BatchedDataDict[Any]:
    return make_batch(seed=2, num_rows=6)


def pg_data(init_logprobs: torch.Tensor) -> BatchedDataDict[Any]:
    """The SFT batches with a per-sequence advantage and the initial model's log-probs as prev / reference."""
    data = train_data()
    g = torch.Generator().manual_seed(4)
    data["advantages"] = torch.randn(data.size, 1, generator=g).expand(-1, SEQ_LEN).clone()
    data["prev_logprobs"] = init_logprobs
    data["reference_policy_logprobs"] = init_logprobs
    data["generation_logprobs"] = init_logprobs + 0.01 * torch.randn(init_logprobs.shape, generator=g)
    return data


def shard(data: BatchedDataDict[Any], worker: Any, group_size: int = 1) -> BatchedDataDict[Any]:
    return data.shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH, group_size=group_size)[
        worker.dp_rank
    ]


def with_reference(worker: Any, pairs: BatchedDataDict[Any]) -> BatchedDataDict[Any]:
    out = BatchedDataDict(dict(pairs))
    out["reference_policy_logprobs"] = worker.get_reference_policy_logprobs(pairs)["reference_logprobs"]
    return out


# -------------------------------------------------------------------------------- spawned scenarios
def _reference_scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    """The one-process DTensor worker on whole global batches."""
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    cfg = dtensor_cfg(model_dir)
    worker = DTensorPolicyWorker(cfg)
    save("logprobs_init", worker.get_logprobs(score_data()))
    save("nll", worker.train(train_data(), NLLLoss()))
    save("logprobs_trained", worker.get_logprobs(score_data()))
    save("topk_trained", worker.get_topk_logits(score_data(), k=3))
    worker.shutdown()
    worker = DTensorPolicyWorker(cfg)
    save("pg", worker.train(torch.load(out_dir / "pg_data.pt", weights_only=False), ClippedPGLossFn(PG_CFG)))
    worker.shutdown()
    worker = DTensorPolicyWorker(cfg)
    save("dpo", worker.train(with_reference(worker, preference_data()), DPOLossFn(DPO_CFG), mbs=2))
    worker.shutdown()


def _draws() -> dict[str, torch.Tensor]:
    """The next numbers of this rank's torch generator and of Megatron's tensor-parallel RNG tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    process = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        tracker = torch.rand(4)
    return {"process": process, "tracker": tracker}


def _megatron_scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    """Two ranks: TP=2, TP=2 with sequence parallel, PP=2 and DP=2, each a fresh worker."""
    from nemo_rl.models.policy.megatron_worker import MegatronPolicyWorker

    data, pg, pairs = train_data(), torch.load(out_dir / "pg_data.pt", weights_only=False), preference_data()

    # Tensor parallel: scoring before / after SFT, reference log-probs, export and the refit stream.
    worker = MegatronPolicyWorker(megatron_cfg(model_dir, tp=2))
    save("tp2_logprobs_init", worker.get_logprobs(score_data()))
    save("tp2_nll", worker.train(shard(data, worker), NLLLoss()))
    save("tp2_logprobs_trained", worker.get_logprobs(score_data()))
    save("tp2_ref_logprobs", worker.get_reference_policy_logprobs(score_data()))
    save("tp2_topk", worker.get_topk_logits(score_data(), k=3))
    worker.export_hf(str(out_dir / "tp2_export"))
    save("tp2_stream", dict(worker.iter_hf_weights(torch.bfloat16)))
    save("tp2_manifest", worker.weights_manifest(torch.bfloat16))
    worker.shutdown()
    worker = MegatronPolicyWorker(megatron_cfg(model_dir, tp=2))
    save("tp2_pg", worker.train(shard(pg, worker), ClippedPGLossFn(PG_CFG)))
    worker.shutdown()

    # Sequence parallel (odd sequences padded to a multiple of TP) with full-layer recomputation.
    sp = {"sequence_parallel": True, "activation_checkpointing": True}
    worker = MegatronPolicyWorker(megatron_cfg(model_dir, tp=2, megatron=sp))
    save("sp2_logprobs_init", worker.get_logprobs(score_data()))
    save("sp2_nll", worker.train(shard(data, worker), NLLLoss(), mbs=4))
    worker.shutdown()

    # Pipeline parallel: the untouched export (round trip), token-budget micro-batches of different shapes
    # through the pipeline, the per-stage refit stream, then checkpoint after two steps and resume.
    dynamic = {"enabled": True, "train_mb_tokens": 24, "logprob_mb_tokens": 20, "sequence_length_round": 4}
    worker = MegatronPolicyWorker(megatron_cfg(model_dir, pp=2, dynamic_batching=dynamic))
    worker.export_hf(str(out_dir / "pp2_export_init"))
    save("pp2_logprobs_init", worker.get_logprobs(score_data()))
    save(
        "pp2_stream",
        {"stream": worker.refit_stream(), "weights": dict(worker.iter_hf_weights(torch.float32))},
    )
    save("pp2_nll_first_two", worker.train(shard(data.slice(0, 2 * GLOBAL_BATCH), worker), NLLLoss()))
    save("pp2_logprobs_two_steps", worker.get_logprobs(score_data()))
    # Generators moved on (as dropout would move them), then saved: the resumed worker continues them.
    _draws()
    worker.save_checkpoint(str(out_dir / "pp2_ckpt_weights"), str(out_dir / "pp2_ckpt_optim"))
    save("pp2_draws_after_save", _draws())
    worker.shutdown()
    worker = MegatronPolicyWorker(
        megatron_cfg(model_dir, pp=2),
        weights_path=str(out_dir / "pp2_ckpt_weights"),
        optimizer_path=str(out_dir / "pp2_ckpt_optim"),
    )
    save("pp2_draws_resumed", _draws())
    save(
        "pp2_nll_resumed",
        worker.train(shard(data.slice(2 * GLOBAL_BATCH, 3 * GLOBAL_BATCH), worker), NLLLoss()),
    )
    worker.shutdown()
    # The weights of a checkpoint load into another layout.
    worker = MegatronPolicyWorker(
        megatron_cfg(model_dir, tp=2), weights_path=str(out_dir / "pp2_ckpt_weights")
    )
    save("tp2_from_pp2_logprobs", worker.get_logprobs(score_data()))
    worker.shutdown()
    worker = MegatronPolicyWorker(megatron_cfg(model_dir, pp=2))
    save("pp2_pg", worker.train(shard(pg, worker), ClippedPGLossFn(PG_CFG)))
    worker.shutdown()
    worker = MegatronPolicyWorker(megatron_cfg(model_dir, pp=2))
    save("pp2_dpo", worker.train(with_reference(worker, pairs), DPOLossFn(DPO_CFG), mbs=2))
    worker.shutdown()

    # Data parallel: SFT with the distributed optimizer, the clipped PG loss, DPO on whole pairs per rank.
    distributed = {
        "optimizer": {
            "lr": LR,
            "min_lr": 0.0,
            "weight_decay": 0.0,
            "clip_grad": CLIP,
            "use_distributed_optimizer": True,
        }
    }
    worker = MegatronPolicyWorker(megatron_cfg(model_dir, megatron=distributed))
    save("dp2_nll", worker.train(shard(data, worker), NLLLoss()))
    worker.shutdown()
    worker = MegatronPolicyWorker(megatron_cfg(model_dir))
    save("dp2_pg", worker.train(shard(pg, worker), ClippedPGLossFn(PG_CFG)))
    worker.shutdown()
    worker = MegatronPolicyWorker(megatron_cfg(model_dir))
    save(
        "dp2_dpo",
        worker.train(with_reference(worker, shard(pairs, worker, group_size=2)), DPOLossFn(DPO_CFG), mbs=2),
    )
    worker.shutdown()


def _four_rank_scenarios(save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    """Four ranks: TP=2 x PP=2 (one data-parallel replica)."""
    from nemo_rl.models.policy.interfaces import PolicyInterface
    from nemo_rl.models.policy.megatron_worker import MegatronPolicyWorker

    # Policy calls the same methods on either backend's workers.
    missing = [
        n
        for n in dir(PolicyInterface)
        if not n.startswith("_") and not callable(getattr(MegatronPolicyWorker, n, None))
    ]
    save("missing_methods", missing)

    worker = MegatronPolicyWorker(megatron_cfg(model_dir, tp=2, pp=2))
    worker.export_hf(str(out_dir / "tp2pp2_export_init"))
    save("logprobs_init", worker.get_logprobs(score_data()))
    save(
        "stream",
        {
            "stream": worker.refit_stream(),
            "names": [name for name, _ in worker.iter_hf_weights(torch.float32)],
        },
    )
    save("nll", worker.train(shard(train_data(), worker), NLLLoss()))
    worker.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    # Tied embeddings: with PP=2 the last stage keeps its own copy of the embedding.
    build_tiny_model(path, tie_word_embeddings=True)
    return path


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def results(model_dir: Path, hf_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("megatron_results")
    torch.save(pg_data(reference_logprobs(hf_model, train_data())), out_dir / "pg_data.pt")
    groups = [
        ("megatron", 2, _megatron_scenarios),
        ("megatron4", 4, _four_rank_scenarios),
        ("reference", 1, _reference_scenarios),
    ]
    run_groups(groups, model_dir, out_dir, timeout_s=SPAWN_TIMEOUT_S)
    return out_dir


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=1e-6)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize(
    ("scenario", "reference"),
    [
        ("tp2_nll", "nll"),
        ("sp2_nll", "nll"),
        ("dp2_nll", "nll"),
        ("tp2_pg", "pg"),
        ("pp2_pg", "pg"),
        ("dp2_pg", "pg"),
        ("pp2_dpo", "dpo"),
        ("dp2_dpo", "dpo"),
    ],
)
def test_training_matches_one_process_dtensor(results: Path, scenario: str, reference: str) -> None:
    expected = load(results, f"reference.{reference}")
    assert expected["grad_norm"][0] > CLIP, "clipping should be active in this test"
    for rank in range(2):
        out = load(results, f"megatron.{scenario}", rank)
        assert_close(out["loss"], expected["loss"])
        assert_close(out["grad_norm"], expected["grad_norm"])
        assert_close(out["lr"], expected["lr"])
        for name in ("num_valid_tokens", "loss"):
            if name in expected["metrics"]:
                assert_close(torch.tensor(out["metrics"][name]), torch.tensor(expected["metrics"][name]))


def test_tp2_pp2_matches_one_process_dtensor(results: Path, hf_model: torch.nn.Module) -> None:
    expected = load(results, "reference.nll")
    for rank in range(4):
        out = load(results, "megatron4.nll", rank)
        assert_close(out["loss"], expected["loss"])
        assert_close(out["grad_norm"], expected["grad_norm"])
        assert_close(
            load(results, "megatron4.logprobs_init", rank)["logprobs"],
            reference_logprobs(hf_model, score_data()),
        )
    assert load(results, "megatron4.missing_methods") == []
    # Megatron ranks are tp fastest, then pp: each stage's two TP ranks stream the same layers.
    streams = [load(results, "megatron4.stream", rank) for rank in range(4)]
    assert [s["stream"] for s in streams] == [0, 0, 1, 1]
    assert streams[0]["names"] == streams[1]["names"] and streams[2]["names"] == streams[3]["names"]
    assert not set(streams[0]["names"]) & set(streams[2]["names"])


def test_pipeline_with_token_budget_micro_batches_and_resume(results: Path) -> None:
    expected = load(results, "reference.nll")
    first_two = load(results, "megatron.pp2_nll_first_two", rank=1)
    resumed = load(results, "megatron.pp2_nll_resumed", rank=0)
    assert_close(first_two["loss"], expected["loss"][:2])
    assert_close(first_two["grad_norm"], expected["grad_norm"][:2])
    assert_close(resumed["loss"], expected["loss"][2:])
    assert_close(resumed["grad_norm"], expected["grad_norm"][2:])
    assert_close(resumed["lr"], expected["lr"][2:])
    # Each rank's generators (the process's and Megatron's tracker) continue from the checkpoint.
    for rank in range(2):
        saved = load(results, "megatron.pp2_draws_after_save", rank=rank)
        resumed = load(results, "megatron.pp2_draws_resumed", rank=rank)
        assert all(torch.equal(saved[k], resumed[k]) for k in ("process", "tracker")), rank
    # A weights checkpoint loads into another layout (PP=2 -> TP=2).
    assert_close(
        load(results, "megatron.tp2_from_pp2_logprobs")["logprobs"],
        load(results, "megatron.pp2_logprobs_two_steps")["logprobs"],
    )


def test_logprobs_match_transformers(results: Path, hf_model: torch.nn.Module) -> None:
    expected = reference_logprobs(hf_model, score_data())
    for name in ("tp2_logprobs_init", "sp2_logprobs_init", "pp2_logprobs_init"):
        for rank in range(2):
            assert_close(load(results, f"megatron.{name}", rank)["logprobs"], expected)
    assert_close(load(results, "megatron.tp2_ref_logprobs")["reference_logprobs"], expected)
    assert_close(load(results, "reference.logprobs_init")["logprobs"], expected)
    # After training, the TP=2 worker scores like the DTensor worker after the same steps.
    assert_close(
        load(results, "megatron.tp2_logprobs_trained")["logprobs"],
        load(results, "reference.logprobs_trained")["logprobs"],
        rtol=1e-4,
    )
    topk, reference_topk = load(results, "megatron.tp2_topk"), load(results, "reference.topk_trained")
    assert torch.equal(topk["topk_indices"], reference_topk["topk_indices"])
    assert_close(topk["topk_logits"], reference_topk["topk_logits"], rtol=1e-4)


@pytest.mark.parametrize("export", ["pp2_export_init", "tp2pp2_export_init"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(
    results: Path, model_dir: Path, hf_model: torch.nn.Module, export: str
) -> None:
    export_dir = results / export
    exported: dict[str, torch.Tensor] = {}
    for file in sorted(export_dir.glob("*.safetensors")):
        exported |= load_file(file)
    original = load_file(model_dir / "model.safetensors")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    assert torch.equal(reference_logprobs(reloaded, score_data()), reference_logprobs(hf_model, score_data()))


def test_trained_export_loads_in_transformers(results: Path) -> None:
    exported = AutoModelForCausalLM.from_pretrained(results / "tp2_export").eval()
    assert_close(
        reference_logprobs(exported, score_data()), load(results, "megatron.tp2_logprobs_trained")["logprobs"]
    )
    assert (results / "tp2_export" / "tokenizer.json").exists()


def test_refit_streams_are_hf_weights_per_stage(results: Path) -> None:
    manifest = load(results, "megatron.tp2_manifest")
    exported = AutoModelForCausalLM.from_pretrained(results / "tp2_export").state_dict()
    stream = load(results, "megatron.tp2_stream")
    assert set(stream) == set(manifest) and "lm_head.weight" not in stream
    for name, tensor in stream.items():
        assert manifest[name] == (tuple(tensor.shape), "bfloat16")
        assert torch.equal(tensor, exported[name].to(torch.bfloat16))
        assert torch.equal(tensor, load(results, "megatron.tp2_stream", rank=1)[name])
    # Each pipeline stage streams its own layers; together they are the whole model, once.
    stages = [load(results, "megatron.pp2_stream", rank) for rank in range(2)]
    assert [s["stream"] for s in stages] == [0, 1]
    names = [set(s["weights"]) for s in stages]
    assert not names[0] & names[1] and names[0] | names[1] == set(manifest)
    assert "model.embed_tokens.weight" in names[0] and "model.norm.weight" in names[1]
