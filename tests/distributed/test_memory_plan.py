"""The memory plan (``nemo_rl.config.memory_plan``) against what the policy workers allocate, over gloo.

Two spawned ranks build, for the tiny asset model (0.8M parameters) and a ~27M-parameter Qwen2, a DTensor
worker with FSDP over DP=2, one with TP=2 and a Megatron worker with PP=2, all with dynamic batching; and a
LoRA DTensor worker at DP=2 on the tiny model. After one training step each rank counts the bytes of its
parameters, gradients and optimizer state (what the plan's weights, gradients, optimizer and LoRA terms
predict exactly), and the DTensor ranks run a second step under torch's profiler: the memory held when the
backward pass starts, less the logits and their log-softmax, is the measured activation peak that the plan's
activation term must match within 25%.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_groups import SaveFn, load, run_groups
from transformers import Qwen2Config, Qwen2ForCausalLM

from nemo_rl.algorithms.loss_functions import NLLLoss
from nemo_rl.config.memory_plan import megatron_stage_terms, policy_train_terms
from nemo_rl.config.model_arch import resolve_arch
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

WORLD_SIZE = 2
ROWS = 4
SEQ_LEN = 32
SPAWN_TIMEOUT_S = 300.0
TINY = Path(__file__).parents[2] / "examples/assets/tiny_qwen2_init"
STATE_TERMS = ("weights", "gradients", "optimizer", "LoRA")
LAYOUTS = ("dtensor_dp2", "dtensor_tp2", "megatron_pp2")
ACTIVATION_TOLERANCE = 0.25


def build_mid_model(path: Path) -> None:
    """A random 27M-parameter Qwen2 (8 layers of width 512, 4096 tokens) with the tiny asset's tokenizer."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY / name, path / name)


def policy_cfg(model_dir: Path, layout: str, lora: bool = False) -> PolicyConfig:
    """fp32, AdamW, one micro-batch per rank and step (the token budget is each rank's whole shard)."""
    rows_per_rank = ROWS // 2 if layout == "dtensor_dp2" else ROWS
    dynamic = {"enabled": True, "train_mb_tokens": rows_per_rank * SEQ_LEN, "sequence_length_round": 4}
    cfg: dict[str, Any] = {
        "model_name": str(model_dir),
        "train_global_batch_size": ROWS,
        "train_micro_batch_size": 2,
        "max_total_sequence_length": SEQ_LEN,
        "dynamic_batching": dynamic,
    }
    if layout == "megatron_pp2":
        megatron = {"enabled": True, "pipeline_model_parallel_size": 2, "transformer_impl": "local"}
        cfg |= {
            "optimizer": None,
            "scheduler": None,
            "dtensor_cfg": {"enabled": False},
            "megatron_cfg": megatron,
        }
    else:
        tp = 2 if layout == "dtensor_tp2" else 1
        cfg["dtensor_cfg"] = {"tensor_parallel_size": tp, "lora_cfg": {"enabled": lora, "dim": 4}}
    return PolicyConfig.model_validate(cfg)


