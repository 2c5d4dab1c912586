"""What a run prints on stdout: one line per training step, a line per validation, a summary at the end.

:class:`Console` turns the metrics a :class:`~nemo_rl.utils.logger.Logger` receives into text; the logger
prints it (through tqdm, so a progress bar stays intact). Two modes (``logger.console``):

- ``compact`` (the default): a training step is one line, its key figures only::

      [grpo  37/100] reward 0.2617 · loss 0.001982 · len 16.8 · lr 2.8e-04 · 3,606 tok/s · 4.75 s

  a validation is one line with its headline metric, where it started and its best so far::

      [grpo  40/100] validation: accuracy 0.2891 (step 0: 0.2148, best 0.2891) · 256 samples · 1.25 s

  and other metrics (refit, evaluation, system) reach the backends only.
- ``full``: every ``log_metrics`` call as a table of all its metrics, as it arrives.

Both end the run with a short table (:meth:`Console.summary`): the key metrics at the start and the end of
training and the best validation. The console only reads metrics; every backend receives them unchanged.
"""

from __future__ import annotations

import math
import shutil
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

ConsoleMode = Literal["compact", "full"]

# A step line's figures, in order: (metric under train/, label). A loop shows those it logs, so GRPO and
# distillation lead with the reward, DPO and reward models with pairwise accuracy, SFT with the loss; PPO adds
# its critic's loss and how much of the returns' variance the critic explains.
TRAIN_FIGURES: tuple[tuple[str, str], ...] = (
    ("reward", "reward"),
    ("accuracy", "acc"),
    ("loss", "loss"),
    ("critic/loss", "critic loss"),
    ("critic/explained_var", "critic ev"),
    ("mean_gen_tokens_per_sample", "len"),
)
# A validation's headline candidates, first present first: the line shows its start and best values.
VALIDATION_FIGURES: tuple[str, ...] = ("accuracy", "val_loss", "loss")
# What a validation line counts, first present: (metric under validation/, unit).
VALIDATION_COUNTS: tuple[tuple[str, str], ...] = (
    ("num_samples", "samples"),
    ("num_valid_samples", "samples"),
    ("num_valid_tokens", "tokens"),
)
# Metrics a step line reads from the loop's other prefixes.
_STEP_TIME = "timing/train/total_step_time"
_TOKENS_PER_S = "performance/tokens_per_sec"
_STEP_PREFIXES = ("train", "timing/train", "performance")
# Steps averaged for the summary's start and end of a training metric (fewer in shorter runs).
_SUMMARY_WINDOW = 10


def format_number(value: float) -> str:
    """A metric value to three significant digits: ``0.262``, ``16.8``, ``-0.000612``, ``1.5e-05``; whole
    numbers and values from 1,000 up without decimals (``3,606``)."""
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000 or (value == int(value) and abs(value) < 1e15):
        return f"{value:,.0f}"
    return f"{value:.3g}"


