"""Command line of the example scripts: ``--config PATH`` plus Hydra-grammar overrides.

Typical script::

    from nemo_rl.config.cli import parse_args_and_load, run_cli

    def main() -> None:
        cfg, resolved = parse_args_and_load(MasterConfig, Path(__file__).parent / "configs/grpo_math_1B.yaml")
        from nemo_rl.algorithms.grpo import setup, grpo_train  # heavy imports after the config is checked
        ...

    if __name__ == "__main__":
        run_cli(main)

A config mistake then ends the script within seconds with one clear message and exit status 2. Keys the
config sets that are accepted but have no effect here (:mod:`nemo_rl.config.no_effect`) are listed once on
stderr. ``--dry-run`` stops right after validation: it prints the resolved config, that list and the memory plan
(:mod:`nemo_rl.config.memory_plan`) and exits 0, or 2 when the plan does not fit the device, without
importing the training stack, starting Ray or touching the model hub.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import ParamSpec, TypeVar

from omegaconf import DictConfig
from pydantic import BaseModel

from nemo_rl.config.errors import ConfigError, UserError
from nemo_rl.config.keys import schema_keys
from nemo_rl.config.loader import format_config, load_and_resolve
from nemo_rl.config.memory_plan import check_plan, format_plan, plan_config
from nemo_rl.config.no_effect import format_no_effect, no_effect_settings, report_no_effect

ModelT = TypeVar("ModelT", bound=BaseModel)
P = ParamSpec("P")
R = TypeVar("R")

USER_ERROR_EXIT_CODE = 2
"""Exit status of a script stopped by bad user input (as argparse uses for usage errors)."""

_CONFIG_FLAG = "--config"
_DRY_RUN_FLAG = "--dry-run"


def split_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Split command-line arguments into the ``--config`` path (``None`` if absent) and the overrides.

    Raises:
        ConfigError: ``--config`` without a path or given twice, or an unknown ``-``/``--`` option.
    """
    config: str | None = None
    overrides: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        value: str | None = None
        if arg == _CONFIG_FLAG:
            if i + 1 >= len(args) or not args[i + 1] or args[i + 1].startswith("-"):
                raise ConfigError(f"{_CONFIG_FLAG} needs a path: {_CONFIG_FLAG} path/to/config.yaml")
            value = args[i + 1]
            i += 1
        elif arg.startswith(_CONFIG_FLAG + "="):
            value = arg.split("=", 1)[1]
            if not value:
                raise ConfigError(f"{_CONFIG_FLAG}= needs a path: {_CONFIG_FLAG}=path/to/config.yaml")
        elif arg.startswith("-"):
            raise ConfigError(
                f"unknown option {arg!r}: the options are {_CONFIG_FLAG} PATH and {_DRY_RUN_FLAG}; every other "
                "argument is an override such as policy.model_name=NAME, +new.key=1, ++key=1 or ~key"
            )
        else:
            overrides.append(arg)
        if value is not None:
            if config is not None:
                raise ConfigError(
                    f"{_CONFIG_FLAG} given twice ({config!r} and {value!r}); give one config file"
                )
            config = value
        i += 1
    return config, overrides


def usage(schema_cls: type[BaseModel], default_config: str | Path) -> str:
    """Help text: the command-line form, the default config and the top-level config sections."""
    prog = Path(sys.argv[0]).name or "script.py"
    sections = [k.dotted for k in schema_keys(schema_cls) if len(k.parts) == 1]
    return (
        f"usage: python {prog} [{_CONFIG_FLAG} PATH] [{_DRY_RUN_FLAG}] [key=value | +key=value | ++key=value | ~key ...]\n\n"
        f"  {_CONFIG_FLAG} PATH   YAML recipe to load (default: {default_config})\n"
        f"  {_DRY_RUN_FLAG}       validate, print the resolved config, the keys with no effect here and the memory plan\n"
        "  key=value       change a key (dotted, e.g. policy.train_global_batch_size=64)\n"
        "  +key=value      add a key that is not set yet\n"
        "  ++key=value     set a key whether or not it is set\n"
        "  ~key            delete a key\n\n"
        f"Config sections: {', '.join(sections)}\n"
    )


def parse_args_and_load(
    schema_cls: type[ModelT], default_config: str | Path, argv: Sequence[str] | None = None
) -> tuple[ModelT, DictConfig]:
    """Load the config named on the command line (or ``default_config``), apply the overrides, validate.

    ``argv`` defaults to ``sys.argv[1:]``. ``-h``/``--help`` prints the usage and exits with status 0;
    ``--dry-run`` prints the resolved config, the keys that have no effect here and the memory plan, and exits
    with status 0 (2 when the plan does not fit the device).
    Otherwise the keys that have no effect here are listed once on stderr.

    Returns:
        The typed config and the fully resolved DictConfig.

    Raises:
        ConfigError: for a bad command line, a bad file, unknown keys, wrong types or failed checks.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(usage(schema_cls, default_config))
        sys.exit(0)
    dry_run = _DRY_RUN_FLAG in args
    config, overrides = split_args([arg for arg in args if arg != _DRY_RUN_FLAG])
    model, resolved = load_and_resolve(
        config if config is not None else default_config, schema_cls, overrides
    )
    if dry_run:
        print(format_config(model), end="")  # every key, defaults included
        print(format_no_effect(no_effect_settings(model)), flush=True)
        print_memory_plan(model)
        sys.exit(0)
    report_no_effect(model)
    return model, resolved


def print_memory_plan(model: BaseModel) -> None:
    """Print the memory plan of ``model`` (or the one line saying why there is none) and check it.

    Raises:
        ConfigError: the plan's peak exceeds the device memory (naming the largest term and what cuts it).
    """
    plan = plan_config(model)
    if isinstance(plan, str):
        print(plan, flush=True)
        return
    print(format_plan(plan), end="", flush=True)
    check_plan(plan)


def report_user_error(err: BaseException) -> None:
    """Print ``err`` as the one line a script's user error ends with: ``<script>: error: <message>``."""
    # A UserError raised inside a Ray actor arrives as a RayTaskError that also derives from the original
    # class; its `cause` is the original error, whose message has no remote traceback in it.
    cause = getattr(err, "cause", None)
    shown = cause if isinstance(cause, UserError) else err
    prog = Path(sys.argv[0]).name or "nemo_rl"
    sys.stdout.flush()
    print(f"{prog}: error: {shown}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn a :class:`UserError` raised in the block into a message on stderr and exit status 2.

    Other exceptions (bugs) propagate unchanged, with their traceback.
    """
    try:
        yield
    except UserError as err:
        report_user_error(err)
        sys.exit(USER_ERROR_EXIT_CODE)


def run_cli(main_fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Call ``main_fn(*args, **kwargs)``; a :class:`UserError` ends the process with a message and status 2."""
    try:
        return main_fn(*args, **kwargs)
    except UserError as err:
        report_user_error(err)
        sys.exit(USER_ERROR_EXIT_CODE)
