"""The training loop's logger: one object fanning metrics out to every enabled backend.

``Logger(cfg)`` builds the backends the ``logger`` section enables (``metrics.jsonl``, TensorBoard, W&B,
SwanLab, MLflow) and the console (:mod:`nemo_rl.utils.loggers.console`: a line per step by default, every
metric with ``logger.console=full``), starts the resource monitor, and on :meth:`Logger.close` writes
``<log_dir>/training_curves.png`` and prints the run's summary. With every backend off it is a null object:
every call is a no-op.

Example::

    logger = Logger(cfg.logger)
    logger.log_hyperparams(cfg.model_dump())
    progress = logger.progress_bar(total=max_steps, initial=start, desc="grpo")
    for step in range(start + 1, max_steps + 1):
        ...
        logger.log_metrics({"loss": loss, "reward": reward}, step, prefix="train")   # "train/loss"
        logger.log_metrics(timer.get_timing_metrics("sum"), step, prefix="timing/train")
        progress.update(1)  # advances the bar and prints the step's line
    progress.close()
    logger.close()
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tqdm import tqdm

from nemo_rl.config.logger import LoggerConfig
from nemo_rl.utils.loggers.base import LoggerBackend, prefixed, require_package
from nemo_rl.utils.loggers.console import Console
from nemo_rl.utils.loggers.jsonl import METRICS_FILE, JsonlBackend
from nemo_rl.utils.plotting import load_metrics_jsonl, plot_training_curves
from nemo_rl.utils.resource_monitor import ResourceMonitor

__all__ = ["PLOT_FILE", "Logger", "LoggerBackend", "StepProgress", "to_scalar"]

PLOT_FILE = "training_curves.png"


def to_scalar(name: str, value: Any) -> float:
    """``value`` as a float: Python numbers, and one-element tensors or arrays (via ``.item()``)."""
    if isinstance(value, bool | int | float):
        return float(value)
    item = getattr(value, "item", None)
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    num_elements = numel() if callable(numel) else numel
    if callable(item) and num_elements == 1:
        return float(item())
    raise TypeError(
        f"Metric {name!r} is a {type(value).__name__}, not a scalar; log one number per name "
        "(e.g. reduce a per-sample list to its mean) or dump samples with log_batched_dict_as_jsonl()."
    )


def _jsonable(value: Any) -> Any:
    """Tensors and arrays as nested lists, their scalars as numbers; other values unchanged."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


# Per enabled flag: the module its backend imports and the command that installs it.
_BACKEND_PACKAGES = {
    "tensorboard_enabled": ("tensorboard", "uv sync"),
    "wandb_enabled": ("wandb", "uv sync"),
    "swanlab_enabled": ("swanlab", "uv sync"),
    "mlflow_enabled": ("mlflow", "uv sync --extra mlflow"),
}


def _build_backends(cfg: LoggerConfig, log_dir: Path) -> list[LoggerBackend]:
    """The enabled backends, after checking every needed package so a missing one fails before any starts."""
    for flag, (module, install_hint) in _BACKEND_PACKAGES.items():
        if getattr(cfg, flag):
            require_package(module, f"logger.{flag}", install_hint)
    backends: list[LoggerBackend] = []
    try:
        if cfg.jsonl_enabled:
            backends.append(JsonlBackend(log_dir))
        if cfg.tensorboard_enabled:
            from nemo_rl.utils.loggers.tensorboard_backend import TensorboardBackend

            backends.append(TensorboardBackend(cfg.tensorboard, log_dir))
        if cfg.wandb_enabled:
            from nemo_rl.utils.loggers.wandb_backend import WandbBackend

            backends.append(WandbBackend(cfg.wandb, log_dir))
        if cfg.swanlab_enabled:
            from nemo_rl.utils.loggers.swanlab_backend import SwanlabBackend

            backends.append(SwanlabBackend(cfg.swanlab, log_dir))
        if cfg.mlflow_enabled:
            from nemo_rl.utils.loggers.mlflow_backend import MlflowBackend

            backends.append(MlflowBackend(cfg.mlflow, log_dir))
    except BaseException:
        # Finish the runs already started (e.g. a W&B run) so a failed start-up leaves no dangling run.
        for backend in backends:
            backend.close()
        raise
    return backends


