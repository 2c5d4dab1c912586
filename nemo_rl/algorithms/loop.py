"""The parts every training loop shares: the step loop's tail, resuming, and saving a checkpoint.

A loop declares its state as a dataclass with a ``step`` field and writes only its own step::

    @dataclasses.dataclass
    class DPOState:
        step: int = 0
        val_loss: float | None = None

    resume = find_resume(checkpointer, "DPO")          # setup: the latest complete checkpoint, if any
    state = resume.state(DPOState)                      # fields read back from its training_info.json
    resume.restore_loader(train_loader)
    policy = Policy(..., weights_path=resume.weights_path, optimizer_path=resume.optimizer_path)

    loop = TrainLoop(                                   # train
        "dpo",
        loader=train_loader,
        state=state,
        total_steps=step_budget(cfg.dpo.max_num_steps, cfg.dpo.max_num_epochs, len(train_loader)),
        logger=logger,
        checkpointer=checkpointer,
        save_checkpoint=lambda: save_training_checkpoint(
            checkpointer, state=state, run_config=cfg, policy=policy, train_loader=train_loader
        ),
        validate=lambda step: validate(..., step),
        val_period=cfg.dpo.val_period,
        val_at_start=cfg.dpo.val_at_start,
    )
    for batch in loop:
        with loop.timer.time("policy_training"):
            result = policy.train(batch, loss_fn)
        loop.end_step({"loss": float(result["loss"].mean())})

``TrainLoop`` yields batches until the step budget, and :meth:`TrainLoop.end_step` does everything after a
step: count it, validate when due, log ``train/*`` (before the checkpoint, so a run killed right after
saving keeps the step's metrics), save on ``checkpointing.save_period``, at the last step, when
``checkpointing.checkpoint_must_save_by`` runs out and after a SIGTERM, log ``timing/train/*``; the loop then
advances the progress bar and stops after such a deadline save.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
from pydantic import BaseModel

from nemo_rl.config.checkpointing import CheckpointingConfig
from nemo_rl.config.errors import UserError
from nemo_rl.config.policy import PolicyConfig
from nemo_rl.data.dataloader import StatefulDataLoader
from nemo_rl.models.policy.interfaces import PolicyInterface, TrainResult, nonfinite_step_flags
from nemo_rl.models.policy.lm_policy import check_policy_layout
from nemo_rl.models.policy.loss_interface import reduce_metrics
from nemo_rl.models.policy.optim import check_optimizer_config
from nemo_rl.utils.checkpoint import CheckpointManager
from nemo_rl.utils.logger import Logger
from nemo_rl.utils.rng import ProcessRNG
from nemo_rl.utils.timer import TimeoutChecker, Timer

B = TypeVar("B")
S = TypeVar("S")

# Layout of a training checkpoint directory (besides the manager's training_info.json and config.yaml).
_POLICY_DIR = "policy"
_LOADER_FILE = "train_dataloader.pt"
_CONSOLIDATED_DIR = "consolidated"

_DRIVER_RNG = ProcessRNG()

STEP_TIMER = "total_step_time"
"""Timer label of a whole step, from the batch being yielded to the end of :meth:`TrainLoop.end_step`."""


class LoopState(Protocol):
    """What :class:`TrainLoop` needs of a loop's state: the number of steps taken."""

    step: int


def train_metrics(result: TrainResult, extra: Mapping[str, float] | None = None) -> dict[str, float]:
    """A ``policy.train`` call's metrics for ``train/*``: ``loss`` (mean over its optimizer steps),
    ``grad_norm`` and ``lr`` (of the last step), ``num_valid_tokens`` (summed), ``nonfinite_steps`` (its
    optimizer steps skipped for a non-finite loss or gradient norm), then ``extra``, then the loss function's
    own metrics reduced over the steps by :func:`reduce_metrics` (mean; min / max for ``*_min`` / ``*_max``)
    where their names are not taken yet."""
    metrics = {
        "loss": float(result["loss"].mean()),
        "grad_norm": float(result["grad_norm"][-1]),
        "lr": float(result["lr"][-1]),
        "num_valid_tokens": float(result["global_valid_toks"].sum()),
        "nonfinite_steps": float(sum(nonfinite_step_flags(result))),
        **(extra or {}),
    }
    for name, value in reduce_metrics(result["metrics"], "mean").items():
        metrics.setdefault(name, value)
    return metrics


