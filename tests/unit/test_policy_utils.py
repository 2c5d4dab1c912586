"""Single-process pieces of the policy backend: log-prob alignment, micro-batching, optimizer and schedule."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest
import torch

from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import OptimizerConfig, PolicyConfig, SchedulerEntry, SchedulerMilestones
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy import lm_policy
from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker
from nemo_rl.models.policy.interfaces import PolicyInterface
from nemo_rl.models.policy.loss_interface import group_metrics, metric_reduction, reduce_metrics
from nemo_rl.models.policy.optim import build_optimizer, build_scheduler, clip_grad_norm_, frozen_names
from nemo_rl.models.policy.parallelize import apply_tensor_parallel, import_by_path
from nemo_rl.models.policy.utils import (
    PackedRows,
    fixed_size_parts,
    global_valid_counts,
    packing_parts,
    pad_sequence_dim,
    split_parts,
    token_budget_parts,
    token_logprobs,
    topk_logits,
    trim_sequence_dim,
)


def test_token_logprobs_are_aligned_with_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    lengths = torch.tensor([5, 3])
    lp = token_logprobs(logits, ids, lengths)
    log_softmax = torch.log_softmax(logits, dim=-1)
    for b in range(2):
        assert lp[b, 0] == 0.0
        for t in range(1, 5):
            expected = log_softmax[b, t - 1, ids[b, t]] if t < lengths[b] else torch.tensor(0.0)
            torch.testing.assert_close(lp[b, t], expected)


def test_topk_logits_mask_padding_and_check_k() -> None:
    logits = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    values, indices = topk_logits(logits, torch.tensor([3, 1]), k=2)
    assert values.shape == indices.shape == (2, 3, 2)
    assert indices[0, 0].tolist() == [3, 2]
    assert values[0, 2].tolist() == [11.0, 10.0]
    assert values[1, 1:].abs().sum() == 0 and indices[1, 1:].abs().sum() == 0
    with pytest.raises(ValueError, match="k must be between 1"):
        topk_logits(logits, torch.tensor([3, 3]), k=5)


def _batch() -> BatchedDataDict[Any]:
    return BatchedDataDict(
        {
            "input_ids": torch.ones(3, 5, dtype=torch.long),
            "input_lengths": torch.tensor([5, 2, 4]),
            "token_mask": torch.ones(3, 5),
            "sample_mask": torch.tensor([1.0, 0.0, 1.0]),
            "topk": torch.ones(3, 5, 2),
            "names": ["a", "b", "c"],
        }
    )


def test_pad_and_trim_touch_only_per_token_tensors() -> None:
    padded = pad_sequence_dim(_batch(), 4)
    assert padded["input_ids"].shape == (3, 8) and padded["topk"].shape == (3, 8, 2)
    assert padded["token_mask"][:, 5:].sum() == 0
    assert padded["input_lengths"].shape == (3,) and padded["names"] == ["a", "b", "c"]
    assert pad_sequence_dim(_batch(), 5)["input_ids"].shape == (3, 5)
    trimmed = trim_sequence_dim(padded, 4)
    assert trimmed["token_mask"].shape == (3, 4) and trimmed["topk"].shape == (3, 4, 2)
    assert trimmed["sample_mask"].shape == (3,)


def test_global_valid_counts_follow_the_loss_convention() -> None:
    num_seqs, num_toks = global_valid_counts(_batch())
    assert float(num_seqs) == 2.0
    assert float(num_toks) == 8.0  # positions 1..4 of the two unmasked rows
    batch = _batch()
    del batch["token_mask"]
    with pytest.raises(KeyError, match="token_mask"):
        global_valid_counts(batch)


def test_token_budget_parts_respect_the_budget_and_cover_every_row() -> None:
    lengths = [9, 3, 17, 5, 5, 12, 1, 30]
    parts = token_budget_parts(lengths, max_tokens=32, round_to=4)
    assert sorted(row for part in parts for row in part) == list(range(len(lengths)))
    for part in parts:
        longest = max(-(-lengths[r] // 4) * 4 for r in part)
        assert len(part) * longest <= 32 or len(part) == 1
    assert parts[0] == [7]  # 30 tokens -> 32 padded: alone
    split = split_parts(parts, len(parts) + 2)
    assert len(split) == len(parts) + 2
    assert sorted(row for part in split for row in part) == list(range(len(lengths)))
    with pytest.raises(ValueError, match="cannot split"):
        split_parts([[0], [1]], 3)
    assert fixed_size_parts(5, 2) == [[0, 1], [2, 3], [4]]


def test_packing_parts_respect_the_budget_and_cover_every_row() -> None:
    lengths = [9, 3, 17, 5, 5, 12, 1, 30]
    for in_order in (False, True):
        parts = packing_parts(lengths, max_tokens=20, in_order=in_order)
        assert sorted(row for part in parts for row in part) == list(range(len(lengths)))
        for part in parts:
            assert sum(lengths[r] for r in part) <= 20 or len(part) == 1
    # Longest first, each into the first pack with room: 30 | 17 3 | 12 5 1 | 9 5.
    assert packing_parts(lengths, 20, in_order=False) == [[7], [2, 1], [5, 3, 6], [0, 4]]
    assert packing_parts(lengths, 20, in_order=True) == [[0, 1], [2], [3, 4], [5, 6], [7]]


def test_packed_forward_equals_the_padded_forward() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(config).eval()
    lengths_B = torch.tensor([5, 9, 1, 7])
    ids_BT = torch.randint(1, 32, (4, 9)) * (torch.arange(9)[None, :] < lengths_B[:, None])
    packed = PackedRows.pack(ids_BT, lengths_B, multiple=8)
    assert packed.input_ids_1L.shape == (1, 24)  # 22 tokens rounded up to 24
    with torch.no_grad():
        padded_BTV = model(input_ids=ids_BT).logits
        # Without a KV cache: Hugging Face only keeps attention within each packed sequence when there is none.
        unpacked_BTV = packed.unpack(
            model(input_ids=packed.input_ids_1L, position_ids=packed.position_ids_1L, use_cache=False).logits
        )
    valid_BT = packed.valid_BT
    torch.testing.assert_close(unpacked_BTV[valid_BT], padded_BTV[valid_BT], rtol=1e-5, atol=1e-5)
    assert (unpacked_BTV[~valid_BT] == 0).all()


def test_metric_shares_sum_and_extremes_reduce() -> None:
    shares = [{"loss": 1.0, "lp_min": -3.0, "lp_max": 1.0}, {"loss": 2.0, "lp_min": -5.0, "lp_max": 0.5}]
    grouped = group_metrics([*shares, {"loss": 0.5}])
    assert grouped == {"loss": [1.0, 2.0, 0.5], "lp_min": [-3.0, -5.0], "lp_max": [1.0, 0.5]}
    assert reduce_metrics(grouped) == {"loss": 3.5, "lp_min": -5.0, "lp_max": 1.0}
    assert reduce_metrics(grouped, "mean") == {"loss": 3.5 / 3, "lp_min": -5.0, "lp_max": 1.0}
    assert reduce_metrics({"loss": [], "x_max": [2.0]}) == {"x_max": 2.0}
    assert [metric_reduction(n) for n in ("a_min", "a_max", "a", "a_min/b")] == ["min", "max", "sum", "sum"]


def test_warmup_then_constant_schedule() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = build_optimizer([param], OptimizerConfig(name="torch.optim.SGD", kwargs={"lr": 1.0}))
    scheduler = build_scheduler(
        optimizer,
        [
            SchedulerEntry(
                name="torch.optim.lr_scheduler.LinearLR",
                kwargs={"start_factor": 0.25, "end_factor": 1.0, "total_iters": 3},
            ),
            SchedulerEntry(
                name="torch.optim.lr_scheduler.ConstantLR", kwargs={"factor": 1.0, "total_iters": 1}
            ),
            SchedulerMilestones(milestones=[3]),
        ],
    )
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    constant = build_scheduler(optimizer, [])
    optimizer.step()
    constant.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1.0)


def test_fused_adamw_of_the_tiny_recipe_takes_the_loop_step_up_to_rounding() -> None:
    """grpo_math_tiny.yaml picks PyTorch's fused AdamW: the same steps as the default loop to float32 rounding."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    stepped = []
    for kwargs in ({"foreach": False, "fused": False}, {"foreach": False, "fused": True}):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = build_optimizer(
            params,
            OptimizerConfig(name="torch.optim.AdamW", kwargs={"lr": 1e-3, "weight_decay": 0.01, **kwargs}),
        )
        for step_grads in grads:
            for param, grad in zip(params, step_grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
        stepped.append([p.detach() for p in params])
    for loop, fused in zip(*stepped, strict=True):
        torch.testing.assert_close(fused, loop, rtol=1e-6, atol=1e-7)


def test_bad_class_paths_are_clear_errors() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"not a torch\.optim\.Optimizer"):
        build_optimizer([param], OptimizerConfig(name="torch.nn.Linear"))
    with pytest.raises(ValueError, match="has no attribute"):
        import_by_path("torch.optim.NoSuchOptimizer")
    optimizer = torch.optim.SGD([param], lr=1.0)
    with pytest.raises(ValueError, match="not a torch LRScheduler"):
        build_scheduler(optimizer, [SchedulerEntry(name="torch.optim.SGD")])


