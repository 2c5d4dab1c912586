"""Command line of the example scripts: ``--config``, overrides, and user errors exiting without a traceback."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import Field

from nemo_rl.config import (
    ConfigError,
    ConfigModel,
    UserError,
    exit_on_user_error,
    parse_args_and_load,
    run_cli,
)
from nemo_rl.config.cli import USER_ERROR_EXIT_CODE, split_args

ROOT = Path(__file__).resolve().parents[2]


class Policy(ConfigModel):
    """Test policy."""

    model_name: str
    """Model."""

    train_micro_batch_size: int = 2
    """Micro-batch."""


class Logger(ConfigModel):
    """Test logger."""

    swanlab_enabled: bool = False
    """SwanLab."""


class Root(ConfigModel):
    """Test master config."""

    policy: Policy
    """Policy."""

    logger: Logger = Field(default_factory=Logger)
    """Logger."""


@pytest.fixture
def configs(tmp_path: Path) -> tuple[Path, Path]:
    default = tmp_path / "default.yaml"
    default.write_text("policy:\n  model_name: default\n")
    other = tmp_path / "other.yaml"
    other.write_text("defaults: default.yaml\npolicy:\n  model_name: other\n")
    return default, other


@pytest.mark.parametrize(
    ("argv", "config", "overrides"),
    [
        ([], None, []),
        (["a=1", "~b"], None, ["a=1", "~b"]),
        (["--config", "x.yaml", "a=1"], "x.yaml", ["a=1"]),
        (["a=1", "--config=x.yaml", "++b=2"], "x.yaml", ["a=1", "++b=2"]),
    ],
)
def test_split_args(argv: list[str], config: str | None, overrides: list[str]) -> None:
    assert split_args(argv) == (config, overrides)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config"], "--config needs a path"),
        (["--config", "a=1"], None),
        (["--config", "--other"], "--config needs a path"),
        (["--config="], "needs a path"),
        (["--config", "a.yaml", "--config=b.yaml"], "given twice"),
        (["--lr", "3"], "unknown option '--lr'"),
        (["-x"], "unknown option '-x'"),
    ],
)
def test_split_args_errors(argv: list[str], message: str | None) -> None:
    if message is None:
        # A path is taken as given; whether it exists is checked when loading.
        assert split_args(argv) == ("a=1", [])
        return
    with pytest.raises(ConfigError, match=message):
        split_args(argv)


def test_parse_args_and_load_default_config(configs: tuple[Path, Path]) -> None:
    default, _ = configs
    cfg, resolved = parse_args_and_load(Root, default, argv=["policy.train_micro_batch_size=4"])
    assert cfg.policy.model_name == "default"
    assert cfg.policy.train_micro_batch_size == 4
    assert resolved.policy.train_micro_batch_size == 4


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_parse_args_and_load_config_flag(configs: tuple[Path, Path], form: str) -> None:
    default, other = configs
    flag = ["--config", str(other)] if form == "separate" else [f"--config={other}"]
    cfg, _ = parse_args_and_load(Root, str(default), argv=[*flag, "swanlab_enabled=true"])
    assert cfg.policy.model_name == "other"
    assert cfg.logger.swanlab_enabled is True


def test_parse_args_and_load_reads_sys_argv(
    configs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    default, other = configs
    monkeypatch.setattr(sys, "argv", ["prog.py", "--config", str(other), "policy.model_name=argv"])
    cfg, _ = parse_args_and_load(Root, default)
    assert cfg.policy.model_name == "argv"


def test_parse_args_and_load_errors(configs: tuple[Path, Path]) -> None:
    default, _ = configs
    with pytest.raises(ConfigError, match="unknown key"):
        parse_args_and_load(Root, default, argv=["policy.no_such_key=1"])
    with pytest.raises(ConfigError, match="config file not found"):
        parse_args_and_load(Root, default, argv=["--config", str(default.parent / "missing.yaml")])


def test_help_prints_usage_and_exits_zero(
    configs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    default, _ = configs
    with pytest.raises(SystemExit) as info:
        parse_args_and_load(Root, default, argv=["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "[--config PATH]" in out and str(default) in out and "Config sections: policy, logger" in out


def test_run_cli_returns_result_and_exits_2_on_user_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(lambda x: x + 1, 1) == 2

    def fail() -> None:
        raise UserError("dataset file data.jsonl not found: pass data.train_path=...")

    with pytest.raises(SystemExit) as info:
        run_cli(fail)
    assert info.value.code == USER_ERROR_EXIT_CODE
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: dataset file data.jsonl not found: pass data.train_path=...")
    )


def test_user_error_carried_by_a_remote_error_is_shown_without_the_wrapper(
    capsys: pytest.CaptureFixture[str],
) -> None:
    class RemoteError(UserError):
        """Stands in for the error Ray raises on the driver for a UserError raised in an actor."""

        def __init__(self, cause: UserError) -> None:
            super().__init__(f"remote traceback...\n{cause}")
            self.cause = cause

    with pytest.raises(SystemExit), exit_on_user_error():
        raise RemoteError(ConfigError("bad value"))
    err = capsys.readouterr().err
    assert "error: bad value" in err and "remote traceback" not in err


def test_bugs_keep_their_traceback() -> None:
    def bug() -> None:
        raise KeyError("internal")

    with pytest.raises(KeyError):
        run_cli(bug)
    with pytest.raises(ZeroDivisionError), exit_on_user_error():
        _ = 1 / 0


SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from nemo_rl.config import ConfigModel, parse_args_and_load, run_cli


    class Policy(ConfigModel):
        model_name: str
        train_micro_batch_size: int = 2


    class Root(ConfigModel):
        policy: Policy


    def main() -> None:
        cfg, _ = parse_args_and_load(Root, Path(__file__).parent / "cfg.yaml")
        print(f"ok {cfg.policy.model_name} {cfg.policy.train_micro_batch_size}")
        # A script must be able to reject bad input before heavy libraries load.
        assert not {"torch", "ray", "transformers"} & set(sys.modules), sorted(sys.modules)


    if __name__ == "__main__":
        run_cli(main)
    """
)


