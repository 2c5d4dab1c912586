"""Context parallelism's layout arithmetic, what the config refuses with it, and how ``--dry-run`` plans it.
``tests/distributed/test_context_parallel.py`` checks the numerics against CP=1 on two gloo ranks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_memory_plan_dry_run import dry_run

from nemo_rl.config.cli import USER_ERROR_EXIT_CODE, parse_args_and_load, run_cli
from nemo_rl.config.dtensor import DTensorConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import GRPOMasterConfig, SFTMasterConfig
from nemo_rl.config.megatron import MegatronConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.models.policy.context_parallel import (
    allowed_keys,
    chunk_indices,
    document_ids,
    gathered_order,
    sequence_multiple,
)
from nemo_rl.models.policy.lm_policy import check_policy_layout


def test_each_rank_holds_one_early_and_one_late_chunk() -> None:
    assert chunk_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    # Equal causal work: the (query, key) pairs under the mask each rank computes.
    for cp in (2, 4):
        work = [sum(int(i) + 1 for i in chunk_indices(8 * cp, cp, r)) for r in range(cp)]
        assert len(set(work)) == 1, work


def test_gathered_order_inverts_the_split() -> None:
    row = torch.arange(100, 124)
    for cp in (1, 2, 3):
        gathered = torch.cat([row[chunk_indices(24, cp, r)] for r in range(cp)])
        assert torch.equal(gathered[gathered_order(24, cp)], row)


def test_a_row_that_does_not_split_evenly_is_refused() -> None:
    with pytest.raises(ValueError, match="make_sequence_length_divisible_by"):
        chunk_indices(10, 2, 0)


def test_documents_start_where_positions_restart() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3]]


def test_allowed_keys_is_the_causal_mask_within_documents() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    document = document_ids(positions)
    full = torch.ones(8, 8).tril().bool() & (document[0, :, None] == document[0, None, :])
    for chunk in range(4):
        mask = allowed_keys(chunk, 2, document, torch.device("cpu"))[0, 0]
        assert torch.equal(mask, full[2 * chunk : 2 * chunk + 2, : 2 * chunk + 2])
    plain = allowed_keys(1, 2, None, torch.device("cpu"))[0, 0]
    assert torch.equal(plain, torch.ones(4, 4).tril().bool()[2:])


def test_sequence_multiple_follows_nemo_rl() -> None:
    def multiple(divisible_by: int, **dtensor: Any) -> int:
        return sequence_multiple(divisible_by, DTensorConfig.model_validate(dtensor))

    assert multiple(1) == 1
    assert multiple(1, context_parallel_size=2) == 4
    assert multiple(6, context_parallel_size=2) == 12
    assert multiple(1, tensor_parallel_size=2, sequence_parallel=True) == 2
    # Sequence parallelism splits each CP rank's T / CP tokens over the TP ranks.
    assert multiple(1, context_parallel_size=2, tensor_parallel_size=2) == 4
    assert multiple(1, context_parallel_size=2, tensor_parallel_size=4, sequence_parallel=True) == 8


def _policy(tmp_path: Path, model_type: str = "qwen2", **extra: Any) -> dict[str, Any]:
    model = tmp_path / model_type
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": model_type}))
    dtensor = {"context_parallel_size": 2} | extra.pop("dtensor_cfg", {})
    return {
        "model_name": str(model),
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "max_total_sequence_length": 64,
        "make_sequence_length_divisible_by": 4,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
        "dtensor_cfg": dtensor,
        **extra,
    }


def test_cp2_validates(tmp_path: Path) -> None:
    assert PolicyConfig.model_validate(_policy(tmp_path)).dtensor_cfg.context_parallel_size == 2


@pytest.mark.parametrize(
    ("model_type", "dtensor"),
    [
        ("qwen2", {"tensor_parallel_size": 2}),
        ("qwen2", {"tensor_parallel_size": 2, "sequence_parallel": True}),
        ("qwen3_moe", {}),
    ],
)
def test_cp2_combines_with_tp_sp_and_moe(tmp_path: Path, model_type: str, dtensor: dict[str, Any]) -> None:
    cfg = PolicyConfig.model_validate(_policy(tmp_path, model_type, dtensor_cfg=dtensor))
    assert cfg.dtensor_cfg.context_parallel_size == 2


@pytest.mark.parametrize(
    ("overrides", "model_type", "reason"),
    [
        ({"make_sequence_length_divisible_by": 2}, "qwen2", "not a multiple of 4"),
        (
            {"dtensor_cfg": {"tensor_parallel_size": 4, "sequence_parallel": True}},
            "qwen2",
            "over tensor_parallel_size=4, but policy.make_sequence_length_divisible_by=4 is not a multiple of 8",
        ),
        ({"shared_prefix": {"enabled": True}}, "qwen2", "shared-prompt forward"),
        ({"reward_model_cfg": {"enabled": True}}, "qwen2", "Bradley-Terry"),
        ({"dtensor_cfg": {"data_parallel_mode": "replicate"}}, "qwen2", "context_parallel_size=1"),
    ],
)
def test_unbuilt_combinations_are_refused_in_one_line(
    tmp_path: Path, overrides: dict[str, Any], model_type: str, reason: str
) -> None:
    with pytest.raises(ValueError, match="context_parallel_size") as info:
        PolicyConfig.model_validate(_policy(tmp_path, model_type, **overrides))
    assert reason in str(info.value)


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="Megatron's context parallelism is built where Transformer Engine is installed",
)
def test_megatron_cp_is_refused_with_its_reason() -> None:
    with pytest.raises(ValueError, match="Transformer Engine"):
        MegatronConfig.model_validate({"enabled": True, "context_parallel_size": 2})


_CP2 = ("policy.dtensor_cfg.context_parallel_size=2", "policy.make_sequence_length_divisible_by=4")


def test_dry_run_plans_cp2_with_half_the_activations(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    two = ("cluster.gpus_per_node=2", "cluster.device_memory_gb=80")
    code, cp1, _ = dry_run(monkeypatch, capsys, *two, "policy.make_sequence_length_divisible_by=4")
    assert code == 0, cp1
    code, cp2, _ = dry_run(monkeypatch, capsys, *two, *_CP2)
    assert code == 0, cp2

    def term(out: str, name: str) -> float:
        [line] = [line for line in out.splitlines() if line.strip().startswith(name)]
        return float(line.split()[-2])

    assert term(cp2, "activations") == pytest.approx(term(cp1, "activations") / 2, rel=0.02)
    assert term(cp2, "logits spike") == term(cp1, "logits spike")
    assert term(cp2, "CP keys/values and masks") > 0


def test_cp_that_does_not_divide_the_workers_is_a_user_error(tmp_path: Path) -> None:
    """The setups check the layout before starting Ray; a UserError exits the script with status 2."""
    cfg = PolicyConfig.model_validate(_policy(tmp_path))
    assert check_policy_layout(cfg, 4) == 2
    with pytest.raises(
        UserError, match=r"3 workers, which is not a multiple of its model-parallel size \(2\)"
    ):
        check_policy_layout(cfg, 3)


NEMO_RL_RECIPES = Path(__file__).resolve().parents[1] / "data" / "nemo_rl_recipes" / "main"
CP_RECIPE = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_tiny_long_cp.yaml"


def test_dry_run_plans_nemo_rl_grpo_recipe_with_cp2(capsys: pytest.CaptureFixture[str]) -> None:
    """NeMo RL's own recipe with its DTensor policy split over two CP ranks: planned, not refused."""
    args = [
        "--dry-run",
        "policy.dtensor_cfg.context_parallel_size=2",
        "policy.make_sequence_length_divisible_by=4",
        "cluster.device_memory_gb=80",
    ]
    with pytest.raises(SystemExit) as info:
        parse_args_and_load(GRPOMasterConfig, NEMO_RL_RECIPES / "grpo_math_1B.yaml", args)
    out = capsys.readouterr().out
    assert info.value.code == 0, out
    assert "context_parallel_size: 2" in out and "CP keys/values and masks" in out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("policy.make_sequence_length_divisible_by=6", "is not a multiple of 4: set it to one"),
        ("cluster.gpus_per_node=3", "3 workers, which is not a multiple of its model-parallel size (2)"),
    ],
)
def test_a_cp_layout_that_does_not_divide_exits_2_with_one_line(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a script does with the CP recipe: the config is validated, then the setup checks the layout on the
    cluster's slots (before Ray starts); either mistake ends the run with status 2 and one line naming it (a
    config error's line under the line naming the config and its overrides)."""

    def main() -> None:
        cfg, _ = parse_args_and_load(SFTMasterConfig, CP_RECIPE, [override])
        check_policy_layout(cfg.policy, cfg.cluster.world_size)

    with pytest.raises(SystemExit) as info:
        run_cli(main)
    assert info.value.code == USER_ERROR_EXIT_CODE
    *header, line = capsys.readouterr().err.strip().splitlines()
    assert message in line
    assert len(header) <= 1 and "Traceback" not in "".join(header)


def test_the_long_documents_are_what_their_script_writes() -> None:
    """The long-document recipe's data file is the generator's output, every row long and under 8,192 tokens."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "data"
    spec = importlib.util.spec_from_file_location("make_tiny_long_docs", examples / "make_tiny_long_docs.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = [json.loads(line) for line in (examples / "tiny_long_docs_sft.jsonl").read_text().splitlines()]
    assert rows == script.documents(script.NUM_DOCS, script.SEED)
    lengths = [len(row["messages"][1]["content"]) for row in rows]
    assert min(lengths) > 6900 and max(lengths) <= script.MAX_CHARS < 8192 - 64