def step_budget(max_num_steps: int, max_num_epochs: int, steps_per_epoch: int) -> int:
    """Steps a run takes: ``max_num_steps``, or fewer when ``max_num_epochs`` epochs end first."""
    return min(max_num_steps, max_num_epochs * steps_per_epoch)


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


@dataclasses.dataclass(eq=False)
class TrainLoop(Generic[B]):
    """Iterate over the training batches; call :meth:`end_step` once per batch (see the module docstring)."""

    name: str
    """Label of the progress bar (``"sft"``, ``"grpo"``...)."""

    _: dataclasses.KW_ONLY

    loader: Iterable[B]
    """Training batches; iterated epoch after epoch (a resumed loader continues where it stood)."""

    state: LoopState
    """The loop's state; ``state.step`` counts finished steps and :meth:`end_step` increments it."""

    total_steps: int
    """Stop when ``state.step`` reaches it (see :func:`step_budget`)."""

    logger: Logger
    """Receives ``train/*``, ``timing/train/*`` and ``performance/*`` metrics and the progress bar."""

    checkpointer: CheckpointManager
    """Decides when to save (``checkpointing.enabled``, ``save_period``, ``checkpoint_must_save_by`` of its
    config)."""

    save_checkpoint: Callable[[], object]
    """Writes a checkpoint of the current step (e.g. :func:`save_training_checkpoint`)."""

    validate: Callable[[int], object] | None = None
    """Called with the step number when validation is due; it logs its own metrics."""

    val_period: int = 0
    """Validate every this many steps (0: never during training)."""

    val_at_start: bool = False
    """Validate at step 0 before the first step of a fresh run."""

    val_at_end: bool = False
    """Also validate after the last step when ``val_period`` does not fall on it (before the final
    checkpoint, which then records the validation metric)."""

    step_events: Callable[[], Mapping[str, float]] | None = None
    """What happened to the run's workers since the last step (e.g. ``generation/replaced_workers``), added
    to each step's ``train/*`` metrics."""

    timer: Timer = dataclasses.field(init=False, default_factory=Timer)
    """Times the current step; labels it records are logged as ``timing/train/<label>``."""

    out_of_time: bool = dataclasses.field(init=False, default=False)
    """Whether ``checkpointing.checkpoint_must_save_by`` ran out or a SIGTERM came (the loop stops after this
    step)."""

    _deadline: TimeoutChecker | None = dataclasses.field(init=False, default=None, repr=False)
    _step_open: bool = dataclasses.field(init=False, default=False, repr=False)

    def __post_init__(self) -> None:
        # The driver's RNG continues from the checkpoint the run resumed from (restored here, after setup).
        self.checkpointer.track("driver_rng", _DRIVER_RNG)

    def __iter__(self) -> Iterator[B]:
        if self.validate is not None and self.val_at_start and self.state.step == 0:
            self.validate(0)
        self._deadline = TimeoutChecker(
            self.checkpointer.cfg.checkpoint_must_save_by, fit_last_save_time=True
        )
        self._deadline.stop_on_signals()
        self._deadline.start_iterations()
        progress = self.logger.progress_bar(total=self.total_steps, initial=self.state.step, desc=self.name)
        try:
            for batch in batches_until(self.loader, lambda: self.state.step, self.total_steps):
                self.timer.start(STEP_TIMER)
                self._step_open = True
                yield batch
                if self._step_open:
                    self._step_open = False
                    raise RuntimeError(
                        f"the {self.name} loop body returned without calling end_step(metrics) for its batch"
                    )
                progress.update(1)
                if self.out_of_time:
                    print(f"{self._deadline.stop_reason}: stopping after step {self.state.step}", flush=True)
                    break
        finally:
            progress.close()
            self._deadline.close()

    def end_step(self, metrics: Mapping[str, float], *, num_tokens: float | None = None) -> None:
        """Finish the current step: count it, validate, log, checkpoint when due, log its timings.

        Args:
            metrics: The step's training metrics, logged as ``train/<name>`` at the new step number.
            num_tokens: Tokens the step processed; when given, ``performance/tokens_per_sec`` is logged.
        """
        if not self._step_open or self._deadline is None:
            raise RuntimeError("end_step() is called once per batch yielded by iterating over the TrainLoop")
        self._step_open = False
        self.state.step += 1
        step = self.state.step
        periodic = bool(self.val_period) and step % self.val_period == 0
        if self.validate is not None and (periodic or (self.val_at_end and step == self.total_steps)):
            with self.timer.time("validation"):
                self.validate(step)
        events = {} if self.step_events is None else self.step_events()
        # Logged before the checkpoint, so a run killed after saving step N has step N's metrics.
        self.logger.log_metrics({**metrics, **events}, step, prefix="train")
        self._deadline.mark_iteration()
        self.out_of_time = self._deadline.check_save()
        if self.checkpointer.cfg.enabled and (
            self.checkpointer.should_save(step) or step == self.total_steps or self.out_of_time
        ):
            with self.timer.time("checkpointing"):
                self.save_checkpoint()
        self.timer.stop(STEP_TIMER)
        timing = self.timer.get_timing_metrics("sum")
        self.logger.log_metrics(timing, step, prefix="timing/train")
        if num_tokens is not None:
            self.logger.log_metrics(
                {"tokens_per_sec": num_tokens / timing[STEP_TIMER]}, step, prefix="performance"
            )
        self.timer.reset()


