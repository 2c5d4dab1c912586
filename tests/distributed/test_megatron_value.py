"""PPO's value model on the Megatron backend against a one-process transformers critic.

One group of two gloo ranks runs every scenario (each a fresh ``MegatronPolicyWorker`` with
``reward_model_cfg: {enabled: true, reward_model_type: regression}``): TP=2 and TP=2 with sequence parallel
train 3 steps of ``ValueLossFn``; PP=2 trains 2 steps, checkpoints, takes step 3, and a worker resumed from
the checkpoint takes step 3 again; TP=2 from the causal-LM checkpoint starts a fresh head. The reference is
``AutoModelForSequenceClassification`` (num_labels=1) loaded from the same tiny checkpoint, its ``score``
head read at every token through a forward hook, trained with the same AdamW, warm-up and clipping on whole
global batches (fp32; values, loss and grad norm within rtol 1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rank_groups import SaveFn, load, run_groups
from safetensors.torch import load_file
from test_dtensor_worker import GLOBAL_BATCH, LR, NUM_STEPS, build_tiny_model, train_data
from test_megatron_worker import CLIP, _draws, assert_close, megatron_cfg, score_data, shard
from transformers import AutoConfig, AutoModelForSequenceClassification

from nemo_rl.algorithms.loss_functions import ValueLossFn
from nemo_rl.config.loss import ValueLossConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.utils import global_valid_counts, valid_token_mask
from nemo_rl.models.policy.worker_base import token_values

pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
pytestmark = pytest.mark.mcore

SPAWN_TIMEOUT_S = 300.0
VALUE_CFG = ValueLossConfig(scale=0.4, cliprange=0.2)
VALUE_MODEL = {"reward_model_cfg": {"enabled": True, "reward_model_type": "regression"}}
HEAD_SEED = 7
"""Seed of the checkpoint's own head (not the fresh-head seed 0, so a head that was not loaded shows)."""


# ------------------------------------------------------------------------------------------ assets
def build_value_checkpoint(causal_dir: Path, path: Path) -> None:
    """The tiny causal LM as a ``Qwen2ForSequenceClassification`` (one label) with a head of its own."""
    config = AutoConfig.from_pretrained(causal_dir)
    config.num_labels, config.pad_token_id = 1, 0
    model = AutoModelForSequenceClassification.from_pretrained(causal_dir, config=config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(HEAD_SEED))
    model.save_pretrained(path)
    for file in causal_dir.glob("*token*"):
        (path / file.name).write_bytes(file.read_bytes())


def head_BT(model: torch.nn.Module, data: BatchedDataDict[Any]) -> torch.Tensor:
    """The ``score`` head at every position (0 past each row's length), as the workers' losses see it."""
    outputs: list[torch.Tensor] = []
    hook = model.get_submodule("score").register_forward_hook(lambda _m, _a, out: outputs.append(out))
    try:
        model(input_ids=data["input_ids"])
    finally:
        hook.remove()
    ids_BT = data["input_ids"]
    return outputs[0][..., 0].float() * valid_token_mask(data["input_lengths"], ids_BT.shape[1])


@torch.no_grad()
def values(model: torch.nn.Module, data: BatchedDataDict[Any]) -> torch.Tensor:
    """What ``get_values`` returns: the head aligned with the tokens."""
    return token_values(head_BT(model, data), data["input_lengths"])


def value_data(initial: torch.nn.Module) -> BatchedDataDict[Any]:
    """The SFT batches with per-token returns, and the initial critic's values (moved by noise, so the value
    clip acts on some tokens) as the rollout's ``old_values``."""
    data = train_data()
    g = torch.Generator().manual_seed(5)
    data["returns"] = torch.randn(data["input_ids"].shape, generator=g)
    data["old_values"] = values(initial, data) + 0.3 * torch.randn(data["input_ids"].shape, generator=g)
    return data


