"""Context parallelism on the DTensor worker (``policy.dtensor_cfg.context_parallel_size``) against CP=1.

Three groups of gloo ranks run at once from one start (``rank_groups.run_groups``): one rank with CP=1 (the
reference), two ranks with CP=2 (one data-parallel group whose two ranks each hold half of every row), and four
ranks (oversubscribing the cores) that run CP=2 x TP=2, with sequence parallelism, and CP=2 x DP=2 in turn.
Each trains the same three global batches (padded rows, sequence packing, dynamic batching with activation
checkpointing, a value model on packed rows, LoRA, and the tiny mixture-of-experts model with its
load-balancing loss trained and the routing replayed, padded and packed), then scores the same rows; losses,
gradient norms, log-probs and the routing metrics must agree to float32 rounding. The CP=2 group also saves a
checkpoint after two steps, resumes it in a new worker and must take the third step bit for bit as the worker
that went on; both groups export Hugging Face weights after three steps, which must agree.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from rank_groups import SaveFn, load, run_groups
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from nemo_rl.algorithms.loss_functions import NLLLoss, ValueLossFn
from nemo_rl.config.loss import ValueLossConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

MOE_MODEL = Path(__file__).resolve().parents[2] / "examples" / "assets" / "tiny_qwen3_moe_init"
MOE_LAYERS, MOE_TOP_K, MOE_EXPERTS = 2, 2, 8
VOCAB = 64
SEQ_LEN = 22  # not a multiple of 2 x CP: the worker pads it to make_sequence_length_divisible_by
GLOBAL_BATCH = 4
NUM_STEPS = 3
TIMEOUT_S = 300.0


def _build_model(path: Path) -> None:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1} | {chr(48 + i): i + 2 for i in range(VOCAB - 2)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)


def _batch(seed: int, num_rows: int) -> BatchedDataDict[Any]:
    """Right-padded random rows of different lengths, prompts masked out, one sample masked out."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, SEQ_LEN + 1, (num_rows,), generator=g)
    positions = torch.arange(SEQ_LEN)[None, :]
    ids = torch.randint(2, VOCAB, (num_rows, SEQ_LEN), generator=g) * (positions < lengths[:, None])
    token_mask = ((positions >= 3) & (positions < lengths[:, None])).float()
    sample_mask = torch.ones(num_rows)
    sample_mask[2 :: GLOBAL_BATCH * 2] = 0.0
    # A value model's targets (PPO's critic), aligned with the tokens.
    returns, old_values = torch.randn(2, num_rows, SEQ_LEN, generator=g)
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": lengths,
            "token_mask": token_mask,
            "sample_mask": sample_mask,
            "returns": returns,
            "old_values": old_values,
        }
    )


