"""DPO end to end on the tiny arithmetic checkpoint, in this process, and both preference scripts' errors.

The DPO loop runs on the session's Ray (``ray_cluster``) with three small steps: the held-out preference loss
falls, the last checkpoint records the final validation loss, and the export loads with ``transformers``;
rerun after losing its last checkpoint, it resumes and repeats step 3 bit for bit. A second run does the same
on the Megatron backend in two pipeline stages.
Reward-model training runs the same loop (``nemo_rl.algorithms.preference``) with another loss and head; the
worker's reward head, its parity over layouts, its resume (bit for bit) and its export's scores are tested in
``tests/distributed/test_dtensor_worker.py``. The scripts' command-line failures (exit 2, one line, no
traceback) are checked without starting anything.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.master import DPOMasterConfig, RMMasterConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
TINY_SFT = ROOT / "examples" / "assets" / "tiny_math_sft"


def _overrides(tmp: Path, algo: str, name: str, max_steps: int, lr: float) -> list[str]:
    # 32 pairs a step, constant learning rate, validation on 32 held-out pairs before and after training.
    return [
        f"policy.model_name={TINY_SFT}",
        f"{algo}.max_num_steps={max_steps}",
        f"{algo}.val_period=0",
        f"{algo}.val_at_start=true",
        f"{algo}.val_at_end=true",
        f"{algo}.val_global_batch_size=32",
        f"{algo}.val_micro_batch_size=16",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=16",
        f"policy.optimizer.kwargs.lr={lr}",
        "policy.scheduler=null",
        "data.num_train_samples=128",
        "data.num_val_samples=32",
        "checkpointing.save_period=2",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        f"logger.log_dir={tmp / name}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
    ]


def _metrics(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]


def _at(records: list[dict[str, Any]], step: int, key: str) -> float:
    values = [r[key] for r in records if r["step"] == step and key in r]
    assert values, f"no {key} logged at step {step}"
    return float(values[-1])


def _step_values(records: list[dict[str, Any]], step: int) -> dict[str, float]:
    """Everything ``step`` logged under ``train/`` and ``validation/`` (its timings differ between runs)."""
    return {
        key: value
        for record in records
        if record["step"] == step
        for key, value in record.items()
        if key.startswith(("train/", "validation/"))
    }


def _train(module: str, config: DPOMasterConfig | RMMasterConfig, keep: bool = False) -> Any:
    """Set up and run one algorithm (``nemo_rl.algorithms.<module>``); returns the run, still up with ``keep``."""
    from nemo_rl.data.datasets import setup_preference_data
    from nemo_rl.models.tokenizer import get_policy_tokenizer

    algo = importlib.import_module(f"nemo_rl.algorithms.{module}")
    tokenizer = get_policy_tokenizer(config.policy)
    train, val = setup_preference_data(
        config.data, tokenizer, max_total_sequence_length=config.policy.max_total_sequence_length
    )
    run = algo.setup(config, tokenizer, train, val)
    try:
        getattr(algo, f"{module}_train")(run)
    finally:
        if not keep:
            run.shutdown()
    return run


def test_dpo_learns_and_exports(ray_cluster: dict[str, float], tmp_path: Path) -> None:
    def config(name: str) -> DPOMasterConfig:
        return load_and_validate(
            CONFIGS / "dpo_tiny_math.yaml", DPOMasterConfig, _overrides(tmp_path, "dpo", name, 3, lr=3e-5)
        )

    _train("dpo", config("first"))
    first = _metrics(tmp_path / "first")
    # Killed while saving step 3 (its checkpoint never got its name), then the same command again: the
    # resumed run's step 3 trains and validates bit for bit as the uninterrupted run's did.
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_3").rename(ckpt / "tmp_step_3")
    _train("dpo", config("first"))
    resumed = _metrics(tmp_path / "first")[len(first) :]
    assert resumed[0]["step"] == 3, "the rerun did not resume from step 2"
    assert _step_values(resumed, 3) == _step_values(first, 3) and len(_step_values(first, 3)) > 15
    # Held-out pairs: the preference loss falls and the chosen answers gain on the rejected ones.
    assert _at(first, 3, "validation/preference_loss") < _at(first, 0, "validation/preference_loss")
    margin = [
        _at(first, s, "validation/rewards_chosen_mean") - _at(first, s, "validation/rewards_rejected_mean")
        for s in (0, 3)
    ]
    assert margin[0] == pytest.approx(0.0, abs=1e-6) and margin[1] > 0, margin  # step 0: policy == reference
    for key in ("train/loss", "train/sft_loss", "train/preference_loss", "train/accuracy", "train/grad_norm"):
        assert key in next(r for r in first if r["step"] == 1 and key in r)
    # The last step's checkpoint carries the final validation loss, and the export loads in transformers.
    info = json.loads((tmp_path / "ckpt" / "step_3" / "training_info.json").read_text())
    assert info["step"] == 3 and info["val_loss"] == pytest.approx(_at(first, 3, "validation/loss"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf_final")


@pytest.mark.mcore
def test_dpo_on_megatron_pipeline_learns_and_exports(ray_cluster: dict[str, float], tmp_path: Path) -> None:
    # The same run on the Megatron backend, the model in two pipeline stages (chosen and rejected rows of a
    # pair travel together through the schedule), with Megatron's Adam at the same learning rate.
    pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
    overrides = _overrides(tmp_path, "dpo", "megatron", 3, lr=3e-5)
    overrides.remove("policy.optimizer.kwargs.lr=3e-05")
    config = load_and_validate(
        CONFIGS / "dpo_tiny_math.yaml",
        DPOMasterConfig,
        [
            *overrides,
            "policy.optimizer=null",
            "policy.dtensor_cfg.enabled=false",
            "policy.megatron_cfg.enabled=true",
            "policy.megatron_cfg.pipeline_model_parallel_size=2",
            "policy.megatron_cfg.optimizer.lr=3e-5",
            "policy.megatron_cfg.optimizer.min_lr=3e-5",
            "policy.megatron_cfg.optimizer.weight_decay=0.0",
            "cluster.gpus_per_node=2",
        ],
    )
    _train("dpo", config)
    records = _metrics(tmp_path / "megatron")
    assert _at(records, 3, "validation/preference_loss") < _at(records, 0, "validation/preference_loss")
    margin = _at(records, 3, "validation/rewards_chosen_mean") - _at(
        records, 3, "validation/rewards_rejected_mean"
    )
    assert margin > 0
    # Each stage wrote its own layers; together they load in transformers.
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf_final")


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["run_dpo", "run_rm"])
def test_scripts_fail_with_one_line_on_bad_input(
    script: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = CONFIGS / ("dpo_tiny_math.yaml" if script == "run_dpo" else "rm_tiny_math.yaml")
    bad_rows = tmp_path / "pairs.jsonl"
    bad_rows.write_text(
        json.dumps({"prompt": "What is 1+1?", "chosen": "2", "rejected": "3"})
        + "\n"
        + json.dumps({"prompt": "What is 2+2?", "chosen": "4"})
        + "\n"
    )
    # rm_tiny_math.yaml draws several wrong answers per tiny_math problem, a key only that dataset takes.
    preference_files = [
        "data.dataset_name=binary_preference",
        "data.val_data_path=null",
        "data.tiny_math_rejected_per_problem=1",
    ]
    missing = tmp_path / "missing.jsonl"
    cases: list[tuple[list[str], list[str]]] = [
        (["policy.no_such_key=1"], ["policy.no_such_key"]),
        ([*preference_files, f"data.train_data_path={missing}"], [str(missing)]),
        ([*preference_files, f"data.train_data_path={bad_rows}"], [str(bad_rows), "row 1", "'rejected'"]),
    ]
    module = _script(script)
    for overrides, expected in cases:
        monkeypatch.setattr(sys, "argv", [f"{script}.py", "--config", str(config), *overrides])
        with pytest.raises(SystemExit) as exit_info:
            module.run_cli(module.main)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, err
        assert all(part in err for part in expected), (expected, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