def format_duration(seconds: float) -> str:
    """``42.1 s``, ``3m08s``, ``2h05m``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _format_table_value(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


def format_metrics_table(metrics: Mapping[str, float], step: int, prefix: str, width: int) -> str:
    """A header line naming the step and prefix, then ``name value`` cells packed into columns."""
    title = f" step {step}" + (f" · {prefix.rstrip('/')} " if prefix else " ")
    header = f"──{title}".ljust(min(width, 80), "─")
    if not metrics:
        return header
    names = list(metrics)
    values = [_format_table_value(metrics[name]) for name in names]
    name_w = max(len(n) for n in names)
    value_w = max(len(v) for v in values)
    cell_w = name_w + 1 + value_w
    num_columns = max(1, (width + 3) // (cell_w + 3))
    cells = [f"{n.ljust(name_w)} {v.rjust(value_w)}" for n, v in zip(names, values, strict=True)]
    rows = [" | ".join(cells[i : i + num_columns]) for i in range(0, len(cells), num_columns)]
    return "\n".join([header, *rows])


def _lower_is_better(name: str) -> bool:
    return "loss" in name


@dataclass
class _Validation:
    step: int
    metrics: dict[str, float]


@dataclass
class _Run:
    """What the console remembers of the training loop: enough for the step lines and the summary."""

    name: str = "train"
    total_steps: int | None = None
    open_steps: dict[int, dict[str, float]] = field(default_factory=dict)
    """Steps whose metrics are still arriving: ``train/*``, ``timing/train/*``, ``performance/*`` by name."""
    held_validations: list[_Validation] = field(default_factory=list)
    """Validations of a step still open, printed after its step line (or, before the loop starts, with it)."""
    started: bool = False
    """Whether :meth:`Console.start_loop` was called; validations before it wait for the loop's name."""
    last_finished_step: int = -1
    figures: dict[str, list[float]] = field(default_factory=dict)
    """Per finished step, each step-line figure it had (``train/reward``, ``tokens/s``...)."""
    step_times_s: list[float] = field(default_factory=list)
    validations: list[_Validation] = field(default_factory=list)


class Console:
    """Formats what the logger prints; every method returns the lines to print (possibly none).

    Args:
        mode: ``compact`` or ``full`` (see the module docstring).
        width: Terminal width for ``full`` tables; ``None`` asks the terminal each time.
    """

    def __init__(self, mode: ConsoleMode = "compact", width: int | None = None) -> None:
        self.mode = mode
        self._width = width
        self._run = _Run()

    def start_loop(self, name: str, total_steps: int | None) -> list[str]:
        """A training loop named ``name`` begins (its progress bar is created); it runs to ``total_steps``.
        Returns the validations logged before it (the loop's validation at step 0), now tagged with its name."""
        self._run.name = name
        self._run.total_steps = total_steps
        self._run.started = True
        held, self._run.held_validations = self._run.held_validations, []
        return [self._validation_line(v) for v in held] if self.mode == "compact" else []

    def log_metrics(self, metrics: Mapping[str, float], step: int, prefix: str) -> list[str]:
        """Take one ``Logger.log_metrics`` call; returns what to print now."""
        stem = prefix.rstrip("/")
        lines: list[str] = []
        if stem == "train":
            # A new step's metrics mean the earlier ones are complete (a loop without a progress bar).
            lines += self._finish_steps(before=step)
        if stem in _STEP_PREFIXES:
            record = self._run.open_steps.setdefault(step, {})
            record.update({f"{stem}/{name}": value for name, value in metrics.items()})
        if self.mode == "full":
            width = self._width or shutil.get_terminal_size((110, 24)).columns
            lines.append(format_metrics_table(metrics, step, prefix, width))
        if stem == "validation":
            validation = _Validation(step, dict(metrics))
            self._run.validations.append(validation)
            if self.mode == "compact":
                # Shown after its step's line; or, logged before the loop began, once the loop has its name.
                if not self._run.started or step > self._run.last_finished_step:
                    self._run.held_validations.append(validation)
                else:
                    lines.append(self._validation_line(validation))
        return lines

    def finish_step(self) -> list[str]:
        """The loop finished a step (its progress bar advanced): the lines of every step still open."""
        return self._finish_steps(before=None)

    def _finish_steps(self, before: int | None) -> list[str]:
        run = self._run
        lines: list[str] = []
        for step in sorted(run.open_steps):
            if before is not None and step >= before:
                break
            record = run.open_steps.pop(step)
            if not any(name.startswith("train/") for name in record):
                continue  # timings without a training step (a loop's own extra logging)
            run.last_finished_step = max(run.last_finished_step, step)
            figures = self._step_figures(record)
            for name, value in figures.items():
                run.figures.setdefault(name, []).append(value)
            if _STEP_TIME in record:
                run.step_times_s.append(record[_STEP_TIME])
            if self.mode == "compact":
                lines.append(self._step_line(step, record, figures))
            held = [v for v in run.held_validations if v.step <= step]
            run.held_validations = [v for v in run.held_validations if v.step > step]
            lines += [self._validation_line(v) for v in held] if self.mode == "compact" else []
        return lines

    @staticmethod
    def _step_figures(record: Mapping[str, float]) -> dict[str, float]:
        figures = {
            f"train/{name}": record[f"train/{name}"] for name, _ in TRAIN_FIGURES if f"train/{name}" in record
        }
        if _TOKENS_PER_S in record:
            figures["tokens/s"] = record[_TOKENS_PER_S]
        elif "train/num_valid_tokens" in record and record.get(_STEP_TIME, 0.0) > 0:
            # Loops that do not report throughput themselves: the tokens they trained on per second.
            figures["tokens/s"] = record["train/num_valid_tokens"] / record[_STEP_TIME]
        return figures

    def _tag(self, step: int) -> str:
        total = self._run.total_steps
        if total is None:
            return f"[{self._run.name} {step}]"
        return f"[{self._run.name} {step:>{len(str(total))}}/{total}]"

    def _step_line(self, step: int, record: Mapping[str, float], figures: Mapping[str, float]) -> str:
        parts = [
            f"{label} {format_number(figures[f'train/{name}'])}"
            for name, label in TRAIN_FIGURES
            if f"train/{name}" in figures
        ]
        if "train/lr" in record:
            parts.append(f"lr {record['train/lr']:.1e}")
        if "tokens/s" in figures:
            parts.append(f"{figures['tokens/s']:,.0f} tok/s")
        if _STEP_TIME in record:
            parts.append(f"{record[_STEP_TIME]:.2f} s")
        return f"{self._tag(step)} " + " · ".join(parts)

    def _validation_line(self, validation: _Validation) -> str:
        metrics = validation.metrics
        parts: list[str] = []
        headline = next((name for name in VALIDATION_FIGURES if name in metrics), None)
        for name in VALIDATION_FIGURES:
            if name not in metrics:
                continue
            text = f"{name} {format_number(metrics[name])}"
            if name == headline:
                history = [(v.step, v.metrics[name]) for v in self._run.validations if name in v.metrics]
                if len(history) > 1:
                    best = (min if _lower_is_better(name) else max)(value for _, value in history)
                    text += (
                        f" (step {history[0][0]}: {format_number(history[0][1])}, best {format_number(best)})"
                    )
            parts.append(text)
        if headline is None:  # a loop with other validation metrics: its first few
            parts += [f"{name} {format_number(value)}" for name, value in list(metrics.items())[:4]]
        count = next(((metrics[n], unit) for n, unit in VALIDATION_COUNTS if n in metrics), None)
        if count is not None:
            parts.append(f"{format_number(count[0])} {count[1]}")
        if "time_s" in metrics:
            parts.append(f"{metrics['time_s']:.2f} s")
        return f"{self._tag(validation.step)} validation: " + " · ".join(parts)

    def postfix(self) -> str:
        """The progress bar's key figures: the latest step's headline and the latest validation's."""
        run = self._run
        parts = []
        for name, label in TRAIN_FIGURES[:3]:
            values = run.figures.get(f"train/{name}")
            if values:
                parts.append(f"{label} {format_number(values[-1])}")
                break
        if run.validations:
            last = run.validations[-1].metrics
            headline = next((n for n in VALIDATION_FIGURES if n in last), None)
            if headline is not None:
                parts.append(f"val {headline} {format_number(last[headline])}")
        return " · ".join(parts)

    def close(self) -> list[str]:
        """The lines of steps still open (a loop that logged without a progress bar) and held validations."""
        lines = self._finish_steps(before=None)
        held, self._run.held_validations = self._run.held_validations, []
        return lines + ([self._validation_line(v) for v in held] if self.mode == "compact" else [])

    def summary(self, files: Sequence[tuple[str, str]] = ()) -> list[str]:
        """The end-of-run table; ``files`` are ``(what, path)`` pairs named below it. Empty without steps."""
        run = self._run
        num_steps = max((len(v) for v in run.figures.values()), default=0)
        if num_steps == 0:
            return []
        window = max(1, min(_SUMMARY_WINDOW, num_steps // 5))
        first_step = run.last_finished_step - num_steps + 1
        head = f"── {run.name}: steps {first_step}-{run.last_finished_step}"
        head += f" of {run.total_steps}" if run.total_steps else ""
        if run.step_times_s:
            head += (
                f" in {format_duration(sum(run.step_times_s))} "
                f"(median step {statistics.median(run.step_times_s):.2f} s)"
            )
        rows: list[tuple[str, str, str, str]] = [("metric", "start", "end", "best")]
        for name, values in run.figures.items():
            start = statistics.fmean(values[:window])
            end = statistics.fmean(values[-window:])
            rows.append((name, format_number(start), format_number(end), ""))
        validation_names = [n for n in VALIDATION_FIGURES if any(n in v.metrics for v in run.validations)]
        for name in validation_names:
            history = [(v.step, v.metrics[name]) for v in run.validations if name in v.metrics]
            pick = min if _lower_is_better(name) else max
            best_step, best = pick(history, key=lambda item: item[1])  # the earliest of equal values
            rows.append(
                (
                    f"validation/{name}",
                    format_number(history[0][1]),
                    format_number(history[-1][1]),
                    f"{format_number(best)} (step {best_step})",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [head + " " + "─" * max(3, 78 - len(head))]
        for row in rows:
            cells = [
                row[0].ljust(widths[0]),
                *(cell.rjust(w) for cell, w in zip(row[1:3], widths[1:3], strict=True)),
            ]
            lines.append(("  " + "  ".join(cells) + "  " + row[3]).rstrip())
        notes = f"train: means of the first and last {window} step{'s' if window > 1 else ''}"
        if validation_names:
            first, last = run.validations[0].step, run.validations[-1].step
            notes += (
                f"; validation: steps {first} and {last}" if first != last else f"; validation: step {last}"
            )
        lines.append(f"  ({notes})")
        lines += [f"  {what}: {path}" for what, path in files]
        return lines