def batch(vocab: int) -> BatchedDataDict[Any]:
    """ROWS full-length random sequences (so every micro-batch is exactly its token budget)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (ROWS, SEQ_LEN), generator=g)
    token_mask = torch.ones(ROWS, SEQ_LEN)
    token_mask[:, :3] = 0.0
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.full((ROWS,), SEQ_LEN),
            "token_mask": token_mask,
            "sample_mask": torch.ones(ROWS),
        }
    )


# -------------------------------------------------------------------------------- spawned measurement
def _local_bytes(tensor: torch.Tensor | None) -> int:
    from torch.distributed.tensor import DTensor

    if tensor is None:
        return 0
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _optimizer_bytes(optimizers: list[Any]) -> int:
    return sum(
        _local_bytes(value)
        for optimizer in optimizers
        for state in optimizer.state.values()
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key != "step"
    )


def _dtensor_state_bytes(worker: Any) -> dict[str, int]:
    params = list(worker.model.named_parameters())
    adapters = [p for name, p in params if ".lora_" in name]
    return {
        "weights": sum(_local_bytes(p) for name, p in params if ".lora_" not in name),
        "trained": sum(_local_bytes(p.grad) for _, p in params) + _optimizer_bytes([worker.optimizer]),
        "adapters": sum(_local_bytes(p) for p in adapters),
    }


def _megatron_state_bytes(worker: Any) -> dict[str, int]:
    params = list(worker.model.parameters())
    parts = getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
    return {
        "weights": sum(_local_bytes(p) for p in params),
        "trained": sum(_local_bytes(p.main_grad) for p in params)
        + _optimizer_bytes([p.optimizer for p in parts]),
        "adapters": 0,
    }


def _held_at_backward(worker: Any, data: BatchedDataDict[Any], vocab: int) -> int:
    """Bytes allocated from the start of a training step until its backward pass starts, less the logits and
    their float32 log-softmax: the activations the forward keeps (torch's profiler, CPU memory events)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.profiler import ProfilerActivity, profile

    worker.optimizer.zero_grad(set_to_none=True)
    for module in worker.model.modules():
        if isinstance(module, FSDPModule):
            module.unshard()  # gathered weights are not activations: gather them before measuring
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        worker.train(data, NLLLoss())
    events = list(prof.profiler.kineto_results.events())
    backward = min(e.start_ns() for e in events if e.name().startswith("autograd::engine::evaluate_function"))
    held = sum(e.nbytes() for e in events if e.name() == "[memory]" and e.start_ns() < backward)
    tokens = data["input_ids"].numel()
    return held - 2 * tokens * vocab * 4


def _measure(save: SaveFn, model_dirs: dict[str, str], out_dir: Path) -> None:
    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker
    from nemo_rl.models.policy.megatron_worker import MegatronPolicyWorker

    results: dict[str, Any] = {}
    runs = [(model, layout, False) for model in model_dirs for layout in LAYOUTS] + [
        ("tiny", "dtensor_dp2", True)
    ]
    for model, layout, lora in runs:
        cfg = policy_cfg(Path(model_dirs[model]), layout, lora)
        vocab = 104 if model == "tiny" else 4096
        data = batch(vocab)
        worker_cls = MegatronPolicyWorker if layout == "megatron_pp2" else DTensorPolicyWorker
        worker = worker_cls(cfg, init_reference_model=False)
        shard = data.shard_by_batch_size(worker.dp_size, batch_size=ROWS)[worker.dp_rank]
        worker.train(shard, NLLLoss())
        key = f"{model}_{layout}{'_lora' if lora else ''}"
        if layout == "megatron_pp2":
            results[key] = _megatron_state_bytes(worker)
        else:
            results[key] = _dtensor_state_bytes(worker)
            if not lora:
                results[key]["activations"] = _held_at_backward(worker, shard, vocab)
        worker.shutdown()
    save("results", results)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    mid = tmp_path_factory.mktemp("qwen2_27m")
    build_mid_model(mid)
    return {"tiny": str(TINY), "mid": str(mid)}


@pytest.fixture(scope="module")
def measured(model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
    out_dir = tmp_path_factory.mktemp("memory_plan_results")
    run_groups([("memory", WORLD_SIZE, _measure)], model_dirs, out_dir, timeout_s=SPAWN_TIMEOUT_S)
    return [load(out_dir, "memory.results", rank) for rank in range(WORLD_SIZE)]


def planned(model_dir: str, layout: str, lora: bool, rank: int) -> dict[str, int]:
    """The plan's terms for ``rank``, grouped as the measurement counts them."""
    cfg = policy_cfg(Path(model_dir), layout, lora)
    arch, _ = resolve_arch(model_dir)
    assert arch is not None
    if layout == "megatron_pp2":
        terms = megatron_stage_terms(arch, cfg, WORLD_SIZE, stage=rank)
    else:
        terms = policy_train_terms(arch, cfg, WORLD_SIZE)
    by_name = {t.name.split(" ")[0]: t.nbytes for t in terms}
    return {
        "weights": by_name["weights"],
        "trained": by_name["gradients"] + by_name["optimizer"],
        "adapters": by_name.get("LoRA", 0) // 4,  # the adapters' weights: a quarter of weights + grads + Adam
        "activations": by_name["activations"],
    }


@pytest.mark.parametrize("model", ["tiny", "mid"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_weights_gradients_and_optimizer_state_are_what_the_workers_allocate(
    measured: list[dict[str, Any]], model_dirs: dict[str, str], model: str, layout: str
) -> None:
    for rank in range(WORLD_SIZE):
        got = measured[rank][f"{model}_{layout}"]
        plan = planned(model_dirs[model], layout, False, rank)
        if layout == "megatron_pp2":  # each rank is its own stage
            assert (got["weights"], got["trained"]) == (plan["weights"], plan["trained"]), rank
        else:  # the plan is rank 0's, the most loaded rank
            assert (got["weights"], got["trained"]) <= (plan["weights"], plan["trained"]), rank
            if rank == 0:
                assert (got["weights"], got["trained"]) == (plan["weights"], plan["trained"])


def test_lora_adapters_are_what_the_workers_allocate(
    measured: list[dict[str, Any]], model_dirs: dict[str, str]
) -> None:
    got = measured[0]["tiny_dtensor_dp2_lora"]
    plan = planned(model_dirs["tiny"], "dtensor_dp2", True, 0)
    assert got["weights"] == plan["weights"]
    assert got["trained"] == 3 * got["adapters"]  # gradients and two Adam moments of the adapters only
    assert got["adapters"] == plan["adapters"]


@pytest.mark.parametrize("model", ["tiny", "mid"])
@pytest.mark.parametrize("layout", ["dtensor_dp2", "dtensor_tp2"])
def test_activation_term_is_within_a_quarter_of_the_measured_peak(
    measured: list[dict[str, Any]], model_dirs: dict[str, str], model: str, layout: str
) -> None:
    got = measured[0][f"{model}_{layout}"]["activations"]
    plan = planned(model_dirs[model], layout, False, 0)["activations"]
    assert abs(plan - got) <= ACTIVATION_TOLERANCE * got, (plan, got)
