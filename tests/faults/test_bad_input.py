"""Bad input is a one-line error that names the key, file or row, raised before Ray starts."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from nemo_rl.algorithms.loop import check_run_setup
from nemo_rl.config.checkpointing import CheckpointingConfig
from nemo_rl.config.errors import ConfigError, UserError
from nemo_rl.config.master import GRPOMasterConfig
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.config.validation import validate_dict
from nemo_rl.models.tokenizer import get_policy_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _policy(**overrides: object) -> PolicyConfig:
    return PolicyConfig.model_validate(
        {
            "model_name": str(ROOT / "examples/assets/tiny_qwen2_init"),
            "train_global_batch_size": 4,
            **overrides,
        }
    )


def _check(policy: PolicyConfig, tmp_path: Path, world: int = 2, **ckpt: object) -> None:
    check_run_setup(
        policy,
        CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), **ckpt),  # type: ignore[arg-type]
        str(tmp_path / "logs"),
        policy_world_size=world,
        run_name="SFT",
        metric_names={"val_loss"},
    )


def test_model_and_tokenizer_paths(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"policy.model_name=/nonexistent/model does not exist"):
        get_policy_tokenizer(_policy(model_name="/nonexistent/model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"has no config.json"):
        get_policy_tokenizer(_policy(model_name=str(tmp_path / "empty")))
    with pytest.raises(UserError, match=r"policy.tokenizer.name=.*/no_tokenizer does not exist"):
        get_policy_tokenizer(_policy(tokenizer={"name": str(tmp_path / "no_tokenizer")}))
    # A folder with a config.json but no tokenizer files: the loader's error, as one line naming the key.
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"policy.model_name=.*the tokenizer cannot be loaded") as err:
        get_policy_tokenizer(_policy(model_name=str(tmp_path / "empty")))
    assert "\n" not in str(err.value)


def test_checks_before_ray(tmp_path: Path) -> None:
    _check(_policy(), tmp_path)  # a good setup passes and creates the folders
    assert (tmp_path / "ckpt").is_dir() and (tmp_path / "logs").is_dir()
    with pytest.raises(UserError, match=r"policy.optimizer .* cannot be built"):
        _check(_policy(optimizer={"kwargs": {"lr": "abc"}}), tmp_path)
    with pytest.raises(UserError, match=r"policy.optimizer .* cannot be built: .*unexpected keyword"):
        _check(_policy(optimizer={"kwargs": {"learning_rate": 1e-3}}), tmp_path)
    with pytest.raises(UserError, match=r"policy.scheduler cannot be built"):
        _check(
            _policy(scheduler=[{"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"bad": 1}}]), tmp_path
        )
    with pytest.raises(UserError, match=r"train_global_batch_size=4 does not divide over the policy's 3"):
        _check(_policy(), tmp_path, world=3)
    with pytest.raises(
        UserError, match=r"metric_name='val_acc' is not recorded by SFT; use one of \['val_loss'\]"
    ):
        _check(_policy(), tmp_path, metric_name="val_acc")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(UserError, match=r"checkpointing.checkpoint_dir=.*a_file/ckpt cannot be written"):
        check_run_setup(
            _policy(),
            CheckpointingConfig(checkpoint_dir=str(blocker / "ckpt")),
            str(tmp_path / "logs"),
            policy_world_size=1,
            run_name="SFT",
            metric_names=(),
        )


def test_grpo_needs_a_group_of_responses() -> None:
    with pytest.raises(ConfigError, match=r"grpo.num_generations_per_prompt.*greater than or equal to 2"):
        validate_dict(
            {"policy": {"model_name": "m"}, "grpo": {"num_generations_per_prompt": 1}}, GRPOMasterConfig
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"dtensor_cfg": {"tensor_parallel_size": 2}},
            r"replicate needs tensor_parallel_size=1, context_parallel_size=1 and cpu_off",
        ),
        (
            {"dtensor_cfg": {"cpu_offload": True}},
            r"replicate needs tensor_parallel_size=1, context_parallel_size=1 and cpu_offload",
        ),
        ({"precision": "bfloat16"}, r"replicate trains in float32, not policy.precision=bfloat16"),
    ],
)
def test_replicated_data_parallel_refuses_what_it_cannot_build(
    overrides: dict[str, Any], message: str
) -> None:
    # Refused when the config loads, before Ray or any worker starts, with the key to change.
    policy = {"model_name": "m", "dtensor_cfg": {"data_parallel_mode": "replicate"}}
    for key, value in overrides.items():
        policy[key] = {**policy[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError, match=message) as err:
        validate_dict({"policy": policy}, GRPOMasterConfig)
    assert len(err.value.problems) == 1 and "data_parallel_mode=fsdp" in err.value.problems[0]


def test_script_exits_2_with_one_line_before_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The example script as a user runs it (in this process: its imports are already loaded here).
    argv = [
        "run_sft.py",
        "--config",
        str(ROOT / "examples" / "configs" / "sft_tiny_math.yaml"),
        "policy.model_name=/nonexistent/model",
        f"logger.log_dir={tmp_path / 'logs'}",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "examples" / "run_sft.py"), run_name="__main__")
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "policy.model_name=/nonexistent/model does not exist" in stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_grpo_script_refuses_a_missing_model_folder_before_starting_ray(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The GRPO script starts Ray in the background as soon as its config is valid; a model folder that does
    # not exist is known from the path alone, so it must be refused before that start.
    import nemo_rl.distributed.ray_start as ray_start

    starts: list[object] = []
    monkeypatch.setattr(ray_start, "start_ray_in_background", starts.append)
    argv = [
        "run_grpo_math.py",
        "--config",
        str(ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"),
        "policy.model_name=/nonexistent/model",
        f"logger.log_dir={tmp_path / 'logs'}",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "examples" / "run_grpo_math.py"), run_name="__main__")
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "policy.model_name=/nonexistent/model does not exist" in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert starts == []


def test_grpo_script_exits_at_once_on_a_setup_error_and_stops_the_ray_it_began(tmp_path: Path) -> None:
    # A bad data path is found after Ray's background start began (the tokenizer comes first): the script
    # prints its one line, stops the Ray processes started so far, removes their session folder and exits 2
    # at once instead of waiting for the start. Run in a process of its own (it ends with os._exit), from a
    # folder of its own, so that Ray's processes (which inherit it) are found by their working directory.
    ray_dir = tmp_path / "ray"
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo_math.py"),
        "--config",
        str(ROOT / "examples" / "configs" / "grpo_math_tiny.yaml"),
        f"policy.model_name={ROOT / 'examples' / 'assets' / 'tiny_math_sft'}",
        "data.dataset_name=openai_format",
        f"data.train_data_path={tmp_path / 'missing.jsonl'}",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"logger.log_dir={tmp_path / 'logs'}",
    ]
    env = {**os.environ, "NEMO_RL_RAY_TEMP_DIR": str(ray_dir), "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    assert proc.stderr is not None
    lines: list[tuple[float, str]] = [(time.monotonic(), line.rstrip()) for line in proc.stderr]
    returncode = proc.wait()
    exited = time.monotonic()
    watchdog.cancel()
    # Ray's own log lines (timestamped) may come before it; the script's is one line, and the last.
    ours = [(at, line) for at, line in lines if not line[:4].isdigit()]
    assert returncode == 2 and len(ours) == 1, lines
    reported_at, line = ours[0]
    assert line.startswith(
        f"run_grpo_math.py: error: data.train_data_path={tmp_path / 'missing.jsonl'} does not exist"
    ), lines
    assert exited - reported_at < 1.5, f"exited {exited - reported_at:.2f} s after its error line"
    assert not ray_dir.exists(), list(ray_dir.rglob("*"))
    leftover = [
        p.info
        for p in psutil.process_iter(["pid", "name", "cwd", "status"])
        if p.info["cwd"] == str(tmp_path) and p.info["status"] != psutil.STATUS_ZOMBIE
    ]
    assert not leftover, f"{leftover} still run {exited - started:.1f} s after the start"
