"""PPO's value model on the DTensor worker over gloo (``reward_model_cfg.reward_model_type: regression``),
against a one-process Hugging Face critic: ``AutoModelForSequenceClassification`` with one output, its
``score`` head read at every token through a forward hook, trained with the same AdamW, schedule and clipping
on the clipped value loss written out plainly here.

FSDP (dp=2), TP (tp=2), TP with sequence parallelism, sequence packing and shared prompts (rows of a group
sharing their prompt, as GRPO and PPO send them) each take the same three steps as the reference; values
before and after, the per-step loss, gradient norm and the loss's metrics agree in float32 (rtol 1e-5); the
steps move every value, and packed and shared-prompt values equal the plain forward's. ``get_values`` is
checked against the head run on each prefix alone; a checkpoint taken after step two resumes step three bit
for bit; the export loads in transformers and gives the worker's values; and the methods of the other model
kinds (log-probs, ``score``, a reward model's training step) refuse a value model, and ``get_values``
refuses them, with one line.

One pair of spawned rank processes runs every scenario in turn and writes its results to disk
(``rank_groups.spawn_and_wait``); the tiny model, data and optimizer schedule are ``test_dtensor_worker.py``'s.
"""

from __future__ import annotations

import functools
import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_groups import spawn_and_wait
from test_dtensor_worker import (
    GLOBAL_BATCH,
    NUM_STEPS,
    SEQ_LEN,
    WORLD_SIZE,
    _optimizer_and_schedule,
    _shard,
    assert_close,
    build_tiny_model,
    make_batch,
    policy_cfg,
    train_data,
)
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from nemo_rl.algorithms.loss_functions import PreferenceLoss, ValueLossFn
from nemo_rl.algorithms.losses import explained_variance
from nemo_rl.config.loss import ValueLossConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import free_port

SPAWN_TIMEOUT_S = 240.0
VALUE_LOSS = ValueLossConfig(scale=0.5, cliprange=0.2)
CRITIC = {"reward_model_cfg": {"enabled": True, "reward_model_type": "regression"}}
PACKING = {"enabled": True, "train_mb_tokens": 24, "logprob_mb_tokens": 20, "sequence_length_round": 4}
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any], int | None]] = {
    # name: (dtensor_cfg, other policy keys, training micro-batch size)
    "dp2": ({}, {}, None),
    "tp2": ({"tensor_parallel_size": 2}, {}, None),
    "sp2": ({"tensor_parallel_size": 2, "sequence_parallel": True}, {}, None),
    "packed": ({}, {"sequence_packing": PACKING}, None),
    # Micro-batches of 4 rows hold whole prompt groups (rank 0: 3 + 1 rows, rank 1: 4 rows).
    "shared": ({}, {"shared_prefix": {"enabled": True}}, 4),
}


# ------------------------------------------------------------------------------------------ test assets
def build_critic_checkpoint(path: Path) -> None:
    """``path/lm``: the tiny causal LM; ``path/critic``: the same body saved as a sequence-classification model
    with one output, so the worker and the reference start from the same head. The head is drawn with std 0.1
    (not transformers' 0.02) so values are of order 1, where the relative tolerance is what binds."""
    build_tiny_model(path / "lm")
    config = AutoConfig.from_pretrained(path / "lm", num_labels=1, pad_token_id=0)
    critic = AutoModelForSequenceClassification.from_pretrained(path / "lm", config=config)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        critic.score.weight.copy_(torch.randn(critic.score.weight.shape, generator=generator) * 0.1)
    critic.save_pretrained(path / "critic")
    AutoTokenizer.from_pretrained(path / "lm").save_pretrained(path / "critic")


def critic_data() -> BatchedDataDict[Any]:
    """``train_data``'s prompt groups with PPO's critic keys, aligned with the tokens as ``get_values`` returns
    them: ``old_values`` (0 at position 0 and padding) spread so that the clip binds on part of the tokens, and
    ``returns`` on the response tokens."""
    data = train_data()
    g = torch.Generator().manual_seed(7)
    positions = torch.arange(SEQ_LEN)[None, :]
    valid = ((positions > 0) & (positions < data["input_lengths"][:, None])).float()
    data["old_values"] = 0.5 * torch.randn(data.size, SEQ_LEN, generator=g) * valid
    data["returns"] = torch.randn(data.size, SEQ_LEN, generator=g) * data["token_mask"]
    return data