def reference_training(model: torch.nn.Module, data: BatchedDataDict[Any]) -> dict[str, list[float]]:
    """3 steps of the clipped value loss on whole global batches: AdamW, the LR warming up from LR / 2 to LR
    over two steps (as ``megatron_cfg``'s schedule), clipping at ``CLIP``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
    loss_fn = ValueLossFn(VALUE_CFG)
    log: dict[str, list[float]] = {"loss": [], "grad_norm": [], "lr": []}
    for step in range(NUM_STEPS):
        batch = data.slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        optimizer.zero_grad()
        loss, _ = loss_fn(head_BT(model, batch), batch, *global_valid_counts(batch))
        loss.backward()
        log["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        log["loss"].append(float(loss.detach()))
        log["lr"].append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return log


# -------------------------------------------------------------------------------- spawned scenarios
def _value_scenarios(save: SaveFn, dirs: dict[str, Path], out_dir: Path) -> None:
    """Two ranks: TP=2, TP=2 with sequence parallel, PP=2 with a checkpoint and resume, a fresh head."""
    from nemo_rl.models.policy.megatron_worker import MegatronPolicyWorker

    data: BatchedDataDict[Any] = torch.load(out_dir / "value_data.pt", weights_only=False)
    critic = dirs["critic"]

    worker = MegatronPolicyWorker(megatron_cfg(critic, tp=2, **VALUE_MODEL))
    save("tp2_values_init", worker.get_values(score_data()))
    save("tp2_train", worker.train(shard(data, worker), ValueLossFn(VALUE_CFG)))
    save("tp2_values_trained", worker.get_values(score_data()))
    worker.export_hf(str(out_dir / "tp2_export"))
    save("tp2_manifest", worker.weights_manifest(torch.float32))
    refusals = {}
    for name, call in (("get_logprobs", worker.get_logprobs), ("score", worker.score)):
        try:
            call(score_data())
        except ValueError as error:
            refusals[name] = str(error)
    save("tp2_refusals", refusals)
    worker.shutdown()

    sp = {"sequence_parallel": True}
    worker = MegatronPolicyWorker(megatron_cfg(critic, tp=2, megatron=sp, **VALUE_MODEL))
    save("sp2_values_init", worker.get_values(score_data()))
    save("sp2_train", worker.train(shard(data, worker), ValueLossFn(VALUE_CFG), mbs=4))
    worker.shutdown()

    # PP=2: two steps, a checkpoint (generators moved on first), step 3; then step 3 again after a resume.
    worker = MegatronPolicyWorker(megatron_cfg(critic, pp=2, **VALUE_MODEL))
    save("pp2_values_init", worker.get_values(score_data()))
    save(
        "pp2_first_two", worker.train(shard(data.slice(0, 2 * GLOBAL_BATCH), worker), ValueLossFn(VALUE_CFG))
    )
    _draws()
    worker.save_checkpoint(str(out_dir / "pp2_weights"), str(out_dir / "pp2_optim"))
    save("pp2_draws_after_save", _draws())
    third = shard(data.slice(2 * GLOBAL_BATCH, 3 * GLOBAL_BATCH), worker)
    save("pp2_third", worker.train(third, ValueLossFn(VALUE_CFG)))
    save("pp2_values_trained", worker.get_values(score_data()))
    worker.shutdown()
    worker = MegatronPolicyWorker(
        megatron_cfg(critic, pp=2, **VALUE_MODEL),
        weights_path=str(out_dir / "pp2_weights"),
        optimizer_path=str(out_dir / "pp2_optim"),
    )
    save("pp2_draws_resumed", _draws())
    save("pp2_third_resumed", worker.train(third, ValueLossFn(VALUE_CFG)))
    save("pp2_values_resumed", worker.get_values(score_data()))
    worker.shutdown()

    # The policy's causal-LM checkpoint (tied embeddings): the head starts fresh, seeded.
    worker = MegatronPolicyWorker(megatron_cfg(dirs["causal"], tp=2, **VALUE_MODEL))
    save("fresh_values_init", worker.get_values(score_data()))
    worker.shutdown()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    causal = tmp_path_factory.mktemp("tiny_qwen2_causal")
    build_tiny_model(causal, tie_word_embeddings=True)
    critic = tmp_path_factory.mktemp("tiny_qwen2_critic")
    build_value_checkpoint(causal, critic)
    return {"causal": causal, "critic": critic}


def critic_model(path: Path, seed: int = 0) -> torch.nn.Module:
    """``path`` as a one-label sequence classifier (a missing head drawn after ``torch.manual_seed(seed)``)."""
    config = AutoConfig.from_pretrained(path)
    config.num_labels, config.pad_token_id = 1, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=torch.float32)


@pytest.fixture(scope="module")
def results(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("megatron_value_results")
    torch.save(value_data(critic_model(dirs["critic"])), out_dir / "value_data.pt")
    run_groups([("value", 2, _value_scenarios)], dirs, out_dir, timeout_s=SPAWN_TIMEOUT_S)
    return out_dir


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path], results: Path) -> dict[str, Any]:
    """The transformers critic's initial values, its 3 training steps and its values after them."""
    model = critic_model(dirs["critic"])
    initial = values(model, score_data())
    log = reference_training(model, torch.load(results / "value_data.pt", weights_only=False))
    return {"values_init": initial, "train": log, "values_trained": values(model, score_data())}