def run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "cfg.yaml").write_text("policy:\n  model_name: tiny\n")
    script = tmp_path / "run_x.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_script_runs_with_overrides(tmp_path: Path) -> None:
    result = run_script(tmp_path, "policy.train_micro_batch_size=8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok tiny 8"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["policy.no_such_key=1"], "unknown key; did you mean"),
        (["policy.train_micro_batch_size=many"], "policy.train_micro_batch_size: expected int, got 'many'"),
    ],
)
def test_script_user_error_exits_2_without_traceback(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_script(tmp_path, *args)
    assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr
    assert "run_x.py: error: " in result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


class Knobs(ConfigModel):
    """Test section with a knob accepted for compatibility."""

    fused_kernels: bool = False
    """Accepted, no effect here: a speed knob."""


class DryRoot(ConfigModel):
    """Test master config with a no-effect knob."""

    policy: Policy
    """Policy."""

    knobs: Knobs = Field(default_factory=Knobs)
    """Knobs."""


def test_dry_run_prints_the_resolved_config_and_the_no_effect_keys(
    configs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    default, _ = configs
    with pytest.raises(SystemExit) as exit_info:
        parse_args_and_load(
            DryRoot, default, ["--dry-run", "knobs.fused_kernels=true", "policy.model_name=m"]
        )
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "model_name: m" in out and "train_micro_batch_size: 2" in out
    assert "knobs.fused_kernels=True (a speed knob)" in out
    # Without --dry-run the same list goes to stderr once, and the config is returned.
    cfg, _ = parse_args_and_load(DryRoot, default, ["knobs.fused_kernels=true"])
    assert cfg.knobs.fused_kernels
    assert "knobs.fused_kernels=True (a speed knob)" in capsys.readouterr().err


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("run_*.py")))
def test_every_example_script_has_a_dry_run(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Exits 0 after printing the resolved default config, before setting anything up (in-process: fast).
    path = ROOT / "examples" / script
    # The memory plan is checked against an 80 GiB device whatever GPU this machine has.
    monkeypatch.setattr(sys, "argv", [str(path), "--dry-run", "++cluster.device_memory_gb=80"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    # run_eval.py names its model under generation:, the training scripts under policy:.
    assert ("policy:" in out or "generation:" in out) and "model_name:" in out
    assert "have no effect here" in out or "Every key of the config is used" in out
