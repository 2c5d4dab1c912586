"""``build_run`` without workers: what a run on a fixed data set holds, and a further trained policy (a critic)
started on the policy's slots and resumed from its own checkpoint folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import nemo_rl.algorithms.run_build as run_build
from nemo_rl.algorithms.run import SupervisedState
from nemo_rl.algorithms.run_build import ExtraPolicy, RunSpec, build_run
from nemo_rl.config.master import SFTMasterConfig


class FakePolicy:
    """Records how the run started it; saves marker files where a real policy writes its checkpoint."""

    def __init__(self, cluster: Any, cfg: Any, **kwargs: Any) -> None:
        self.cfg = cfg
        self.kwargs = kwargs
        self.shut_down = False

    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        Path(weights_path).mkdir(parents=True)

    def shutdown(self) -> None:
        self.shut_down = True


class FakeCluster:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def shutdown(self) -> None:
        pass


def _config(tmp_path: Path) -> SFTMasterConfig:
    return SFTMasterConfig.model_validate(
        {
            "policy": {"model_name": "m", "train_global_batch_size": 2, "train_micro_batch_size": 1},
            "checkpointing": {"checkpoint_dir": str(tmp_path / "ckpt")},
            "logger": {
                "log_dir": str(tmp_path / "logs"),
                "console_enabled": False,
                "progress_bar": False,
                "monitor_gpus": False,
            },
            "cluster": {"gpus_per_node": 2},
        }
    )


def _spec(config: SFTMasterConfig) -> RunSpec[SupervisedState]:
    return RunSpec(
        name="SFT",
        state_cls=SupervisedState,
        metric_names={"val_loss"},
        seed=0,
        batch_size=2,
        batch_size_key="policy.train_global_batch_size",
        collate_fn=list,  # type: ignore[arg-type]
        models=[ExtraPolicy(config.policy, name="critic", trained=True)],
    )


def test_a_trained_extra_policy_starts_beside_the_policy_and_resumes_from_its_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(run_build, "init_ray", lambda cluster_cfg: None)
    monkeypatch.setattr(run_build, "RayVirtualCluster", FakeCluster)
    monkeypatch.setattr(run_build, "Policy", FakePolicy)
    config = _config(tmp_path)
    data = [{"x": i} for i in range(4)]

    run = build_run(config, None, data, None, _spec(config))  # type: ignore[arg-type]
    policy, critic = run.policy, run.models["critic"]
    assert run.sampling is None and run.val_loader is None and run.trained_models == ("critic",)
    # A fresh run: both on every slot, from the model, and the critic's actors named apart.
    assert policy.kwargs["bundle_indices"] is None and policy.kwargs["weights_path"] is None  # type: ignore[attr-defined]
    assert critic.kwargs["name_prefix"] == "critic" and critic.kwargs["weights_path"] is None  # type: ignore[attr-defined]
    run.state.step = 1
    run.save_checkpoint()
    run.shutdown()
    assert critic.shut_down  # type: ignore[attr-defined]

    resumed = build_run(config, None, data, None, _spec(config))  # type: ignore[arg-type]
    step_dir = tmp_path / "ckpt" / "step_1"
    assert resumed.state.step == 1
    assert resumed.policy.kwargs["weights_path"] == str(step_dir / "policy" / "weights")  # type: ignore[attr-defined]
    assert resumed.models["critic"].kwargs["weights_path"] == str(step_dir / "critic" / "weights")  # type: ignore[attr-defined]
    assert resumed.models["critic"].kwargs["optimizer_path"] == str(step_dir / "critic" / "optimizer")  # type: ignore[attr-defined]
    resumed.shutdown()