@dataclasses.dataclass(frozen=True)
class Resume:
    """The latest complete checkpoint a run continues from (``path`` is ``None`` for a fresh start)."""

    path: Path | None
    training_info: dict[str, Any]

    @property
    def weights_path(self) -> str | None:
        """Where the policy's weights were saved (``Policy(weights_path=...)``)."""
        return self.policy_paths()[0]

    @property
    def optimizer_path(self) -> str | None:
        """Where the optimizer and scheduler state were saved (``Policy(optimizer_path=...)``)."""
        return self.policy_paths()[1]

    def policy_paths(self, name: str = _POLICY_DIR) -> tuple[str | None, str | None]:
        """Where the weights and the optimizer state of the trained policy ``name`` were saved (the run's
        policy by default; another trained policy, such as a critic, under its own name)."""
        if self.path is None:
            return None, None
        return str(self.path / name / "weights"), str(self.path / name / "optimizer")

    def state(self, state_cls: type[S]) -> S:
        """The loop state saved in the checkpoint: ``state_cls`` (a dataclass) built from the saved values of
        its fields; a fresh ``state_cls()`` on a fresh start. Fields the checkpoint lacks keep their defaults."""
        fields: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(cast(Any, state_cls))
        names = {f.name for f in fields}
        return state_cls(**{k: v for k, v in self.training_info.items() if k in names})

    def restore_loader(self, loader: StatefulDataLoader[Any, Any]) -> None:
        """Put ``loader`` where it stood when the checkpoint was taken (a no-op on a fresh start)."""
        if self.path is not None:
            loader.load_state_dict(torch.load(self.path / _LOADER_FILE, weights_only=True))