def score_data() -> BatchedDataDict[Any]:
    return make_batch(seed=2, num_rows=6)


# -------------------------------------------------------------------------------- spawned scenarios
def _refusal(method: Any, data: BatchedDataDict[Any]) -> str:
    """The message of the ``ValueError`` that ``method(data)`` raises."""
    try:
        method(data)
    except ValueError as error:
        return str(error)
    return "no error"


def _forward_batch_rows(model: torch.nn.Module) -> list[int]:
    """A list that records the number of rows of every forward of ``model`` from now on."""
    rows: list[int] = []
    model.register_forward_pre_hook(
        lambda _m, _args, kwargs: rows.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True
    )
    return rows


def _scenarios(rank: int, model_dir: Path, out_dir: Path) -> None:
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    def save(name: str, value: Any) -> None:
        torch.save(value, out_dir / f"{name}.rank{rank}.pt")

    critic_dir, data, scored, loss_fn = (
        model_dir / "critic",
        critic_data(),
        score_data(),
        ValueLossFn(VALUE_LOSS),
    )

    def critic(dtensor: dict[str, Any], **overrides: Any) -> DTensorPolicyWorker:
        return DTensorPolicyWorker(
            policy_cfg(critic_dir, dtensor, **CRITIC, **overrides), init_reference_model=False
        )

    def steps(worker: DTensorPolicyWorker, first: int, last: int) -> BatchedDataDict[Any]:
        return _shard(data.slice(first * GLOBAL_BATCH, last * GLOBAL_BATCH), worker.dp_rank, worker.dp_size)

    for name, (dtensor, overrides, mbs) in LAYOUTS.items():
        worker = critic(dtensor, **overrides)
        batch_rows = _forward_batch_rows(worker.model)
        save(f"{name}_values_init", worker.get_values(scored))
        save(f"{name}_values_grouped", worker.get_values(data.slice(0, GLOBAL_BATCH)))
        if name == "dp2":  # two steps, a checkpoint, then the third
            first = worker.train(steps(worker, 0, 2), loss_fn, mbs=mbs)
            save("dp2_values_step2", worker.get_values(scored))
            worker.save_checkpoint(str(out_dir / "ckpt_weights"), str(out_dir / "ckpt_optim"))
            save("dp2_train_first", first)
            save("dp2_train_last", worker.train(steps(worker, 2, NUM_STEPS), loss_fn, mbs=mbs))
        else:
            save(f"{name}_train", worker.train(steps(worker, 0, NUM_STEPS), loss_fn, mbs=mbs))
        save(f"{name}_values_trained", worker.get_values(scored))
        save(f"{name}_batch_rows", batch_rows)
        save(f"{name}_attention", worker.model.config._attn_implementation)
        if name == "dp2":
            save("refuse_get_logprobs", _refusal(worker.get_logprobs, scored))
            save("refuse_score", _refusal(worker.score, scored))
            # Last: the refused step stops inside the forward of its first micro-batch.
            rm_step = functools.partial(worker.train, loss_fn=PreferenceLoss())
            save("refuse_rm_train", _refusal(rm_step, steps(worker, 0, 1)))
        if name == "tp2":
            worker.export_hf(str(out_dir / "export"))
        worker.shutdown()

    # Resume: fresh dp=2 workers load the step-two checkpoint and take step three.
    worker = DTensorPolicyWorker(
        policy_cfg(critic_dir, **CRITIC),
        init_reference_model=False,
        weights_path=str(out_dir / "ckpt_weights"),
        optimizer_path=str(out_dir / "ckpt_optim"),
    )
    save("resumed_values_loaded", worker.get_values(scored))
    save("resumed_train", worker.train(steps(worker, 2, NUM_STEPS), loss_fn))
    save("resumed_values_trained", worker.get_values(scored))
    worker.shutdown()

    # get_values refuses a language model and a Bradley-Terry reward model.
    for name, cfg in (
        ("lm", policy_cfg(model_dir / "lm")),
        ("bradley_terry", policy_cfg(critic_dir, reward_model_cfg={"enabled": True})),
    ):
        worker = DTensorPolicyWorker(cfg, init_reference_model=False)
        save(f"refuse_get_values_{name}", _refusal(worker.get_values, scored))
        worker.shutdown()