def assert_steps_match(out: dict[str, Any], expected: dict[str, list[float]], steps: slice) -> None:
    for key in ("loss", "grad_norm", "lr"):
        assert_close(torch.as_tensor(out[key]), torch.tensor(expected[key][steps]))


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("scenario", ["tp2", "sp2"])
def test_training_matches_transformers_critic(
    results: Path, reference: dict[str, Any], scenario: str
) -> None:
    assert reference["train"]["grad_norm"][0] > CLIP, "clipping should be active in this test"
    for rank in range(2):
        assert_close(load(results, f"value.{scenario}_values_init", rank)["values"], reference["values_init"])
        assert_steps_match(load(results, f"value.{scenario}_train", rank), reference["train"], slice(None))
    for rank in range(2):
        assert_close(load(results, "value.tp2_values_trained", rank)["values"], reference["values_trained"])


def test_pipeline_matches_and_resumes_bit_for_bit(results: Path, reference: dict[str, Any]) -> None:
    assert_close(load(results, "value.pp2_values_init")["values"], reference["values_init"])
    assert_steps_match(load(results, "value.pp2_first_two", rank=1), reference["train"], slice(0, 2))
    assert_steps_match(load(results, "value.pp2_third"), reference["train"], slice(2, 3))
    assert_close(load(results, "value.pp2_values_trained")["values"], reference["values_trained"])
    for rank in range(2):
        third, resumed = (load(results, f"value.pp2_{name}", rank) for name in ("third", "third_resumed"))
        for key in ("loss", "grad_norm", "lr"):
            assert third[key] == resumed[key], (rank, key)
        trained, after_resume = (
            load(results, f"value.pp2_{n}", rank) for n in ("values_trained", "values_resumed")
        )
        assert torch.equal(trained["values"], after_resume["values"])
        saved, drawn = (load(results, f"value.pp2_draws_{n}", rank) for n in ("after_save", "resumed"))
        assert all(torch.equal(saved[k], drawn[k]) for k in ("process", "tracker")), rank


def test_export_is_a_sequence_classifier_with_the_same_values(results: Path) -> None:
    export = results / "tp2_export"
    config = AutoConfig.from_pretrained(export)
    assert config.architectures == ["Qwen2ForSequenceClassification"] and config.num_labels == 1
    weights: dict[str, torch.Tensor] = {}
    for file in export.glob("*.safetensors"):
        weights |= load_file(file)
    assert weights["score.weight"].shape == (1, config.hidden_size) and "lm_head.weight" not in weights
    manifest = load(results, "value.tp2_manifest")
    assert set(manifest) == set(weights)
    exported = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    assert_close(values(exported, score_data()), load(results, "value.tp2_values_trained")["values"])


def test_causal_lm_checkpoint_starts_the_dtensor_backends_fresh_head(
    results: Path, dirs: dict[str, Path]
) -> None:
    # transformers draws the missing head first after the seed, as the DTensor backend loads it (seed 0).
    expected = values(critic_model(dirs["causal"], seed=0), score_data())
    for rank in range(2):
        assert_close(load(results, "value.fresh_values_init", rank)["values"], expected)
    assert not torch.allclose(expected, values(critic_model(dirs["critic"]), score_data()))


def test_log_prob_methods_refuse(results: Path) -> None:
    refusals = load(results, "value.tp2_refusals")
    assert "get_values() for a value model" in refusals["get_logprobs"]
    assert "Bradley-Terry reward model" in refusals["score"]