def find_resume(
    checkpointer: CheckpointManager, run_name: str, run_config: BaseModel | None = None
) -> Resume:
    """The latest intact checkpoint of ``checkpointer`` (none when ``checkpointing.enabled`` is off).

    A later checkpoint whose files no longer match its manifest (truncated, changed) is skipped with a
    warning. With ``run_config``, the checkpoint's saved config is compared with it (see
    :func:`check_config_change`). The checkpoint becomes ``checkpointer.resume_path``, from which
    ``checkpointer.track`` restores run state (RNG, generation seeds).
    """
    if not checkpointer.cfg.enabled:
        return Resume(path=None, training_info={})
    path, damaged = checkpointer.latest_intact_checkpoint()
    for bad, problem in damaged:
        print(
            f"WARNING: checkpoint {bad} is damaged ({problem}); "
            + (
                f"falling back to {path}"
                if path is not None
                else "no earlier intact checkpoint, starting afresh"
            ),
            flush=True,
        )
    if path is None:
        return Resume(path=None, training_info={})
    info = CheckpointManager.load_training_info(path)
    if run_config is not None:
        saved = CheckpointManager.load_config(path)
        if saved is not None:
            check_config_change(
                saved,
                run_config.model_dump(mode="json"),
                path=path,
                allow_incompatible=checkpointer.cfg.allow_incompatible_resume,
            )
    checkpointer.resume_path = path
    print(f"Resuming {run_name} from {path} (step {info['step']})", flush=True)
    return Resume(path=path, training_info=info)