def test_clip_grad_norm_matches_torch_and_reports_the_norm_before_clipping() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    norm = clip_grad_norm_(params, max_norm=0.5)
    expected = torch.nn.utils.clip_grad_norm_(twins, max_norm=0.5)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_grad_norm_sums_over_fsdp_strided_shards_of_tensor_parallel_weights() -> None:
    """FSDP2 over a TP-sharded weight places it as ``(_StridedShard, Shard)``: both mesh dims split it."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from nemo_rl.models.policy.optim import _shard_mesh_dims

    def dims(*placements: Any) -> list[int]:
        return _shard_mesh_dims(SimpleNamespace(placements=placements))  # type: ignore[arg-type]

    assert dims(_StridedShard(0, split_factor=2), Shard(0)) == [0, 1]
    assert dims(Shard(0), Replicate()) == [0]


class _OneRankMesh:
    def size(self) -> int:
        return 1


def test_sequence_parallel_without_tp_is_rejected() -> None:
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_parallel_size > 1"):
        apply_tensor_parallel(torch.nn.Linear(2, 2), _OneRankMesh(), True, None)  # type: ignore[arg-type]


def test_sequence_packing_applies_where_it_can() -> None:
    def cfg(**overrides: Any) -> PolicyConfig:
        return PolicyConfig.model_validate(
            {"model_name": "unused", "sequence_packing": {"enabled": True}, **overrides}
        )

    with pytest.raises(ValueError, match="pick one"):
        cfg(dynamic_batching={"enabled": True})
    assert cfg().packs_sequences
    # NeMo RL's recipes enable packing for every backend: sequence parallelism and Bradley-Terry reward models
    # pad instead; a value model reads every token, so its rows pack.
    assert not cfg(dtensor_cfg={"tensor_parallel_size": 2, "sequence_parallel": True}).packs_sequences
    assert not cfg(reward_model_cfg={"enabled": True}).packs_sequences
    assert cfg(reward_model_cfg={"enabled": True, "reward_model_type": "regression"}).packs_sequences
    # Packs are token budgets: the global batch need not be a multiple of the micro-batch size.
    assert cfg(train_global_batch_size=10, train_micro_batch_size=4).packs_sequences


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cpu_offload_without_cuda_is_rejected() -> None:
    cfg = PolicyConfig(model_name="unused", dtensor_cfg={"cpu_offload": True})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_offload=false"):
        DTensorPolicyWorker(cfg)


def test_megatron_backend_without_megatron_core_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        lm_policy.importlib.util,
        "find_spec",
        lambda name: None if name.startswith("megatron") else find_spec(name),
    )
    cfg = PolicyConfig(
        model_name="unused",
        optimizer=None,
        dtensor_cfg={"enabled": False},  # type: ignore[arg-type]
        megatron_cfg={"enabled": True},  # type: ignore[arg-type]
    )
    with pytest.raises(UserError, match="--extra mcore"):
        lm_policy._worker_backend(cfg)


def test_frozen_parameters_are_checked_before_any_worker_starts() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.mlp.weight",
        "model.layers.1.mlp.weight",
        "score.weight",
    ]
    assert frozen_names(names, ["model.embed_tokens.*", "model.layers.[0].*"]) == set(names[:2])
    with pytest.raises(UserError, match=re.escape("'model.layer.*' matches no parameter")):
        frozen_names(names, ["model.layer.*"])
    with pytest.raises(UserError, match="freezes every parameter"):
        frozen_names(names, ["*"])
    # The driver builds the model on the meta device (layers grown by hf_config_overrides included).
    grown = PolicyConfig(
        model_name="examples/assets/tiny_math_teacher",
        reward_model_cfg={"enabled": True},  # type: ignore[arg-type]
        hf_config_overrides={"num_hidden_layers": 5, "layer_types": ["full_attention"] * 5},
        frozen_parameters=["model.layers.4.*"],
    )
    lm_policy.check_policy_layout(grown, world_size=1)
    with pytest.raises(UserError, match=re.escape("'model.layers.5.*' matches no parameter")):
        lm_policy.check_policy_layout(grown.model_copy(update={"frozen_parameters": ["model.layers.5.*"]}), 1)
    with pytest.raises(ValueError, match="DTensor backend only"):
        PolicyConfig(
            model_name="unused",
            optimizer=None,
            dtensor_cfg={"enabled": False},  # type: ignore[arg-type]
            megatron_cfg={"enabled": True},  # type: ignore[arg-type]
            frozen_parameters=["model.layers.0.*"],
        )


def test_policy_implements_the_interface() -> None:
    # mypy checks this assignment structurally; the loop checks the methods exist at run time.
    policy_cls: type[PolicyInterface] = lm_policy.Policy
    for name in dir(PolicyInterface):
        if not name.startswith("_"):
            assert callable(getattr(policy_cls, name)), name
            assert callable(getattr(DTensorPolicyWorker, name)), name


def test_expert_parallel_size_must_divide_the_data_parallel_ranks() -> None:
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    cfg = PolicyConfig.model_validate(
        {
            "model_name": "examples/assets/tiny_qwen3_moe_init",
            "optimizer": None,
            "train_global_batch_size": 4,
            "dtensor_cfg": {"enabled": False},
            "megatron_cfg": {"enabled": True, "expert_model_parallel_size": 4},
        }
    )
    assert lm_policy.check_policy_layout(cfg, world_size=4) == 4
    with pytest.raises(
        UserError, match="expert_model_parallel_size=4 does not divide the policy's 2 data-parallel"
    ):
        lm_policy.check_policy_layout(cfg, world_size=2)
