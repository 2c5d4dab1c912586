"""DPO and reward-model training end to end on the tiny arithmetic checkpoints, and both scripts' errors.

``run_dpo.py`` runs three small steps and is killed (SIGKILL) at a random moment after step 3 logged, then
rerun: it resumes from the step-2 checkpoint and repeats step 3 bit for bit; the held-out preference loss
falls, the last checkpoint records the final validation loss, and the export loads with ``transformers``.
``run_rm.py`` is killed and rerun the same way. DPO also runs in this process, on the session's Ray
(``ray_cluster``), on the Megatron backend in two pipeline stages. The reward-model worker's head, its parity
over layouts and its export's scores are tested in ``tests/distributed/test_dtensor_worker.py``. The scripts'
command-line failures (exit 2, one line, no traceback) are checked without starting anything.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from kill_resume import kill_and_resume, step_metrics
from run_logs import read_records

from nemo_rl.config.loader import load_and_validate
from nemo_rl.config.master import DPOMasterConfig, RMMasterConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
TINY_SFT = ROOT / "examples" / "assets" / "tiny_math_sft"


def _overrides(tmp: Path, algo: str, name: str, max_steps: int, lr: float) -> list[str]:
    # 32 pairs a step, constant learning rate, validation on 32 held-out pairs before and after training.
    return [
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
        # Both checkpoints stay (rm_tiny_math.yaml keeps one): a run killed after its last save resumes from
        # the one before when that save is lost.
        "checkpointing.keep_top_k=2",
        f"checkpointing.checkpoint_dir={tmp / 'ckpt'}",
        f"logger.log_dir={tmp / name}",
        "logger.progress_bar=false",
        "logger.console_enabled=false",
    ]


def _at(records: list[dict[str, Any]], step: int, key: str) -> float:
    values = [r[key] for r in records if r["step"] == step and key in r]
    assert values, f"no {key} logged at step {step}"
    return float(values[-1])


def _command(script: str, config: str, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "examples" / f"{script}.py"),
        "--config",
        str(CONFIGS / config),
        *overrides,
    ]


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


@pytest.mark.slow
def test_dpo_learns_resumes_after_kill_9_and_exports(tmp_path: Path) -> None:
    # run_dpo.py for three steps, killed (SIGKILL) at a random moment after step 3 logged its training metrics
    # (validating, saving or exporting), then the same command again: it resumes from the step-2 checkpoint
    # and repeats what the killed run logged of step 3 bit for bit.
    resumed = kill_and_resume(
        _command(
            "run_dpo",
            "dpo_tiny_math.yaml",
            [f"policy.model_name={TINY_SFT}", *_overrides(tmp_path, "dpo", "logs", 3, lr=3e-5)],
        ),
        log_dir=tmp_path / "logs",
        ckpt_dir=tmp_path / "ckpt",
        checkpoint_step=2,
        max_delay_s=3.0,
    )
    records = resumed.killed + resumed.rerun
    assert len(step_metrics(resumed.killed, 3)) >= 10
    # Held-out pairs: the preference loss falls and the chosen answers gain on the rejected ones.
    assert _at(records, 3, "validation/preference_loss") < _at(records, 0, "validation/preference_loss")
    margin = [
        _at(records, s, "validation/rewards_chosen_mean")
        - _at(records, s, "validation/rewards_rejected_mean")
        for s in (0, 3)
    ]
    assert margin[0] == pytest.approx(0.0, abs=1e-6) and margin[1] > 0, margin  # step 0: policy == reference
    for key in ("train/loss", "train/sft_loss", "train/preference_loss", "train/accuracy", "train/grad_norm"):
        assert key in next(r for r in records if r["step"] == 1 and key in r)
    # The last step's checkpoint carries the final validation loss, and the export loads in transformers.
    info = json.loads((tmp_path / "ckpt" / "step_3" / "training_info.json").read_text())
    assert info["step"] == 3 and info["val_loss"] == pytest.approx(_at(records, 3, "validation/loss"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf_final")


@pytest.mark.slow
def test_reward_model_resumes_after_kill_9_bit_exact(tmp_path: Path) -> None:
    # run_rm.py (the arithmetic teacher, frozen, with three fresh layers and a scalar head) killed and rerun
    # like DPO above: the new layers and the head start from seeded draws, so the checkpoint carries them.
    resumed = kill_and_resume(
        _command("run_rm", "rm_tiny_math.yaml", _overrides(tmp_path, "rm", "logs", 3, lr=1e-3)),
        log_dir=tmp_path / "logs",
        ckpt_dir=tmp_path / "ckpt",
        checkpoint_step=2,
        max_delay_s=3.0,
    )
    assert len(step_metrics(resumed.killed, 3)) >= 8
    assert "Reward-model training finished at step 3" in resumed.result.stdout


@pytest.mark.mcore
def test_dpo_on_megatron_pipeline_learns_and_exports(ray_cluster: dict[str, float], tmp_path: Path) -> None:
    # The same run on the Megatron backend, the model in two pipeline stages (chosen and rejected rows of a
    # pair travel together through the schedule), with Megatron's Adam at the same learning rate.
    pytest.importorskip("megatron.core", reason="needs megatron-core (uv sync --extra mcore)")
    overrides = [f"policy.model_name={TINY_SFT}", *_overrides(tmp_path, "dpo", "megatron", 3, lr=3e-5)]
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
    records = read_records(tmp_path / "megatron")
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
    # In this process, without Ray's background start: a data error then ends the run through run_script (run_cli), as
    # it does before that start (with the start under way the script exits at once instead, stopping Ray:
    # tests/faults/test_bad_input.py checks that in a process of its own).
    import nemo_rl.distributed.ray_start as ray_start

    monkeypatch.setattr(ray_start, "start_ray_in_background", lambda cluster_cfg=None: None)
    for overrides, expected in cases:
        monkeypatch.setattr(sys, "argv", [f"{script}.py", "--config", str(config), *overrides])
        with pytest.raises(SystemExit) as exit_info:
            module.run_script(module.main)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, err
        assert all(part in err for part in expected), (expected, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