def _with_routing(batch: BatchedDataDict[Any], seed: int) -> BatchedDataDict[Any]:
    """``batch`` with the sampler's routing to replay: distinct random experts per token and MoE layer."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch.size, SEQ_LEN, MOE_LAYERS, MOE_EXPERTS, generator=g)
    return BatchedDataDict({**batch, "routed_experts": scores.argsort(dim=-1)[..., :MOE_TOP_K]})


VARIANTS = ("padded", "packed", "dynamic", "value", "lora", "moe", "moe_packed")
"""Padded rows; sequence packing; dynamic batching with activation checkpointing (the layers recompute their
forward, CP collectives included, in the backward pass); a value model (PPO's critic: the scalar head read at
every token, trained with the clipped value loss) on packed rows; LoRA adapters on every linear layer; the tiny
Qwen3-MoE model with its load-balancing loss trained and the sampler's routing replayed, on padded and on packed
rows."""

FOUR_RANK_LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    "sp2": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "dp2": {},
}
"""What the four ranks split besides CP=2: TP=2, TP=2 with sequence parallelism, or DP=2."""

FOUR_RANK_CASES = (
    ("tp2", "padded"),
    ("tp2", "packed"),
    ("sp2", "padded"),
    ("dp2", "packed"),
)
"""(layout, variant): sequence parallelism pads (packing has no effect with it), so it runs padded rows only;
DP=2 runs packed rows (each data-parallel group packs its own shard into its own micro-batches)."""


def _cfg(model_dir: Path, cp: int, variant: str = "padded", **dtensor: Any) -> PolicyConfig:
    moe = variant.startswith("moe")
    return PolicyConfig.model_validate(
        {
            "model_name": str(MOE_MODEL if moe else model_dir),
            "train_global_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size": 2,
            "logprob_batch_size": 3,
            "max_total_sequence_length": SEQ_LEN,
            "make_sequence_length_divisible_by": 4,
            "max_grad_norm": 0.5,
            # The MoE model's loss jumps at 1e-2, and AdamW then magnifies rounding differences past 1e-5.
            "optimizer": {
                "name": "torch.optim.AdamW",
                "kwargs": {"lr": 1e-3 if moe else 1e-2, "weight_decay": 0.01},
            },
            "dtensor_cfg": {
                "context_parallel_size": cp,
                "activation_checkpointing": variant == "dynamic",
                "lora_cfg": {"enabled": variant == "lora", "dim": 4, "alpha": 8},
                **dtensor,
            },
            "hf_config_overrides": {"output_router_logits": True, "router_aux_loss_coef": 0.05}
            if moe
            else {},
            "router_replay": {"enabled": moe},
            "reward_model_cfg": {"enabled": variant == "value", "reward_model_type": "regression"},
            "sequence_packing": {
                "enabled": variant in ("packed", "value", "moe_packed"),
                "train_mb_tokens": 40,
                "logprob_mb_tokens": 36,
            },
            "dynamic_batching": {
                "enabled": variant == "dynamic",
                "train_mb_tokens": 40,
                "logprob_mb_tokens": 36,
                "sequence_length_round": 4,
            },
        }
    )


def _scenarios(cp: int, save: SaveFn, model_dir: Path, out_dir: Path) -> None:
    """Every scenario of one group (CP=1 on one rank, CP=2 on two)."""
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    data, score = _batch(1, GLOBAL_BATCH * NUM_STEPS), _batch(2, 5)
    loss_fn = NLLLoss()
    for tag in VARIANTS:
        worker = DTensorPolicyWorker(_cfg(model_dir, cp, tag))
        if tag.startswith("moe"):
            save(f"{tag}_train", worker.train(_with_routing(data, 3), loss_fn))
            save(f"{tag}_logprobs", worker.get_logprobs(_with_routing(score, 4))["logprobs"])
        elif tag == "value":
            save(f"{tag}_train", worker.train(data, ValueLossFn(ValueLossConfig(scale=1.0, cliprange=0.2))))
            save(f"{tag}_logprobs", worker.get_values(score)["values"])
        else:
            save(f"{tag}_train", worker.train(data, loss_fn))
            save(f"{tag}_logprobs", worker.get_logprobs(score)["logprobs"])
        if tag == "padded":
            worker.export_hf(str(out_dir / f"hf_cp{cp}"))
        worker.shutdown()
    if cp == 1:
        return
    # Resume: two steps, save, a third step; a new worker from the checkpoint takes the same third step.
    first, last = data.slice(0, 2 * GLOBAL_BATCH), data.slice(2 * GLOBAL_BATCH, 3 * GLOBAL_BATCH)
    worker = DTensorPolicyWorker(_cfg(model_dir, cp))
    worker.train(first, loss_fn)
    ckpt = out_dir / "ckpt"
    worker.save_checkpoint(str(ckpt / "weights"), str(ckpt / "optimizer"))
    save("went_on", (worker.train(last, loss_fn), worker.get_logprobs(score)["logprobs"]))
    worker.shutdown()
    resumed = DTensorPolicyWorker(
        _cfg(model_dir, cp),
        weights_path=str(ckpt / "weights"),
        optimizer_path=str(ckpt / "optimizer"),
    )
    save("resumed", (resumed.train(last, loss_fn), resumed.get_logprobs(score)["logprobs"]))
    resumed.shutdown()


def _four_rank_scenarios(save: SaveFn, model_dir: Path, _out_dir: Path) -> None:
    """CP=2 with TP=2 (with and without sequence parallelism) and with DP=2, on the same four ranks in turn."""
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    data, score = _batch(1, GLOBAL_BATCH * NUM_STEPS), _batch(2, 5)
    for layout, tag in FOUR_RANK_CASES:
        worker = DTensorPolicyWorker(_cfg(model_dir, 2, tag, **FOUR_RANK_LAYOUTS[layout]))
        shard = data.shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH)[worker.dp_rank]
        save(f"{layout}_{tag}_train", worker.train(shard, NLLLoss()))
        save(f"{layout}_{tag}_logprobs", worker.get_logprobs(score)["logprobs"])
        worker.shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("cp_model")
    _build_model(model_dir)
    out_dir = tmp_path_factory.mktemp("cp_out")
    run_groups(
        [
            ("cp1", 1, partial(_scenarios, 1)),
            ("cp2", 2, partial(_scenarios, 2)),
            ("four", 4, _four_rank_scenarios),
        ],
        model_dir,
        out_dir,
        timeout_s=TIMEOUT_S,
    )
    return out_dir


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _assert_trains_as_cp1(results: Path, tag: str, name: str, ranks: int) -> None:
    """Every rank of the run saved as ``name`` took the steps CP=1 took on variant ``tag``."""
    reference = load(results, f"cp1.{tag}_train")
    for rank in range(ranks):
        got = load(results, f"{name}_train", rank)
        assert got["loss"].shape == (NUM_STEPS,)
        _close(got["loss"], reference["loss"])
        _close(got["grad_norm"], reference["grad_norm"])
        assert got["global_valid_toks"].tolist() == reference["global_valid_toks"].tolist()
        for metric in ("moe_aux_loss", "moe_router_entropy", "moe_expert_load_layer1_max"):
            if metric in reference["metrics"]:
                _close(torch.as_tensor(got["metrics"][metric]), torch.as_tensor(reference["metrics"][metric]))
        # Log-probs, or a value model's values.
        _close(load(results, f"{name}_logprobs", rank), load(results, f"cp1.{tag}_logprobs"))


@pytest.mark.parametrize("tag", VARIANTS)
def test_cp2_trains_as_cp1(results: Path, tag: str) -> None:
    _assert_trains_as_cp1(results, tag, f"cp2.{tag}", ranks=2)


def test_moe_load_balancing_loss_is_trained_under_cp2(results: Path) -> None:
    """The MoE variants above train the load-balancing loss (from the routing gathered over the CP ranks) and
    replay the batch's routing (CP=1 replays full rows, so CP=2 agrees only if each rank takes its own)."""
    for tag in ("moe", "moe_packed"):
        metrics = load(results, f"cp2.{tag}_train")["metrics"]
        assert torch.as_tensor(metrics["moe_aux_loss"]).min() > 0
        assert torch.as_tensor(metrics["moe_router_entropy"]).min() > 0