def _spawn_entry(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NEMO_RL_TORCH_THREADS="1",
    )
    try:
        _scenarios(rank, Path(model_dir), Path(out_dir))
    except BaseException:
        (Path(out_dir) / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_critic")
    build_critic_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def results(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("critic_results")
    try:
        spawn_and_wait(_spawn_entry, (free_port(), str(model_dir), str(out_dir)), WORLD_SIZE, SPAWN_TIMEOUT_S)
    except Exception as error:
        errors = "\n".join(p.read_text() for p in sorted(out_dir.glob("error.rank*.txt")))
        raise RuntimeError(f"the critic's ranks failed:\n{errors}") from error
    return out_dir


def result(results: Path, name: str, rank: int = 0) -> Any:
    return torch.load(results / f"{name}.rank{rank}.pt", weights_only=False)


# ------------------------------------------------------------------------------ one-process reference
def hf_critic(path: Path) -> torch.nn.Module:
    # Built from the config (not from_pretrained) so the rotary buffers are computed, as the worker does.
    model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(path))
    model.load_state_dict(AutoModelForSequenceClassification.from_pretrained(path).state_dict())
    return model


def head_outputs(model: torch.nn.Module, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T]: the ``score`` head's output at every position (Hugging Face's forward keeps only one)."""
    caught: list[torch.Tensor] = []
    hook = model.get_submodule("score").register_forward_hook(lambda _m, _args, out: caught.append(out))
    try:
        model(input_ids=input_ids_BT)
    finally:
        hook.remove()
    return caught[0][..., 0].float()


def aligned_values(head_BT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """The ``get_values`` contract spelled out: position t < length holds the head at t - 1, the rest 0."""
    values_BT = torch.zeros_like(head_BT)
    for row, length in enumerate(lengths_B.tolist()):
        for t in range(1, length):
            values_BT[row, t] = head_BT[row, t - 1]
    return values_BT


@torch.no_grad()
def values_of(model: torch.nn.Module, data: BatchedDataDict[Any]) -> torch.Tensor:
    return aligned_values(head_outputs(model, data["input_ids"]), data["input_lengths"])


@torch.no_grad()
def prefix_values(model: torch.nn.Module, data: BatchedDataDict[Any]) -> torch.Tensor:
    """[B, T]: at position t < length, the head's output on the prefix ``input_ids[:t]`` run alone."""
    values_BT = torch.zeros(data["input_ids"].shape)
    for row, length in enumerate(data["input_lengths"].tolist()):
        for t in range(1, length):
            values_BT[row, t] = head_outputs(model, data["input_ids"][row : row + 1, :t])[0, -1]
    return values_BT


