"""DTensorPolicyWorker parity over gloo: FSDP2 (dp=2) and TP (tp=2, with and without sequence parallel)
against a plain single-process Hugging Face training loop on the same batches; the same for DPO on
preference pairs and for a Bradley-Terry reward model (the scalar head on the same worker).

One pair of spawned processes runs every scenario in turn (each builds a fresh worker on a new device mesh)
and writes its results to disk; the tests then compare them with the reference computed here. Spawning once
keeps the module well under a minute on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_groups import spawn_and_wait
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from nemo_rl.algorithms.interfaces import LossType
from nemo_rl.algorithms.loss_functions import ClippedPGLossFn, DPOLossFn, PreferenceLoss
from nemo_rl.config.loss import ClippedPGLossConfig, DPOLossConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import free_port

WORLD_SIZE = 2
VOCAB = 128
SEQ_LEN = 11  # odd on purpose: sequence parallel must pad it to a multiple of tp
GLOBAL_BATCH = 8
NUM_STEPS = 3
REPEATED_ROWS = [0, 1, 0, 2, 1, 0]
"""Rows of the 6-row scoring batch, some repeated, that a worker with ``dedupe_rows`` computes once each."""
LR = 1e-3
SPAWN_TIMEOUT_S = 240.0


# ------------------------------------------------------------------------------------------ test assets
def build_tiny_model(path: Path, tie_word_embeddings: bool = False) -> None:
    """A random ~0.1M-parameter Qwen2 (4 heads, 2 KV heads: divisible by TP=2) and a character tokenizer."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1} | {chr(32 + i): i + 2 for i in range(VOCAB - 2)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(path)


def make_batch(seed: int, num_rows: int) -> BatchedDataDict[Any]:
    """Right-padded random sequences with prompt tokens masked out and one sample masked out per 8."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, SEQ_LEN + 1, (num_rows,), generator=g)
    prompt = torch.randint(1, 3, (num_rows,), generator=g)
    ids = torch.randint(2, VOCAB, (num_rows, SEQ_LEN), generator=g)
    positions = torch.arange(SEQ_LEN)[None, :]
    ids = ids * (positions < lengths[:, None])
    token_mask = ((positions >= prompt[:, None]) & (positions < lengths[:, None])).float()
    sample_mask = torch.ones(num_rows)
    sample_mask[3::8] = 0.0
    return BatchedDataDict(
        {"input_ids": ids, "input_lengths": lengths, "token_mask": token_mask, "sample_mask": sample_mask}
    )


class TinyNLLLoss:
    """Token-level NLL following nemo_rl/algorithms/interfaces.py (share of the global loss)."""

    loss_type = LossType.TOKEN_LEVEL
    rows_per_group = 1

    def __call__(
        self,
        next_token_logits_BTV: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs_BT = torch.log_softmax(next_token_logits_BTV[:, :-1].float(), dim=-1)
        logprobs_BT = logprobs_BT.gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
        mask_BT = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        loss = -(logprobs_BT * mask_BT).sum() / global_valid_toks
        metrics = {"loss": float(loss.detach()), "num_valid_tokens": float(mask_BT.sum())}
        if mask_BT.any():  # absent for a micro-batch without trained tokens: the worker must cope
            metrics["token_logprob_min"] = float(logprobs_BT.detach()[mask_BT > 0].min())
        return loss, metrics


def policy_cfg(model_dir: Path, dtensor: dict[str, Any] | None = None, **overrides: Any) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": str(model_dir),
            "train_global_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size": 2,
            "logprob_batch_size": 3,
            "max_grad_norm": 0.05,  # small enough that clipping is active
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": LR, "weight_decay": 0.01}},
            "scheduler": [
                {
                    "name": "torch.optim.lr_scheduler.LinearLR",
                    "kwargs": {"start_factor": 0.5, "total_iters": 2},
                },
                {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 1}},
                {"milestones": [2]},
            ],
            "dtensor_cfg": dtensor or {},
        }
        | overrides
    )


def train_data() -> BatchedDataDict[Any]:
    """Each global batch's rows in groups that share a 3-token prompt, as GRPO sends them: rows 0-2, row 3 alone
    and rows 4-7 (dp=2 gives rank 0 a group of 3 and one of 1, rank 1 a group of 4); rows 3 and 5 masked out."""
    data = make_batch(seed=1, num_rows=GLOBAL_BATCH * NUM_STEPS)
    for start in range(0, data.size, GLOBAL_BATCH):
        for first, size in ((start, 3), (start + 4, 4)):
            data["input_ids"][first : first + size, :3] = data["input_ids"][first, :3]
    positions = torch.arange(SEQ_LEN)[None, :]
    data["token_mask"] = ((positions >= 3) & (positions < data["input_lengths"][:, None])).float()
    data["sample_mask"][5::GLOBAL_BATCH] = 0.0
    return data


# Preference pairs: GLOBAL_BATCH rows (GLOBAL_BATCH // 2 pairs) per step, (chosen, rejected) interleaved.
DPO_CFG = DPOLossConfig(reference_policy_kl_penalty=0.5, sft_loss_weight=0.2)


def preference_data(num_rows: int = GLOBAL_BATCH * NUM_STEPS) -> BatchedDataDict[Any]:
    """Pairs sharing a prompt (their first 3 tokens), one pair masked out per step, ``idx`` per pair."""
    data = make_batch(seed=3, num_rows=num_rows)
    data["input_ids"][1::2, :3] = data["input_ids"][0::2, :3]
    data["input_lengths"] = data["input_lengths"].clamp(min=5)
    positions = torch.arange(SEQ_LEN)[None, :]
    data["input_ids"] *= positions < data["input_lengths"][:, None]
    data["token_mask"] = ((positions >= 3) & (positions < data["input_lengths"][:, None])).float()
    data["sample_mask"] = torch.ones(num_rows)
    data["sample_mask"][6::GLOBAL_BATCH] = 0.0
    data["sample_mask"][7::GLOBAL_BATCH] = 0.0
    data["idx"] = torch.arange(num_rows) // 2
    return data


# One layer more than the checkpoint (initialised fresh), the embedding and the first layer frozen.
GROWN_FROZEN: dict[str, Any] = {
    "hf_config_overrides": {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3},
    "frozen_parameters": ["model.embed_tokens.*", "model.layers.0.*"],
}


def with_reference_logprobs(data: BatchedDataDict[Any], reference: torch.Tensor) -> BatchedDataDict[Any]:
    out = BatchedDataDict(dict(data))
    out["reference_policy_logprobs"] = reference
    return out


GRPO_LOSS_CFG = ClippedPGLossConfig(reference_policy_kl_penalty=0.0, use_importance_sampling_correction=True)


def grpo_data() -> BatchedDataDict[Any]:
    """One global batch with GRPO's keys: per-sequence advantages and sampler log-probs."""
    data = make_batch(seed=4, num_rows=GLOBAL_BATCH)
    g = torch.Generator().manual_seed(5)
    data["advantages"] = torch.randn(GLOBAL_BATCH, 1, generator=g).expand(-1, SEQ_LEN).contiguous()
    data["generation_logprobs"] = -torch.rand(GLOBAL_BATCH, SEQ_LEN, generator=g) * 5 * data["token_mask"]
    return data


