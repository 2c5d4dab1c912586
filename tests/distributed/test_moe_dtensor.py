"""The DTensor worker on the tiny MoE checkpoints over gloo: FSDP2 at dp=2 (the experts sharded like any
other weight) against a single-process ``transformers`` loop, with the router's load-balancing loss trained
on; log-probs of both families against ``transformers``' forward; the refit stream under Hugging Face names."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_groups import spawn_and_wait
from transformers import AutoModelForCausalLM

from nemo_rl.algorithms.interfaces import LossType
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import free_port

ASSETS = Path(__file__).resolve().parents[2] / "examples" / "assets"
WORLD_SIZE = 2
SEQ_LEN = 13
GLOBAL_BATCH = 8
NUM_STEPS = 3
LR = 1e-3
AUX_COEF = 0.05
SPAWN_TIMEOUT_S = 300.0


def asset(family: str) -> Path:
    return ASSETS / f"tiny_{family}_init"


def make_batch(seed: int, num_rows: int) -> BatchedDataDict[Any]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, SEQ_LEN + 1, (num_rows,), generator=g)
    positions = torch.arange(SEQ_LEN)[None, :]
    valid = positions < lengths[:, None]
    ids = torch.randint(3, 104, (num_rows, SEQ_LEN), generator=g) * valid
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": lengths,
            "token_mask": ((positions >= 2) & valid).float(),
            "sample_mask": torch.ones(num_rows),
        }
    )


class NLLLoss:
    """Token-level NLL, this micro-batch's share of the global loss."""

    loss_type = LossType.TOKEN_LEVEL
    rows_per_group = 1

    def __call__(
        self,
        logits_BTV: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        lp = torch.log_softmax(logits_BTV[:, :-1].float(), -1).gather(-1, data["input_ids"][:, 1:, None])[
            ..., 0
        ]
        mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        loss = -(lp * mask).sum() / global_valid_toks
        return loss, {"nll": float(loss.detach())}


def policy_cfg(family: str) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": str(asset(family)),
            "train_global_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size": GLOBAL_BATCH // WORLD_SIZE,
            "max_grad_norm": 1.0,
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": LR, "weight_decay": 0.0}},
            "hf_config_overrides": (
                {"output_router_logits": True, "router_aux_loss_coef": AUX_COEF}
                if family == "qwen3_moe"
                else {}
            ),
        }
    )


def _shards(data: BatchedDataDict[Any]) -> list[BatchedDataDict[Any]]:
    return data.shard_by_batch_size(WORLD_SIZE, batch_size=GLOBAL_BATCH)


def _scenarios(rank: int, out_dir: Path) -> None:
    from torch.distributed.tensor import DTensor

    from nemo_rl.models.policy.dtensor_worker import DTensorPolicyWorker

    def save(name: str, value: Any) -> None:
        torch.save(value, out_dir / f"{name}.rank{rank}.pt")

    score = make_batch(seed=2, num_rows=6)
    for family in ("qwen3_moe", "glm4_moe"):
        worker = DTensorPolicyWorker(policy_cfg(family), init_reference_model=False)
        experts = worker.model.get_parameter("model.layers.1.mlp.experts.gate_up_proj")
        save(f"{family}_experts_sharded", isinstance(experts, DTensor) and experts.to_local().shape[0] == 4)
        save(f"{family}_logprobs", worker.get_logprobs(score)["logprobs"])
        if family == "qwen3_moe":
            data = make_batch(seed=1, num_rows=GLOBAL_BATCH * NUM_STEPS)
            save("train", worker.train(_shards(data)[rank], NLLLoss()))
            save("manifest", worker.weights_manifest(torch.float32))
            save("trained_weights", {n: t.clone() for n, t in worker.iter_hf_weights(torch.float32)})
        worker.shutdown()


def _spawn_entry(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NEMO_RL_TORCH_THREADS="1",
    )
    try:
        _scenarios(rank, Path(out_dir))
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("moe_results")
    spawn_and_wait(_spawn_entry, (free_port(), str(out_dir)), WORLD_SIZE, SPAWN_TIMEOUT_S)
    return out_dir