class Logger:
    """Fans metrics, hyperparameters and sample dumps out to the enabled backends.

    ``extra_backends`` adds user-supplied :class:`LoggerBackend` objects next to the configured ones.
    Safe to call from several threads (the resource monitor logs from its own).
    """

    def __init__(self, cfg: LoggerConfig, extra_backends: Sequence[LoggerBackend] = ()) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self._console: Console | None = Console(cfg.console) if cfg.console_enabled else None
        self._backends: list[LoggerBackend] = [*_build_backends(cfg, self.log_dir), *extra_backends]
        self._lock = threading.RLock()
        self._last_step = 0
        self._closed = False
        # Kept only when metrics.jsonl is off, so the end-of-run plot still has data.
        self._plot_records: list[dict[str, float]] = []
        self._monitor: ResourceMonitor | None = None
        if cfg.monitor_gpus and self._backends:
            self._monitor = ResourceMonitor(cfg.gpu_monitoring, self._log_system_metrics)
            self._monitor.start()

    @classmethod
    def disabled(cls) -> Logger:
        """A logger with every backend and the monitor off: all calls are no-ops."""
        return cls(
            LoggerConfig(console_enabled=False, jsonl_enabled=False, monitor_gpus=False, progress_bar=False)
        )

    @property
    def enabled(self) -> bool:
        """Whether any backend (console included) receives metrics."""
        return self._console is not None or bool(self._backends)

    @property
    def metrics_path(self) -> Path:
        """Where the JSONL backend writes (``<log_dir>/metrics.jsonl``)."""
        return self.log_dir / METRICS_FILE

    # --------------------------------------------------------------- metrics
    def log_metrics(self, metrics: Mapping[str, Any], step: int, prefix: str = "") -> None:
        """Log scalar ``metrics`` at ``step`` as ``<prefix>/<name>`` (``prefix="train"`` -> ``train/loss``).

        Values may be Python numbers or one-element tensors/arrays; anything else is a ``TypeError``.
        """
        if not self.enabled:
            return
        scalars = {name: to_scalar(name, value) for name, value in metrics.items()}
        self._fan_out(scalars, step, prefix, to_console=True)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's config (a nested dict, e.g. ``master_config.model_dump(mode="json")``)."""
        with self._lock:
            for backend in self._backends:
                backend.log_hyperparams(dict(params))

    def _fan_out(self, metrics: dict[str, float], step: int, prefix: str, to_console: bool) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("Logger.log_metrics() called after close().")
            self._last_step = max(self._last_step, step)
            if to_console and self._console is not None:
                _print(self._console.log_metrics(metrics, step, prefix))
            for backend in self._backends:
                backend.log_metrics(metrics, step, prefix)
            if not self.cfg.jsonl_enabled and self.cfg.plot_metrics:
                wanted = {k: v for k, v in prefixed(metrics, prefix).items() if k in self.cfg.plot_metrics}
                if wanted:
                    self._plot_records.append({"step": step, **wanted})

    def _log_system_metrics(self, metrics: dict[str, float]) -> None:
        # Resource samples are not tied to a step: attach them to the latest one, which keeps steps
        # non-decreasing for W&B, and keep them off the console where they would interleave with the tables.
        with self._lock:
            if self._closed:
                return
            self._fan_out(metrics, self._last_step, "system", to_console=False)

    # --------------------------------------------------------- sample dumps
    def log_batched_dict_as_jsonl(self, to_log: Mapping[str, Any], filename: str) -> Path | None:
        """Write a batch (dict of tensors/lists, dim 0 = sample) to ``<log_dir>/<filename>``, one sample per line.

        Typically generations with their rewards: ``logger.log_batched_dict_as_jsonl(batch,
        f"train_data_step{step}.jsonl")``. Returns the path, or ``None`` for a disabled logger.
        """
        if not self._backends:
            return None
        columns = {key: _jsonable(value) for key, value in to_log.items()}
        sizes = {key: len(column) for key, column in columns.items() if isinstance(column, list)}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"Batch columns have different lengths {sizes}; every column needs one entry per sample."
            )
        num_samples = next(iter(sizes.values()), 0)
        lines = []
        for index in range(num_samples):
            row = {
                key: column[index] if isinstance(column, list) else column for key, column in columns.items()
            }
            lines.append(json.dumps(row, default=str))
        return self._write_text(filename, lines)

    def log_string_list_as_jsonl(self, to_log: Sequence[str], filename: str) -> Path | None:
        """Write strings to ``<log_dir>/<filename>`` as one JSON string per line (``None`` when disabled)."""
        if not self._backends:
            return None
        return self._write_text(filename, [json.dumps(text) for text in to_log])

    def _write_text(self, filename: str, lines: list[str]) -> Path:
        path = self.log_dir / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in lines))
        return path

    def print_samples(self, samples: Sequence[str], step: int, title: str = "validation samples") -> None:
        """Print the first ``num_val_samples_to_print`` of ``samples`` (e.g. prompt + response texts)."""
        num_to_print = min(self.cfg.num_val_samples_to_print, len(samples))
        if num_to_print == 0 or self._console is None:
            return
        tqdm.write(f"══ step {step} · {title} ({num_to_print} of {len(samples)}) ══")
        for index, sample in enumerate(samples[:num_to_print]):
            tqdm.write(f"── sample {index} ──\n{sample}")

    # ------------------------------------------------------------- progress
    def progress_bar(self, *, total: int | None = None, initial: int = 0, desc: str = "step") -> StepProgress:
        """The progress of a training loop named ``desc`` over ``total`` steps: a tqdm bar (step/total, ETA, the
        key figures) that, on each :meth:`StepProgress.update`, also prints the finished step's console line.

        The bar is hidden when ``progress_bar`` is off and when stderr is not a terminal (batch jobs), where
        it would only fill the log file; the step lines are printed either way while the console is on.
        """
        disable: bool | None = None if self.cfg.progress_bar else True
        bar: tqdm[None] = tqdm(total=total, initial=initial, desc=desc, disable=disable, dynamic_ncols=True)
        if self._console is not None:
            with self._lock:
                _print(self._console.start_loop(desc, total))
        return StepProgress(bar, self._finish_step)

    def _finish_step(self) -> str:
        """Print the lines of the step just finished; returns the bar's key figures."""
        if self._console is None:
            return ""
        with self._lock:
            _print(self._console.finish_step())
            return self._console.postfix()

    # -------------------------------------------------------------- closing
    def close(self) -> Path | None:
        """Stop the monitor, write the training-curve plot, close every backend; returns the plot path."""
        if self._monitor is not None:
            self._monitor.stop()
            self._monitor = None
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            plot_path = self._write_plot()
            for backend in self._backends:
                backend.close()
            if self._console is not None:
                files = [("metrics", str(self.metrics_path))] if self.cfg.jsonl_enabled else []
                files += [("curves", str(plot_path))] if plot_path is not None else []
                _print(self._console.close() + self._console.summary(files))
            return plot_path

    def _write_plot(self) -> Path | None:
        if not self.cfg.plot_metrics or not self._backends:
            return None
        if self.cfg.jsonl_enabled:
            records: list[dict[str, Any]] = load_metrics_jsonl(self.metrics_path)
        else:
            records = list(self._plot_records)
        return plot_training_curves(records, self.cfg.plot_metrics, self.log_dir / PLOT_FILE)

    def __enter__(self) -> Logger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _print(lines: list[str]) -> None:
    # tqdm.write keeps a progress bar on the terminal below the printed lines.
    for line in lines:
        tqdm.write(line)
    if lines:
        sys.stdout.flush()


class StepProgress:
    """A training loop's progress bar (:meth:`Logger.progress_bar`): :meth:`update` after each step."""

    def __init__(self, bar: tqdm[None], finish_step: Callable[[], str]) -> None:
        self.bar = bar
        """The tqdm bar (disabled when hidden)."""
        self._finish_step = finish_step
        self._n = int(bar.n)

    def update(self, n: int = 1) -> None:
        """Count ``n`` finished steps: print their console lines, then advance the bar with its key figures."""
        postfix = self._finish_step()
        if postfix:
            self.bar.set_postfix_str(postfix, refresh=False)
        self.bar.update(n)
        self._n += n

    def close(self) -> None:
        """Remove the bar from the terminal (the printed lines stay)."""
        self.bar.close()

    @property
    def disable(self) -> bool:
        """Whether the bar is hidden."""
        return bool(self.bar.disable)

    @property
    def n(self) -> int:
        """Steps counted so far, the initial ones included."""
        return self._n  # a hidden tqdm bar does not count

    @property
    def total(self) -> int | None:
        """Steps of the whole run."""
        return None if self.bar.total is None else int(self.bar.total)