# -------------------------------------------------------------------------------- spawned scenarios
def _shard(data: BatchedDataDict[Any], dp_rank: int, dp_size: int) -> BatchedDataDict[Any]:
    return data.shard_by_batch_size(dp_size, batch_size=GLOBAL_BATCH)[dp_rank]


def _flat_gather_against_per_unit(worker: Any) -> dict[str, bool]:
    """Whether the one-all-gather refit (``gather_dim0_shards``) equals the per-unit gather bit for bit, on
    the trained model and on shards torch.chunk splits unevenly (5 rows: 3 + 2; 1 row: 1 + none)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from nemo_rl.models.policy.parallelize import fsdp_dim0_sharded, gather_dim0_shards, reshard_all

    reshard_all(worker.model)
    params = list(worker.model.named_parameters())
    per_unit = {name: t.clone() for name, t in worker.iter_hf_weights(torch.bfloat16)}
    flat = dict(gather_dim0_shards(params, torch.bfloat16, worker.device))
    uneven = [
        (name, torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) / 7)
        for name, rows in (("a", 5), ("b", 1))
    ]
    sharded = [(name, distribute_tensor(t, worker.mesh["dp"], [Shard(0)])) for name, t in uneven]
    return {
        "eligible": fsdp_dim0_sharded(params),
        "model": flat.keys() == {n for n, _ in params}
        and all(torch.equal(flat[n], per_unit[n]) and flat[n].dtype == per_unit[n].dtype for n in flat),
        "uneven": all(
            torch.equal(got, full)
            for (_, got), (_, full) in zip(
                gather_dim0_shards(sharded, torch.float32, worker.device), uneven, strict=True
            )
        ),
    }


def _scenarios(rank: int, model_dir: Path, out_dir: Path) -> None:
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    def save(name: str, value: Any) -> None:
        torch.save(value, out_dir / f"{name}.rank{rank}.pt")

    data = train_data()
    score_data = make_batch(seed=2, num_rows=6)
    loss_fn = TinyNLLLoss()

    # FSDP over 2 dp ranks, two micro-batch sizes. Then one GRPO step on the (equal) trained weights: with
    # mbs 1 the previous policy's log-probs come from the scoring pass, with mbs 4 from the training forward.
    for mbs in (1, 4):
        worker = DTensorPolicyWorker(policy_cfg(model_dir), weights_path=None)
        shard = _shard(data, worker.dp_rank, worker.dp_size)
        save(f"dp2_mbs{mbs}_train", worker.train(shard, loss_fn, mbs=mbs))
        grpo_shard = _shard(grpo_data(), worker.dp_rank, worker.dp_size)
        if mbs == 1:
            grpo_shard["prev_logprobs"] = worker.get_logprobs(grpo_shard)["logprobs"]
        grpo_loss = ClippedPGLossFn(GRPO_LOSS_CFG, prev_logprobs_from_forward=mbs == 4)
        save(f"grpo_prev_{'forward' if mbs == 4 else 'pass'}", worker.train(grpo_shard, grpo_loss, mbs=mbs))
        if mbs == 4:
            save("flat_gather", _flat_gather_against_per_unit(worker))
        worker.shutdown()

    # Dynamic batching over 2 dp ranks: token-budget micro-batches, cut to their longest row.
    dynamic = {"enabled": True, "train_mb_tokens": 24, "logprob_mb_tokens": 20, "sequence_length_round": 4}
    worker = DTensorPolicyWorker(policy_cfg(model_dir, dynamic_batching=dynamic))
    save("dynamic_logprobs_init", worker.get_logprobs(score_data))
    save("dynamic_train", worker.train(_shard(data, worker.dp_rank, worker.dp_size), loss_fn))
    worker.shutdown()

    # Sequence packing over 2 dp ranks: each micro-batch's rows run as one packed row.
    packing = {"enabled": True, "train_mb_tokens": 24, "logprob_mb_tokens": 20, "sequence_length_round": 4}
    worker = DTensorPolicyWorker(policy_cfg(model_dir, sequence_packing=packing))
    save("packed_logprobs_init", worker.get_logprobs(score_data))
    save("packed_train", worker.train(_shard(data, worker.dp_rank, worker.dp_size), loss_fn))
    worker.shutdown()

    # Shared prompts over 2 dp ranks with token budgets: each prompt computed once per micro-batch; training
    # micro-batches hold both of rank 0's groups, the scoring budget splits the group of 4.
    shared = {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 16, "sequence_length_round": 4}
    worker = DTensorPolicyWorker(
        policy_cfg(model_dir, dynamic_batching=shared, shared_prefix={"enabled": True})
    )
    save("shared_logprobs_init", worker.get_logprobs(data.slice(0, GLOBAL_BATCH)))
    save("shared_train", worker.train(_shard(data, worker.dp_rank, worker.dp_size), loss_fn))
    save("shared_attention", worker.model.config._attn_implementation)  # set by the first shared forward
    worker.shutdown()

    # Tensor parallel (dp=1): scoring before/after training, reference logprobs, export and refit stream.
    worker = DTensorPolicyWorker(policy_cfg(model_dir, {"tensor_parallel_size": 2}))
    save("tp2_logprobs_init", worker.get_logprobs(score_data))
    save("tp2_train", worker.train(_shard(data, worker.dp_rank, worker.dp_size), loss_fn))
    save("tp2_logprobs_trained", worker.get_logprobs(score_data))
    save("tp2_ref_logprobs", worker.get_reference_policy_logprobs(score_data))
    save("tp2_topk", worker.get_topk_logits(score_data, k=3))
    worker.export_hf(str(out_dir / "export"))
    weights = {name: t.clone() for name, t in worker.iter_hf_weights(torch.bfloat16)}
    save("tp2_refit", {"weights": weights, "manifest": worker.weights_manifest(torch.bfloat16)})
    worker.shutdown()

    # Sequence parallel + activation checkpointing, on padded (odd) sequences; training shares each
    # micro-batch's prompts (fixed micro-batches of 4 rows: groups of 3 + 1 and 4), scoring has none to share.
    sp = {"tensor_parallel_size": 2, "sequence_parallel": True, "activation_checkpointing": True}
    worker = DTensorPolicyWorker(policy_cfg(model_dir, sp, shared_prefix={"enabled": True}))
    save("sp2_logprobs_init", worker.get_logprobs(score_data))
    save("sp2_train", worker.train(_shard(data, worker.dp_rank, worker.dp_size), loss_fn, mbs=4))
    save("sp2_attention", worker.model.config._attn_implementation)
    worker.shutdown()

    # DPO on preference pairs (dp=2 deals whole pairs, as Policy does; tp=2), with the reference log-probs of
    # the initial model computed by the worker itself.
    pairs = preference_data()
    # At tp=2 each pair computes its shared prompt once (policy.shared_prefix), in scoring and training.
    for name, dtensor in (("dpo_dp2", {}), ("dpo_tp2", {"tensor_parallel_size": 2})):
        shared_prefix = {"enabled": name == "dpo_tp2"}
        worker = DTensorPolicyWorker(policy_cfg(model_dir, dtensor, shared_prefix=shared_prefix))
        dp_shards = pairs.shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH, group_size=2)
        shard = dp_shards[worker.dp_rank]
        shard["reference_policy_logprobs"] = worker.get_reference_policy_logprobs(shard)["reference_logprobs"]
        save(f"{name}_train", worker.train(shard, DPOLossFn(DPO_CFG), mbs=2))
        save(f"{name}_attention", worker.model.config._attn_implementation)
        worker.shutdown()

    # Reward model: the scalar head on the same worker, dp=2, tp=2 and sequence parallel; scores and export.
    # At tp=2 each pair computes its shared prompt once, and rows repeated in full run once (dedupe_rows).
    rm = {"reward_model_cfg": {"enabled": True}}
    for name, dtensor in (
        ("rm_dp2", {}),
        ("rm_tp2", {"tensor_parallel_size": 2}),
        ("rm_sp2", {"tensor_parallel_size": 2, "sequence_parallel": True}),
    ):
        shared_prefix = {"enabled": name == "rm_tp2", "dedupe_rows": True}
        worker = DTensorPolicyWorker(
            policy_cfg(model_dir, dtensor, shared_prefix=shared_prefix, **rm), init_reference_model=False
        )
        shard = pairs.shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH, group_size=2)[
            worker.dp_rank
        ]
        save(f"{name}_scores_init", worker.score(score_data))
        if name == "rm_tp2":
            save("rm_tp2_scores_repeated_rows", worker.score(score_data.select_indices(REPEATED_ROWS)))
        save(f"{name}_train", worker.train(shard, PreferenceLoss(), mbs=2))
        save(f"{name}_scores_trained", worker.score(score_data))
        if name == "rm_tp2":
            worker.export_hf(str(out_dir / "rm_export"))
        worker.shutdown()

    # A reward model grown by one fresh layer whose embedding and first layer are frozen (tp=2): only the rest
    # trains, and the export holds the frozen weights unchanged.
    worker = DTensorPolicyWorker(
        policy_cfg(model_dir, {"tensor_parallel_size": 2}, **rm, **GROWN_FROZEN), init_reference_model=False
    )
    shard = pairs.shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH, group_size=2)[worker.dp_rank]
    save("rm_frozen_train", worker.train(shard, PreferenceLoss(), mbs=2))
    save("rm_frozen_scores_trained", worker.score(score_data))
    worker.export_hf(str(out_dir / "rm_frozen_export"))
    worker.shutdown()
    # The same replicated over dp=2: only the trained parameters have gradients, and only they are summed.
    worker = DTensorPolicyWorker(
        policy_cfg(model_dir, {"data_parallel_mode": "replicate"}, **rm, **GROWN_FROZEN),
        init_reference_model=False,
    )
    shard = pairs.shard_by_batch_size(worker.dp_size, batch_size=GLOBAL_BATCH, group_size=2)[worker.dp_rank]
    save("rm_frozen_replicate_train", worker.train(shard, PreferenceLoss(), mbs=2))
    save("rm_frozen_replicate_grads", {n for n, p in worker.model.named_parameters() if p.grad is not None})
    save("rm_frozen_replicate_scores_trained", worker.score(score_data))
    # A trained parameter that only rank 0's forward reached is summed into both ranks' gradients; one no
    # rank reached keeps no gradient (the optimizer skips it, as in one process).
    one_rank, no_rank, *_ = [p for p in worker.model.parameters() if p.requires_grad]
    for p in worker.model.parameters():
        p.grad = None
    one_rank.grad = torch.ones_like(one_rank) if rank == 0 else None
    worker._all_reduce_replicated_grads()
    save("replicate_partial_grads", (one_rank.grad, no_rank.grad))
    worker.shutdown()

    # Reward-model resume: two steps, saved (the scalar head included), then a fresh worker of the same layout
    # loads them and takes step three, bit for bit as the uninterrupted rm_dp2 worker did.
    def rm_shard(steps: range) -> BatchedDataDict[Any]:
        part = pairs.slice(steps.start * GLOBAL_BATCH, steps.stop * GLOBAL_BATCH)
        return part.shard_by_batch_size(WORLD_SIZE, batch_size=GLOBAL_BATCH, group_size=2)[rank]

    worker = DTensorPolicyWorker(policy_cfg(model_dir, **rm), init_reference_model=False)
    worker.train(rm_shard(range(0, 2)), PreferenceLoss(), mbs=2)
    worker.save_checkpoint(str(out_dir / "rm_ckpt_weights"), str(out_dir / "rm_ckpt_optim"))
    worker.shutdown()
    worker = DTensorPolicyWorker(
        policy_cfg(model_dir, **rm),
        init_reference_model=False,
        weights_path=str(out_dir / "rm_ckpt_weights"),
        optimizer_path=str(out_dir / "rm_ckpt_optim"),
    )
    save("rm_resumed_train", worker.train(rm_shard(range(2, NUM_STEPS)), PreferenceLoss(), mbs=2))
    worker.shutdown()

    # Resume across layouts, each way (model and optimizer state): FSDP at dp=2 takes step one and saves; dp=2
    # with the model replicated (a plain module on each rank, gradients summed by one all-reduce; activation
    # checkpointing on) loads it, takes step two and saves; a fresh FSDP dp=2 worker and a tp=2 worker each
    # load that and take step three.
    from torch.distributed.tensor import DTensor

    def steps(first: int, last: int, dp_size: int = WORLD_SIZE) -> BatchedDataDict[Any]:
        return _shard(data.slice(first * GLOBAL_BATCH, last * GLOBAL_BATCH), rank % dp_size, dp_size)

    worker = DTensorPolicyWorker(policy_cfg(model_dir), init_reference_model=False)
    save("fsdp_step1_train", worker.train(steps(0, 1), loss_fn))
    worker.save_checkpoint(str(out_dir / "fsdp_ckpt_weights"), str(out_dir / "fsdp_ckpt_optim"))
    worker.shutdown()
    replicate = {"data_parallel_mode": "replicate", "activation_checkpointing": True}
    worker = DTensorPolicyWorker(
        policy_cfg(model_dir, replicate),
        weights_path=str(out_dir / "fsdp_ckpt_weights"),
        optimizer_path=str(out_dir / "fsdp_ckpt_optim"),
    )
    save("replicate_dtensors", sum(isinstance(p, DTensor) for p in worker.model.parameters()))
    save("replicate_train", worker.train(steps(1, 2), loss_fn))
    save("replicate_ref_logprobs", worker.get_reference_policy_logprobs(score_data))
    worker.save_checkpoint(str(out_dir / "ckpt_weights"), str(out_dir / "ckpt_optim"))
    worker.shutdown()
    for name, dtensor in (("resumed_fsdp", {}), ("resumed", {"tensor_parallel_size": 2})):
        worker = DTensorPolicyWorker(
            policy_cfg(model_dir, dtensor),
            init_reference_model=False,
            weights_path=str(out_dir / "ckpt_weights"),
            optimizer_path=str(out_dir / "ckpt_optim"),
        )
        save(f"{name}_dtensors", sum(isinstance(p, DTensor) for p in worker.model.parameters()))
        save(f"{name}_train", worker.train(steps(2, 3, worker.dp_size), loss_fn))
        worker.shutdown()


def _one_rank_scenarios(model_dir: Path, out_dir: Path) -> None:
    """A one-rank float32 policy trains as a plain module (no FSDP); its checkpoint resumes under FSDP."""
    from torch.distributed.tensor import DTensor

    from nemo_rl.models.policy import hf_io
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    def save(name: str, value: Any) -> None:
        torch.save(value, out_dir / f"{name}.rank0.pt")

    data, score_data = train_data(), make_batch(seed=2, num_rows=6)
    worker = DTensorPolicyWorker(policy_cfg(model_dir))
    save("one_rank_dtensors", sum(isinstance(p, DTensor) for p in worker.model.parameters()))
    save("one_rank_logprobs_init", worker.get_logprobs(score_data))
    save("one_rank_train", worker.train(data.slice(0, 2 * GLOBAL_BATCH), TinyNLLLoss()))
    save("one_rank_ref_logprobs", worker.get_reference_policy_logprobs(score_data))
    # The refit's weights are copies: the next step must not change what was sent.
    sent = dict(worker.iter_hf_weights(torch.float32))
    save(
        "one_rank_refit_shares_storage",
        any(
            sent[name].untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
            for name, p in worker.model.named_parameters()
        ),
    )
    worker.save_checkpoint(str(out_dir / "one_rank_weights"), str(out_dir / "one_rank_optim"))
    worker.shutdown()
    needs_fsdp = hf_io.needs_fsdp
    hf_io.needs_fsdp = lambda *args: True  # type: ignore[assignment]  # the layout this one-rank run had before
    worker = DTensorPolicyWorker(
        policy_cfg(model_dir),
        weights_path=str(out_dir / "one_rank_weights"),
        optimizer_path=str(out_dir / "one_rank_optim"),
    )
    save("one_rank_fsdp_dtensors", sum(isinstance(p, DTensor) for p in worker.model.parameters()))
    save(
        "one_rank_fsdp_resumed_train",
        worker.train(data.slice(2 * GLOBAL_BATCH, 3 * GLOBAL_BATCH), TinyNLLLoss()),
    )
    worker.shutdown()
    hf_io.needs_fsdp = needs_fsdp


def _spawn_entry(rank: int, port: int, one_rank_port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NEMO_RL_TORCH_THREADS="1",
    )
    try:
        if rank == 0:
            # A world of its own first (rank 1 waits at the rendezvous meanwhile).
            os.environ.update(WORLD_SIZE="1", MASTER_PORT=str(one_rank_port))
            _one_rank_scenarios(Path(model_dir), Path(out_dir))
            dist.destroy_process_group()
            os.environ.update(WORLD_SIZE=str(WORLD_SIZE), MASTER_PORT=str(port))
        _scenarios(rank, Path(model_dir), Path(out_dir))
    except BaseException:
        (Path(out_dir) / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    # Tied embeddings, as in most small models: TP must keep the LM head and the embedding one weight.
    build_tiny_model(path, tie_word_embeddings=True)
    return path


@pytest.fixture(scope="module")
def results(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("dtensor_results")
    spawn_and_wait(
        _spawn_entry, (free_port(), free_port(), str(model_dir), str(out_dir)), WORLD_SIZE, SPAWN_TIMEOUT_S
    )
    return out_dir


def load(out_dir: Path, name: str, rank: int = 0) -> Any:
    return torch.load(out_dir / f"{name}.rank{rank}.pt", weights_only=False)


# --------------------------------------------------------------------------- single-process reference
def reference_logprobs(model: torch.nn.Module, data: BatchedDataDict[Any]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    out = torch.zeros(data["input_ids"].shape)
    out[:, 1:] = lp
    return out * (torch.arange(SEQ_LEN)[None, :] < data["input_lengths"][:, None])


def single_process_reference(model_dir: Path) -> dict[str, Any]:
    """Plain HF model + AdamW + the same schedule and clipping, one process, whole global batches."""
    # Built directly (not from_pretrained) so the rotary buffers are computed, not loaded.
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    score_data = make_batch(seed=2, num_rows=6)
    init_lp = reference_logprobs(model, score_data)
    grouped_init_lp = reference_logprobs(model, train_data().slice(0, GLOBAL_BATCH))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=1),
        ],
        milestones=[2],
    )
    loss_fn = TinyNLLLoss()
    data = train_data()
    losses, grad_norms, lrs = [], [], []
    for step in range(NUM_STEPS):
        batch = data.slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        mask = batch["token_mask"][:, 1:] * batch["sample_mask"][:, None]
        optimizer.zero_grad()
        loss, _ = loss_fn(model(input_ids=batch["input_ids"]).logits, batch, torch.tensor(0.0), mask.sum())
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        lrs.append(optimizer.param_groups[0]["lr"])
        losses.append(float(loss.detach()))
        optimizer.step()
        scheduler.step()
    return {
        "loss": torch.tensor(losses),
        "grad_norm": torch.tensor(grad_norms),
        "lr": torch.tensor(lrs),
        "init_logprobs": init_lp,
        "grouped_init_logprobs": grouped_init_lp,
        "trained_logprobs": reference_logprobs(model, score_data),
        "trained_model": model,
    }


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    return single_process_reference(model_dir)


def _optimizer_and_schedule(model: torch.nn.Module) -> tuple[Any, Any]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=1),
        ],
        milestones=[2],
    )
    return optimizer, scheduler


def reference_rewards(model: torch.nn.Module, data: BatchedDataDict[Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=data["input_ids"]).logits.float().reshape(-1)


def single_process_preference_reference(model_dir: Path) -> dict[str, Any]:
    """DPO and reward-model training on the whole global batches in one process (plain HF models)."""
    pairs = preference_data()
    out: dict[str, Any] = {}
    lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    lm.load_state_dict(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    reference_lp = reference_logprobs(lm, pairs)
    config = AutoConfig.from_pretrained(model_dir, num_labels=1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the worker's seed for a head the checkpoint lacks
        loaded = AutoModelForSequenceClassification.from_pretrained(model_dir, config=config)
    rm = AutoModelForSequenceClassification.from_config(config)
    rm.load_state_dict(loaded.state_dict())
    score_data = make_batch(seed=2, num_rows=6)
    out["rm_scores_init"] = reference_rewards(rm, score_data)
    for name, model, loss_fn in (("dpo", lm, DPOLossFn(DPO_CFG)), ("rm", rm, PreferenceLoss())):
        optimizer, scheduler = _optimizer_and_schedule(model)
        losses, grad_norms, metrics = [], [], []
        for step in range(NUM_STEPS):
            batch = with_reference_logprobs(pairs, reference_lp).slice(
                step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH
            )
            optimizer.zero_grad()
            output = model(input_ids=batch["input_ids"]).logits
            loss, step_metrics = loss_fn(output, batch, batch["sample_mask"].sum(), torch.tensor(0.0))
            loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            losses.append(float(loss.detach()))
            metrics.append(step_metrics)
            optimizer.step()
            scheduler.step()
        out[name] = {"loss": torch.tensor(losses), "grad_norm": torch.tensor(grad_norms), "metrics": metrics}
    out["rm_scores_trained"] = reference_rewards(rm, score_data)

    # The grown reward model with frozen parameters: the optimizer holds only the others.
    grown = AutoConfig.from_pretrained(
        model_dir, num_labels=1, pad_token_id=0, **GROWN_FROZEN["hf_config_overrides"]
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        loaded = AutoModelForSequenceClassification.from_pretrained(model_dir, config=grown)
    frozen_rm = AutoModelForSequenceClassification.from_config(grown)
    frozen_rm.load_state_dict(loaded.state_dict())
    initial = {name: p.detach().clone() for name, p in frozen_rm.named_parameters()}
    for name, param in frozen_rm.named_parameters():
        param.requires_grad_(not name.startswith(("model.embed_tokens.", "model.layers.0.")))
    optimizer, scheduler = _optimizer_and_schedule(frozen_rm)
    losses, grad_norms = [], []
    for step in range(NUM_STEPS):
        batch = pairs.slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        optimizer.zero_grad()
        loss, _ = PreferenceLoss()(
            frozen_rm(input_ids=batch["input_ids"]).logits,
            batch,
            batch["sample_mask"].sum(),
            torch.tensor(0.0),
        )
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(frozen_rm.parameters(), 0.05)))
        losses.append(float(loss.detach()))
        optimizer.step()
        scheduler.step()
    out["rm_frozen"] = {
        "loss": torch.tensor(losses),
        "grad_norm": torch.tensor(grad_norms),
        "initial": initial,
        "scores_trained": reference_rewards(frozen_rm, score_data),
    }
    return out


@pytest.fixture(scope="module")
def preference_reference(model_dir: Path) -> dict[str, Any]:
    return single_process_preference_reference(model_dir)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=1e-6)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("scenario", ["dp2_mbs1", "dp2_mbs4", "dynamic", "packed", "shared", "tp2", "sp2"])
def test_training_matches_single_process(results: Path, reference: dict[str, Any], scenario: str) -> None:
    for rank in range(WORLD_SIZE):
        out = load(results, f"{scenario}_train", rank)
        assert_close(out["loss"], reference["loss"])
        assert_close(out["grad_norm"], reference["grad_norm"])
        assert_close(out["lr"], reference["lr"])
        assert out["grad_norm"][0] > 0.05, "clipping should be active in this test"
        # Metrics are shares summed over micro-batches and dp ranks: token counts are whole global batches.
        assert out["metrics"]["num_valid_tokens"] == out["global_valid_toks"].tolist()
        assert_close(torch.tensor(out["metrics"]["loss"]), reference["loss"])


def test_grpo_prev_logprobs_from_the_training_forward_equal_the_scoring_pass(results: Path) -> None:
    separate, from_forward = load(results, "grpo_prev_pass"), load(results, "grpo_prev_forward")
    assert_close(from_forward["loss"], separate["loss"])
    assert_close(from_forward["grad_norm"], separate["grad_norm"])
    assert sorted(from_forward["metrics"]) == sorted(separate["metrics"])
    for name, values in separate["metrics"].items():
        assert_close(torch.tensor(from_forward["metrics"][name]), torch.tensor(values), rtol=1e-4)
    # The importance weights pi_prev / pi_gen were read: the check covers more than the ratio of 1.
    assert separate["metrics"]["sampling_importance_ratio"][0] != pytest.approx(1.0)


def test_one_all_gather_refit_equals_the_per_unit_gather(results: Path) -> None:
    for rank in (0, 1):
        assert load(results, "flat_gather", rank=rank) == {"eligible": True, "model": True, "uneven": True}


def test_metric_min_is_reduced_with_min(results: Path) -> None:
    dp = load(results, "dp2_mbs1_train")
    tp = load(results, "tp2_train")  # one dp rank sees the whole global batch
    assert dp["metrics"]["token_logprob_min"] == pytest.approx(tp["metrics"]["token_logprob_min"], rel=1e-5)


def test_logprobs_match_hf_forward(results: Path, reference: dict[str, Any]) -> None:
    for name in ("tp2_logprobs_init", "sp2_logprobs_init", "dynamic_logprobs_init", "packed_logprobs_init"):
        assert_close(load(results, name)["logprobs"], reference["init_logprobs"])
    assert_close(load(results, "tp2_logprobs_trained")["logprobs"], reference["trained_logprobs"], rtol=1e-4)
    for rank in range(WORLD_SIZE):
        shared = load(results, "shared_logprobs_init", rank)["logprobs"]
        assert_close(shared, reference["grouped_init_logprobs"])


def test_shared_prefix_scenarios_ran_the_shared_forward(results: Path) -> None:
    from nemo_rl.models.policy.shared_prefix import ATTENTION

    for rank in range(WORLD_SIZE):
        assert load(results, "shared_attention", rank) == ATTENTION
        assert load(results, "sp2_attention", rank) == ATTENTION
        assert load(results, "dpo_tp2_attention", rank) == ATTENTION
        assert load(results, "dpo_dp2_attention", rank) == "sdpa"


def test_one_rank_policy_trains_without_fsdp_and_resumes_under_it(
    results: Path, reference: dict[str, Any]
) -> None:
    assert load(results, "one_rank_dtensors") == 0
    assert_close(load(results, "one_rank_logprobs_init")["logprobs"], reference["init_logprobs"])
    trained = load(results, "one_rank_train")
    for key in ("loss", "grad_norm", "lr"):
        assert_close(trained[key], reference[key][:2])
    assert_close(load(results, "one_rank_ref_logprobs")["reference_logprobs"], reference["init_logprobs"])
    assert load(results, "one_rank_refit_shares_storage") is False
    # The plain module's checkpoint loads into the FSDP layout and the third step matches the reference.
    assert load(results, "one_rank_fsdp_dtensors") > 0
    resumed = load(results, "one_rank_fsdp_resumed_train")
    for key in ("loss", "grad_norm", "lr"):
        assert_close(resumed[key], reference[key][2:])


def test_reference_logprobs_are_the_initial_model(results: Path, reference: dict[str, Any]) -> None:
    assert_close(load(results, "tp2_ref_logprobs")["reference_logprobs"], reference["init_logprobs"])


def test_resume_across_fsdp_replicate_and_tp_continues_like_one_process(
    results: Path, reference: dict[str, Any]
) -> None:
    # Step one under FSDP, step two replicated (resumed from FSDP's checkpoint, with activation
    # checkpointing), step three under FSDP and under TP (each resumed from the replicated checkpoint).
    for rank in range(WORLD_SIZE):
        assert load(results, "replicate_dtensors", rank) == 0
        assert load(results, "resumed_fsdp_dtensors", rank) > 0
        for name, done in (("fsdp_step1", 0), ("replicate", 1), ("resumed_fsdp", 2), ("resumed", 2)):
            out = load(results, f"{name}_train", rank)
            for key in ("loss", "grad_norm", "lr"):
                assert_close(out[key], reference[key][done : done + 1])
        ref_logprobs = load(results, "replicate_ref_logprobs", rank)["reference_logprobs"]
        assert_close(ref_logprobs, reference["init_logprobs"])


def test_reward_model_resumes_bit_for_bit(results: Path) -> None:
    for rank in range(WORLD_SIZE):
        resumed, uninterrupted = load(results, "rm_resumed_train", rank), load(results, "rm_dp2_train", rank)
        for key in ("loss", "grad_norm", "lr"):
            assert torch.equal(resumed[key], uninterrupted[key][2:]), (key, resumed[key], uninterrupted[key])
        for name, values in resumed["metrics"].items():
            assert values == uninterrupted["metrics"][name][2:], name


def test_export_loads_in_transformers(results: Path, reference: dict[str, Any]) -> None:
    export_dir = results / "export"
    exported = AutoModelForCausalLM.from_pretrained(export_dir)
    score_data = make_batch(seed=2, num_rows=6)
    assert_close(reference_logprobs(exported, score_data), load(results, "tp2_logprobs_trained")["logprobs"])
    # Greedy next tokens and their logits equal the worker's top-1.
    topk = load(results, "tp2_topk")
    with torch.no_grad():
        logits = exported(input_ids=score_data["input_ids"]).logits
    valid = torch.arange(SEQ_LEN)[None, :] < score_data["input_lengths"][:, None]
    assert torch.equal(logits.argmax(-1)[valid], topk["topk_indices"][..., 0][valid])
    assert_close(logits.topk(3, dim=-1).values[valid], topk["topk_logits"][valid])
    config = json.loads((export_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (export_dir / "tokenizer.json").exists()


def test_refit_stream_is_full_hf_weights(results: Path) -> None:
    refit = load(results, "tp2_refit")
    model = AutoModelForCausalLM.from_pretrained(results / "export")
    exported = model.state_dict()
    # Every parameter once: the tied LM head is not sent again.
    assert set(refit["weights"]) == {name for name, _ in model.named_parameters()}
    assert "lm_head.weight" not in refit["weights"]
    for name, tensor in refit["weights"].items():
        assert tensor.dtype == torch.bfloat16
        assert refit["manifest"][name] == (tuple(exported[name].shape), "bfloat16")
        torch.testing.assert_close(tensor, exported[name].to(torch.bfloat16))
    # Both tp ranks hold the full tensors.
    other = load(results, "tp2_refit", rank=1)
    for name, tensor in refit["weights"].items():
        assert torch.equal(tensor, other["weights"][name])


@pytest.mark.parametrize("scenario", ["dpo_dp2", "dpo_tp2", "rm_dp2", "rm_tp2", "rm_sp2"])
def test_preference_training_matches_single_process(
    results: Path, preference_reference: dict[str, Any], scenario: str
) -> None:
    expected = preference_reference[scenario.split("_")[0]]
    for rank in range(WORLD_SIZE):
        out = load(results, f"{scenario}_train", rank)
        assert_close(out["loss"], expected["loss"])
        assert_close(out["grad_norm"], expected["grad_norm"])
        # The loss's metrics are whole-batch values once their shares are summed. (DPO's step-0 accuracy is
        # left out: its margins are exactly 0 on the worker and rounding noise in the reference.)
        first = 1 if scenario.startswith("dpo") else 0
        # The shared-prompt forward (dpo_tp2) sums in another order, and DPO's rewards are small differences
        # of log-prob sums near -40: float32 rounding of those sums shows at 1e-5 relative.
        rtol = 1e-4 if scenario == "dpo_tp2" else 1e-5
        for name in ("accuracy", "rewards_chosen_mean", "rewards_rejected_mean", "num_valid_samples"):
            actual = torch.tensor(out["metrics"][name])
            reference = torch.tensor([m[name] for m in expected["metrics"]])
            start = first if name == "accuracy" else 0
            assert_close(actual[start:], reference[start:], rtol=rtol)
        assert out["metrics"]["num_valid_samples"] == [3.0] * NUM_STEPS  # one of 4 pairs masked per step


def test_frozen_parameters_and_added_layers(results: Path, preference_reference: dict[str, Any]) -> None:
    expected = preference_reference["rm_frozen"]
    for rank in range(WORLD_SIZE):
        for layout in ("rm_frozen", "rm_frozen_replicate"):
            out = load(results, f"{layout}_train", rank)
            assert_close(out["loss"], expected["loss"])
            assert_close(out["grad_norm"], expected["grad_norm"])
        trained = load(results, "rm_frozen_replicate_grads", rank)
        assert trained and not any(n.startswith(("model.embed_tokens.", "model.layers.0.")) for n in trained)
        one_rank, no_rank = load(results, "replicate_partial_grads", rank)
        assert torch.equal(one_rank, torch.ones_like(one_rank)) and no_rank is None
    for layout in ("rm_frozen", "rm_frozen_replicate"):
        scores = load(results, f"{layout}_scores_trained")["scores"]
        assert_close(scores, expected["scores_trained"], rtol=1e-4)
    exported = AutoModelForSequenceClassification.from_pretrained(results / "rm_frozen_export")
    assert exported.config.num_hidden_layers == 3
    for name, param in exported.named_parameters():
        initial = expected["initial"][name]
        if name.startswith(("model.embed_tokens.", "model.layers.0.")):
            assert torch.equal(param.detach(), initial), name
        else:
            assert not torch.equal(param.detach(), initial), name


def test_reward_model_scores_and_export(results: Path, preference_reference: dict[str, Any]) -> None:
    for name in ("rm_dp2", "rm_tp2", "rm_sp2"):
        assert_close(load(results, f"{name}_scores_init")["scores"], preference_reference["rm_scores_init"])
        assert_close(
            load(results, f"{name}_scores_trained")["scores"],
            preference_reference["rm_scores_trained"],
            rtol=1e-4,
        )
    repeated = load(results, "rm_tp2_scores_repeated_rows")["scores"]
    assert_close(repeated, preference_reference["rm_scores_init"][REPEATED_ROWS])
    # The export is a sequence-classification model with one output that scores exactly as the worker did.
    exported = AutoModelForSequenceClassification.from_pretrained(results / "rm_export")
    assert exported.config.num_labels == 1
    assert json.loads((results / "rm_export" / "config.json").read_text())["architectures"] == [
        "Qwen2ForSequenceClassification"
    ]
    scores = reference_rewards(exported, make_batch(seed=2, num_rows=6))
    assert_close(scores, load(results, "rm_tp2_scores_trained")["scores"])
