"""Small pieces shared by the algorithm loops."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from pydantic import BaseModel

from nemo_rl.data.dataloader import StatefulDataLoader
from nemo_rl.models.policy.interfaces import PolicyInterface
from nemo_rl.utils.checkpoint import CheckpointManager

B = TypeVar("B")

# Layout of a training checkpoint directory (besides the manager's training_info.json and config.yaml).
_POLICY_DIR = "policy"
_LOADER_FILE = "train_dataloader.pt"
_CONSOLIDATED_DIR = "consolidated"


def batches_until(loader: Iterable[B], steps_done: Callable[[], int], total_steps: int) -> Iterator[B]:
    """Batches of ``loader``, epoch after epoch, until ``steps_done()`` reaches ``total_steps``.

    ``steps_done`` is read before each batch, so the caller advances it as it trains; a resumed loader
    continues from its saved position.
    """
    while steps_done() < total_steps:
        for batch in loader:
            if steps_done() >= total_steps:
                return
            yield batch


@dataclasses.dataclass(frozen=True)
class Resume:
    """The latest complete checkpoint a run continues from (``path`` is ``None`` for a fresh start)."""

    path: Path | None
    training_info: dict[str, Any]

    @property
    def weights_path(self) -> str | None:
        """Where the policy's weights were saved (``Policy(weights_path=...)``)."""
        return None if self.path is None else str(self.path / _POLICY_DIR / "weights")

    @property
    def optimizer_path(self) -> str | None:
        """Where the optimizer and scheduler state were saved (``Policy(optimizer_path=...)``)."""
        return None if self.path is None else str(self.path / _POLICY_DIR / "optimizer")

    def restore_loader(self, loader: StatefulDataLoader[Any, Any]) -> None:
        """Put ``loader`` where it stood when the checkpoint was taken (a no-op on a fresh start)."""
        if self.path is not None:
            loader.load_state_dict(torch.load(self.path / _LOADER_FILE, weights_only=True))


def find_resume(checkpointer: CheckpointManager, enabled: bool, run_name: str) -> Resume:
    """The latest complete checkpoint of ``checkpointer`` when checkpointing is ``enabled``."""
    path = checkpointer.get_latest_checkpoint_path() if enabled else None
    if path is None:
        return Resume(path=None, training_info={})
    info = CheckpointManager.load_training_info(path)
    print(f"Resuming {run_name} from {path} (step {info['step']})", flush=True)
    return Resume(path=path, training_info=info)


def save_training_checkpoint(
    checkpointer: CheckpointManager,
    *,
    step: int,
    training_info: dict[str, Any],
    run_config: BaseModel,
    policy: PolicyInterface,
    train_loader: StatefulDataLoader[Any, Any],
) -> Path:
    """Write the policy (weights, optimizer, scheduler), the loader position and ``training_info`` as
    ``step_<N>``, atomically; with ``checkpointing.save_consolidated`` also a Hugging Face export of the
    weights in ``step_<N>/consolidated``."""
    tmp = checkpointer.init_tmp_checkpoint(step, training_info, run_config)
    policy.save_checkpoint(str(tmp / _POLICY_DIR / "weights"), str(tmp / _POLICY_DIR / "optimizer"))
    if checkpointer.cfg.save_consolidated:
        policy.export_hf(str(tmp / _CONSOLIDATED_DIR))
    torch.save(train_loader.state_dict(), tmp / _LOADER_FILE)
    return checkpointer.finalize_checkpoint(tmp)