def load(out_dir: Path, name: str, rank: int = 0) -> Any:
    return torch.load(out_dir / f"{name}.rank{rank}.pt", weights_only=False)


def hf_model(family: str, **overrides: Any) -> Any:
    return AutoModelForCausalLM.from_pretrained(asset(family), dtype=torch.float32, **overrides)


def hf_logprobs(model: Any, data: BatchedDataDict[Any]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    out = torch.zeros(data["input_ids"].shape)
    out[:, 1:] = lp
    return out * (torch.arange(SEQ_LEN)[None, :] < data["input_lengths"][:, None])


def reference_training() -> dict[str, Any]:
    """Plain transformers: each step the NLL of the global batch plus, per dp shard, transformers' own
    ``aux_loss`` (padding masked) times the coefficient and the shard's share of the loss tokens."""
    model = hf_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = make_batch(seed=1, num_rows=GLOBAL_BATCH * NUM_STEPS)
    rank_rows = _shards(data)
    losses, grad_norms, aux = [], [], []
    for step in range(NUM_STEPS):
        optimizer.zero_grad()
        shards = [s.slice(step * GLOBAL_BATCH // 2, (step + 1) * GLOBAL_BATCH // 2) for s in rank_rows]
        global_toks = sum(float((s["token_mask"][:, 1:] * s["sample_mask"][:, None]).sum()) for s in shards)
        total = torch.zeros(())
        step_aux = 0.0
        for shard in shards:
            valid = (torch.arange(SEQ_LEN)[None, :] < shard["input_lengths"][:, None]).long()
            out = model(input_ids=shard["input_ids"], attention_mask=valid)
            nll, _ = NLLLoss()(out.logits, shard, torch.tensor(0.0), torch.tensor(global_toks))
            share = float((shard["token_mask"][:, 1:]).sum()) / global_toks
            total = total + nll + AUX_COEF * share * out.aux_loss
            step_aux += share * float(out.aux_loss.detach())
        total.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        losses.append(float(total.detach()))
        aux.append(step_aux)
        optimizer.step()
    return {"losses": losses, "grad_norms": grad_norms, "aux": aux, "weights": model.state_dict()}


def test_no_rank_failed(results: Path) -> None:
    errors = [p.read_text() for p in results.glob("error.rank*.txt")]
    assert not errors, errors[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_logprobs_match_transformers_with_experts_sharded(results: Path, family: str) -> None:
    expected = hf_logprobs(hf_model(family), make_batch(seed=2, num_rows=6))
    for rank in range(WORLD_SIZE):
        assert load(results, f"{family}_experts_sharded", rank)
        got = load(results, f"{family}_logprobs", rank)
        diff = (got - expected).abs().max().item()
        print(f"{family} rank {rank}: max |logprob - transformers| = {diff:.2e}")
        assert diff <= 1e-5


def test_fsdp_training_with_aux_loss_matches_transformers(results: Path) -> None:
    ref = reference_training()
    got = load(results, "train")
    print("losses", got["loss"].tolist(), ref["losses"])
    print("grad norms", got["grad_norm"].tolist(), ref["grad_norms"])
    assert torch.allclose(got["loss"].double(), torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-5)
    assert torch.allclose(
        got["grad_norm"].double(), torch.tensor(ref["grad_norms"], dtype=torch.float64), rtol=1e-5
    )
    aux = got["metrics"]["moe_aux_loss"]
    assert aux == pytest.approx(ref["aux"], rel=1e-5)
    assert all(1.0 <= v <= 4.0 for v in got["metrics"]["moe_expert_load_layer1_max"])
    weights = load(results, "trained_weights")
    for name, tensor in ref["weights"].items():
        if name in weights:
            assert torch.allclose(weights[name], tensor, atol=1e-5), name


def test_refit_sends_hugging_face_names(results: Path) -> None:
    from nemo_rl.models.generation.embedded.model import DecoderLM

    manifest = load(results, "manifest")
    engine = DecoderLM.from_pretrained(asset("qwen3_moe"), dtype=torch.float32)
    assert set(engine.weights_manifest()) == set(manifest) - {"lm_head.weight"}
    assert engine.load_weights(load(results, "trained_weights").items()) == set(engine.weights_manifest())
