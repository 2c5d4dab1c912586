"""Failures that used to pass for success, or to surface as a worker's traceback, end the script with exit
status 2 and one line before Ray starts: an agent program that does not exist, LoRA targets that match no
layer of the model, and a resume whose LoRA settings differ from the checkpoint's own record. (A step whose
agents all fail at run time is tested at the rollout in tests/unit/test_agent_endpoint.py.)"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

import nemo_rl.algorithms.run_build as run_build
import nemo_rl.distributed.ray_start as ray_start
from nemo_rl.config import load_and_validate
from nemo_rl.config.errors import UserError
from nemo_rl.config.master import SFTMasterConfig
from nemo_rl.utils.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "examples" / "assets" / "tiny_qwen2_init"
SFT_CONFIG = ROOT / "examples" / "configs" / "sft_tiny_math.yaml"
LORA_ON = [
    "policy.dtensor_cfg.lora_cfg.enabled=true",
    "policy.dtensor_cfg.lora_cfg.match_all_linear=false",
    "policy.dtensor_cfg.lora_cfg.target_modules=[q_proj,v_proj]",
]


def run_script(
    script: str,
    args: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    before_ray: bool = True,
) -> str:
    """Run an example script in this process, as a user runs it; return its one stderr line after asserting
    exit status 2 and that no worker started (nor, ``before_ray``, Ray's background start)."""
    starts: list[object] = []
    monkeypatch.setattr(ray_start, "start_ray_in_background", starts.append)
    # Were the check missed, the run would go on to start Ray: fail at once instead.
    monkeypatch.setattr(run_build, "init_ray", lambda *a, **k: pytest.fail("the script started Ray"))
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    stderr = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, stderr
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    assert starts == [] or not before_ray
    return stderr


def test_a_missing_agent_program_exits_2_before_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    line = run_script(
        "run_grpo_math.py",
        [
            "--config",
            str(ROOT / "examples" / "configs" / "grpo_agent_endpoint_tiny.yaml"),
            "grpo.agent.function=null",
            f"grpo.agent.command=[{sys.executable},{tmp_path / 'agent.py'}]",
            f"logger.log_dir={tmp_path / 'logs'}",
        ],
        monkeypatch,
        capsys,
    )
    assert f"grpo.agent.command runs the script '{tmp_path / 'agent.py'}', which does not exist" in line


def test_lora_targets_that_match_no_layer_exit_2_before_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    line = run_script(
        "run_sft.py",
        [
            "--config",
            str(SFT_CONFIG),
            f"policy.model_name={TINY_MODEL}",
            *LORA_ON[:2],
            "policy.dtensor_cfg.lora_cfg.target_modules=[qkv_proj,*.layers.9.*]",
            f"logger.log_dir={tmp_path / 'logs'}",
        ],
        monkeypatch,
        capsys,
    )
    assert (
        "lora_cfg selects no linear layer of the model (target_modules=['qkv_proj', '*.layers.9.*']" in line
    )
    assert "'q_proj'" in line and line.endswith("name some of them in target_modules")


@pytest.mark.parametrize(
    ("saved", "resumed", "change"),
    [
        (LORA_ON, [], "policy.dtensor_cfg.lora_cfg.enabled: True -> False"),
        ([], LORA_ON, "policy.dtensor_cfg.lora_cfg.enabled: False -> True"),
        (LORA_ON, [*LORA_ON, "policy.dtensor_cfg.lora_cfg.dim=4"], "policy.dtensor_cfg.lora_cfg.dim: 8 -> 4"),
    ],
    ids=["lora_off", "lora_on", "other_rank"],
)
def test_resuming_with_other_lora_settings_exits_2_before_any_worker(
    saved: list[str],
    resumed: list[str],
    change: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = [
        f"policy.model_name={TINY_MODEL}",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"logger.log_dir={tmp_path / 'logs'}",
    ]
    # The checkpoint's own record of its run: the config saved with it (no worker needed to write one).
    config = load_and_validate(SFT_CONFIG, SFTMasterConfig, [*common, *saved])
    manager = CheckpointManager(config.checkpointing)
    manager.finalize_checkpoint(manager.init_tmp_checkpoint(2, {"val_loss": 1.0}, run_config=config))
    # Found while Ray's background start is under way (which the script's exit stops), before any worker.
    args = ["--config", str(SFT_CONFIG), *common, *resumed]
    line = run_script("run_sft.py", args, monkeypatch, capsys, before_ray=False)
    assert f"the run resuming from {tmp_path / 'ckpt' / 'step_2'} changes {change}" in line


def test_lora_keys_count_only_where_either_side_trains_adapters(tmp_path: Path) -> None:
    from nemo_rl.algorithms.loop import check_config_change

    def config(enabled: bool, targets: list[str]) -> dict[str, object]:
        lora = {"enabled": enabled, "target_modules": targets, "alpha": 32}
        return {"policy": {"dtensor_cfg": {"lora_cfg": lora}}}

    path = tmp_path / "step_1"
    # LoRA off on both sides: its layer list is a leftover, not a change of what the checkpoint holds.
    assert check_config_change(
        config(False, ["q_proj"]), config(False, []), path=path, allow_incompatible=False
    )
    with pytest.raises(UserError, match=r"lora_cfg\.target_modules: \['q_proj'\] -> \[\]"):
        check_config_change(config(True, ["q_proj"]), config(True, []), path=path, allow_incompatible=False)