def plain_value_loss(
    head_BT: torch.Tensor, batch: BatchedDataDict[Any]
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss over the batch's response tokens, and the critic's metrics over the batch."""
    cliprange, scale = VALUE_LOSS.cliprange, VALUE_LOSS.scale
    assert cliprange is not None
    values, old, returns = head_BT[:, :-1], batch["old_values"][:, 1:], batch["returns"][:, 1:]
    mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
    unclipped = (values - returns) ** 2
    clipped = (old + (values - old).clamp(-cliprange, cliprange) - returns) ** 2
    loss = 0.5 * scale * (torch.maximum(unclipped, clipped) * mask).sum() / mask.sum()
    picked, targets = values.detach()[mask > 0], returns[mask > 0]
    residual = targets - picked
    metrics = {
        "loss": float(loss.detach()),
        "vf_clipfrac": float((clipped > unclipped)[mask > 0].float().mean()),
        "values_mean": float(picked.mean()),
        "returns_mean": float(targets.mean()),
        "values_min": float(picked.min()),
        "values_max": float(picked.max()),
        "explained_variance": float(1 - residual.var(unbiased=False) / targets.var(unbiased=False)),
        "num_valid_samples": float(batch["sample_mask"].sum()),
    }
    return loss, metrics


def one_process_critic(model_dir: Path) -> dict[str, Any]:
    """The critic trained in one process on whole global batches: AdamW, the schedule and clipping of
    ``policy_cfg``."""
    model = hf_critic(model_dir / "critic")
    scored, data = score_data(), critic_data()
    out: dict[str, Any] = {
        "values_init": values_of(model, scored),
        "values_grouped": values_of(model, data.slice(0, GLOBAL_BATCH)),
        "prefix_values_init": prefix_values(model, scored),
    }
    optimizer, scheduler = _optimizer_and_schedule(model)
    losses, grad_norms, lrs, metrics = [], [], [], []
    for step in range(NUM_STEPS):
        batch = data.slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        optimizer.zero_grad()
        loss, step_metrics = plain_value_loss(head_outputs(model, batch["input_ids"]), batch)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        lrs.append(optimizer.param_groups[0]["lr"])
        losses.append(float(loss.detach()))
        metrics.append(step_metrics)
        optimizer.step()
        scheduler.step()
    out |= {
        "loss": torch.tensor(losses),
        "grad_norm": torch.tensor(grad_norms),
        "lr": torch.tensor(lrs),
        "metrics": {name: torch.tensor([m[name] for m in metrics]) for name in metrics[0]},
        "values_trained": values_of(model, scored),
    }
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return one_process_critic(model_dir)


def layout_train(results: Path, name: str, rank: int) -> dict[str, Any]:
    """The layout's three steps (the dp=2 worker took them in two calls around its checkpoint)."""
    if name != "dp2":
        return result(results, f"{name}_train", rank)
    first, last = result(results, "dp2_train_first", rank), result(results, "dp2_train_last", rank)
    merged = {key: torch.cat([first[key], last[key]]) for key in ("loss", "grad_norm", "lr")}
    merged["metrics"] = {name: first["metrics"][name] + last["metrics"][name] for name in first["metrics"]}
    return merged


# ------------------------------------------------------------------------------------------------ tests
def test_reference_exercises_the_clip_and_the_gradient_clipping(reference: dict[str, Any]) -> None:
    clipfrac = reference["metrics"]["vf_clipfrac"]
    assert bool(((clipfrac > 0.05) & (clipfrac < 0.95)).all()), clipfrac
    assert bool((reference["grad_norm"] > 0.05).all()), reference["grad_norm"]
    assert float(reference["values_init"].abs().max()) > 0.3  # values of order 1: rtol binds


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_critic_training_matches_one_process(results: Path, reference: dict[str, Any], layout: str) -> None:
    expected = reference["metrics"]
    for rank in range(WORLD_SIZE):
        out = layout_train(results, layout, rank)
        for key in ("loss", "grad_norm", "lr"):
            assert_close(out[key], reference[key])
        # The loss's metrics are whole-batch values once their shares are summed over micro-batches and ranks.
        metrics = {name: torch.tensor(values) for name, values in out["metrics"].items()}
        for name in ("loss", "vf_clipfrac", "values_mean", "returns_mean", "values_min", "values_max"):
            assert_close(metrics[name], expected[name])
        assert torch.equal(metrics["num_valid_samples"], expected["num_valid_samples"])
        shares = ("returns_mean", "values_mean", "returns_sq_mean", "residual_sq_mean")
        explained = [
            explained_variance(*(float(metrics[n][step]) for n in shares)) for step in range(NUM_STEPS)
        ]
        assert_close(torch.tensor(explained), expected["explained_variance"])
        for name in ("values_init", "values_grouped", "values_trained"):
            assert_close(result(results, f"{layout}_{name}", rank)["values"], reference[name])


def test_layouts_ran_their_forward(results: Path) -> None:
    from nemo_rl.models.policy.shared_prefix import ATTENTION

    for rank in range(WORLD_SIZE):
        # Packed rows run as one row per forward; shared prompts through the shared-prefix attention.
        assert set(result(results, "packed_batch_rows", rank)) == {1}
        assert set(result(results, "dp2_batch_rows", rank)) != {1}
        assert result(results, "shared_attention", rank) == ATTENTION
        assert result(results, "dp2_attention", rank) == "sdpa"


def test_training_moves_the_values(results: Path) -> None:
    scored = score_data()
    positions = torch.arange(SEQ_LEN)[None, :]
    inside = (positions > 0) & (positions < scored["input_lengths"][:, None])
    for layout in LAYOUTS:
        before = result(results, f"{layout}_values_init")["values"]
        after = result(results, f"{layout}_values_trained")["values"]
        moved = (after - before).abs()
        assert float(moved[inside].min()) > 1e-4 and float(moved.max()) > 1e-2, (layout, moved)
        assert bool((after[~inside] == 0).all()), layout


def test_packed_and_shared_prompt_values_equal_the_plain_forward(results: Path) -> None:
    for layout in ("packed", "shared"):
        for name in ("values_init", "values_grouped"):
            plain = result(results, f"dp2_{name}")["values"]
            torch.testing.assert_close(
                result(results, f"{layout}_{name}")["values"], plain, rtol=1e-6, atol=1e-6
            )


def test_get_values_hold_the_head_after_each_prefix(results: Path, reference: dict[str, Any]) -> None:
    scored = score_data()
    positions = torch.arange(SEQ_LEN)[None, :]
    outside = (positions == 0) | (positions >= scored["input_lengths"][:, None])
    for layout in LAYOUTS:
        values = result(results, f"{layout}_values_init")["values"]
        assert values.dtype == torch.float32 and values.shape == (scored.size, SEQ_LEN)
        assert_close(values, reference["prefix_values_init"])
        assert bool((values[outside] == 0).all()), layout
        assert bool((values[~outside] != 0).all()), layout


def test_checkpoint_resumes_step_three_bit_for_bit(results: Path) -> None:
    for rank in range(WORLD_SIZE):
        loaded = result(results, "resumed_values_loaded", rank)["values"]
        assert torch.equal(loaded, result(results, "dp2_values_step2", rank)["values"])
        resumed, uninterrupted = (
            result(results, "resumed_train", rank),
            result(results, "dp2_train_last", rank),
        )
        for key in ("loss", "grad_norm", "lr"):
            assert torch.equal(resumed[key], uninterrupted[key]), (key, resumed[key], uninterrupted[key])
        assert resumed["metrics"] == uninterrupted["metrics"]
        trained = result(results, "resumed_values_trained", rank)["values"]
        assert torch.equal(trained, result(results, "dp2_values_trained", rank)["values"])


def test_export_loads_as_a_sequence_classification_model(results: Path) -> None:
    export_dir = results / "export"
    exported = AutoModelForSequenceClassification.from_pretrained(export_dir)
    assert exported.config.num_labels == 1
    assert json.loads((export_dir / "config.json").read_text())["architectures"] == [
        "Qwen2ForSequenceClassification"
    ]
    assert (export_dir / "tokenizer.json").exists()
    assert_close(values_of(exported, score_data()), result(results, "tp2_values_trained")["values"])


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("refuse_get_logprobs", "get_values() for a value model"),
        ("refuse_score", "get_values() for a value model"),
        ("refuse_rm_train", "reward_model_type=bradley_terry"),
        ("refuse_get_values_lm", "reward_model_type=regression"),
        ("refuse_get_values_bradley_terry", "reward_model_type=regression"),
    ],
)
def test_scalar_head_refusals_are_one_line(results: Path, name: str, says: str) -> None:
    for rank in range(WORLD_SIZE):
        message = result(results, name, rank)
        assert says in message and "\n" not in message, message