@pytest.mark.parametrize(("layout", "tag"), FOUR_RANK_CASES)
def test_cp2_with_tp2_or_dp2_trains_as_cp1(results: Path, layout: str, tag: str) -> None:
    _assert_trains_as_cp1(results, tag, f"four.{layout}_{tag}", ranks=4)


@pytest.mark.parametrize("tag", ["packed", "dynamic"])
def test_packing_and_dynamic_batching_change_nothing_under_cp2(results: Path, tag: str) -> None:
    """Documents in one packed row never attend each other; micro-batches cut to their longest row and
    recomputed layers give the same numbers."""
    _close(load(results, f"cp2.{tag}_train")["loss"], load(results, "cp2.padded_train")["loss"])
    _close(load(results, f"cp2.{tag}_logprobs"), load(results, "cp2.padded_logprobs"))


def test_cp2_resumes_bit_for_bit(results: Path) -> None:
    for rank in (0, 1):
        went_on, went_on_lp = load(results, "cp2.went_on", rank)
        resumed, resumed_lp = load(results, "cp2.resumed", rank)
        assert torch.equal(went_on["loss"], resumed["loss"])
        assert torch.equal(went_on["grad_norm"], resumed["grad_norm"])
        assert torch.equal(went_on_lp, resumed_lp)


def test_cp2_exports_the_cp1_weights(results: Path) -> None:
    cp1 = load_file(str(results / "hf_cp1" / "model.safetensors"))
    cp2 = load_file(str(results / "hf_cp2" / "model.safetensors"))
    assert cp1.keys() == cp2.keys()
    for name in cp1:
        # Three AdamW steps divide each gradient by its own running scale, so a rounding difference in a
        # near-zero gradient moves its weight by up to ~1e-4 of the learning rate (1e-2).
        torch.testing.assert_close(cp2[name], cp1[name], rtol=1e-5, atol=1e-5)