# Changing these between a checkpoint and the run resuming from it would load weights or shards into a
# model they do not fit: refused unless ``checkpointing.allow_incompatible_resume``. The model, its tokenizer,
# and any policy section's switch (the policy backend, the reward head) or parallel layout.
_INCOMPATIBLE_KEYS = re.compile(r"^policy\.(model_name|tokenizer\.name|\w+_cfg\.(enabled|\w*parallel_size))$")
# LoRA adapters switched on or off, or of another rank or on other layers: the checkpoint holds other tensors
# than the run builds (counted only where either side trains adapters).
_LORA_KEYS = re.compile(
    r"^policy\.(dtensor_cfg\.lora_cfg|megatron_cfg\.peft)\."
    r"(enabled|dim|target_modules|exclude_modules|match_all_linear)$"
)
# Bookkeeping that does not change what the resumed steps compute.
_NEUTRAL_KEYS = re.compile(
    r"^(logger|checkpointing)\.|\.(max_num_steps|max_num_epochs|export_dir|val_period|val_at_start)$"
)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _incompatible(key: str, before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Whether a change of ``key`` between the saved (``before``) and the resuming config (``after``, both
    flattened) makes the checkpoint unloadable."""
    if _INCOMPATIBLE_KEYS.match(key):
        return True
    lora = _LORA_KEYS.match(key)
    if lora is None:
        return False
    switch = f"policy.{lora.group(1)}.enabled"
    return bool(before.get(switch) or after.get(switch))


def check_config_change(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, path: Path, allow_incompatible: bool
) -> list[str]:
    """Compare the config saved with checkpoint ``path`` with the resuming run's; returns the changed keys.

    Changes of the model, tokenizer or parallel layout raise :class:`UserError` (unless
    ``allow_incompatible``); other changes that alter what the run computes are printed as a warning;
    logging, checkpointing and step-budget keys are ignored.
    """
    before, after = _flatten(saved), _flatten(current)
    changed = [
        key
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key) and not _NEUTRAL_KEYS.search(key)
    ]
    diffs = [f"{key}: {before.get(key)!r} -> {after.get(key)!r}" for key in changed]
    incompatible = [d for key, d in zip(changed, diffs, strict=True) if _incompatible(key, before, after)]
    if incompatible and not allow_incompatible:
        raise UserError(
            f"the run resuming from {path} changes {'; '.join(incompatible)}, which its checkpoint cannot be "
            "loaded into; restore the setting, use a new checkpointing.checkpoint_dir, or set "
            "checkpointing.allow_incompatible_resume=true"
        )
    if diffs:
        print(
            f"WARNING: resuming from {path} with a changed config (the run will differ from the one "
            f"checkpointed): {'; '.join(diffs)}",
            flush=True,
        )
    return changed


def check_run_setup(
    policy: PolicyConfig,
    checkpointing: CheckpointingConfig,
    log_dir: str,
    *,
    policy_world_size: int,
    run_name: str,
    metric_names: Collection[str],
) -> None:
    """The input checks a loop's setup makes before starting Ray, each failing as a one-line
    :class:`UserError`: the policy's layout and batch size on ``policy_world_size`` workers
    (:func:`check_policy_layout`), its optimizer and scheduler (:func:`check_optimizer_config`), that
    ``checkpointing.metric_name`` is one of ``metric_names`` (what the loop records in its checkpoints), and
    that the checkpoint and log folders can be written (rather than failing at the first save)."""
    check_policy_layout(policy, policy_world_size)
    check_optimizer_config(policy)
    metric_name = checkpointing.metric_name
    if checkpointing.enabled and metric_name is not None and metric_name not in metric_names:
        raise UserError(
            f"checkpointing.metric_name={metric_name!r} is not recorded by {run_name}; use one of "
            f"{sorted(metric_names)} or null (rank checkpoints by step)"
        )
    folders = [("logger.log_dir", log_dir)]
    if checkpointing.enabled:
        folders.append(("checkpointing.checkpoint_dir", checkpointing.checkpoint_dir))
    for key, folder in folders:
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as err:
            raise UserError(
                f"{key}={folder} cannot be written ({err.strerror or err}); choose a writable folder"
            ) from None


def training_info(state: LoopState, metric_name: str | None, metric_value: float | None) -> dict[str, Any]:
    """What ``training_info.json`` records: the state's fields, plus ``metric_value`` under ``metric_name``
    (the key ranking checkpoints) unless the state has a field of that name."""
    if not dataclasses.is_dataclass(state) or isinstance(state, type):
        raise TypeError(f"loop state must be a dataclass instance, got {state!r}")
    info: dict[str, Any] = dataclasses.asdict(state)
    if metric_name is not None and metric_name not in info:
        info[metric_name] = metric_value
    return info


class SupportsStateDict(Protocol):
    """What a checkpoint saves as the training loader's position (a loader, or a stand-in for one)."""

    def state_dict(self) -> dict[str, Any]:
        """The position a resumed loader continues from (see ``StatefulDataLoader.load_state_dict``)."""


def save_training_checkpoint(
    checkpointer: CheckpointManager,
    *,
    state: LoopState,
    run_config: BaseModel,
    policy: PolicyInterface,
    train_loader: SupportsStateDict,
    metric_value: float | None = None,
    other_policies: Mapping[str, PolicyInterface] | None = None,
) -> Path:
    """Write the policy (weights, optimizer, scheduler), the loader position and the loop state as
    ``step_<state.step>``, atomically; with ``checkpointing.save_consolidated`` also a Hugging Face export of
    the weights in ``step_<N>/consolidated``.

    ``metric_value`` is recorded under ``checkpointing.metric_name`` (see :func:`training_info`).
    ``other_policies`` are further trained policies (a critic), each saved under its name
    (:meth:`Resume.policy_paths` finds them).
    """
    others = dict(other_policies or {})
    reserved = {_POLICY_DIR, _CONSOLIDATED_DIR} & others.keys()
    if reserved:
        raise ValueError(f"a trained policy cannot be named {sorted(reserved)[0]!r} (a checkpoint folder)")
    info = training_info(state, checkpointer.cfg.metric_name, metric_value)
    tmp = checkpointer.init_tmp_checkpoint(state.step, info, run_config)
    for name, trained in {_POLICY_DIR: policy, **others}.items():
        trained.save_checkpoint(str(tmp / name / "weights"), str(tmp / name / "optimizer"))
    if checkpointer.cfg.save_consolidated:
        policy.export_hf(str(tmp / _CONSOLIDATED_DIR))
    torch.save(train_loader.state_dict(), tmp / _LOADER_FILE)
    return checkpointer.finalize_checkpoint(tmp)
