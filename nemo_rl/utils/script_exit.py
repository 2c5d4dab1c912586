"""The end of an example script's process: every exit handler runs, Python's own teardown does not.

After the last exit handler (Ray's shutdown, the loggers' flush, multiprocessing's children, temporary
directories) a normal interpreter exit still tears down every module and frees every object one by one: with
torch, transformers and Ray loaded that is 0.8-2 s of CPU and several seconds on a busy machine
(benchmarks/README.md, "Time to the first step"), spent after the run's last line was printed and its files
were written. :func:`run_script` ends the process right after the exit handlers instead, with the status a
normal exit would have had.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable

from nemo_rl.config.cli import run_cli


def run_script(main_fn: Callable[[], object]) -> None:
    """Run ``main_fn`` as :func:`~nemo_rl.config.cli.run_cli` does (a user error exits 2 with one line), then
    end the process without the interpreter's teardown (see the module).

    An exception other than ``SystemExit`` propagates: Python prints its traceback and exits 1 (130 for
    Ctrl-C) the ordinary way, teardown included. So does everything when ``main_fn``'s file is not the program
    Python was started with (``sys.orig_argv``): a test that runs the script in its own process with ``runpy``
    gets ``main_fn``'s return (or catches its ``SystemExit``) and goes on, and its process exits as it would
    have.
    """
    arm = _is_the_program(main_fn)
    try:
        run_cli(main_fn)
    except SystemExit as stop:
        if arm:
            _exit_after_handlers(stop)
        raise
    if arm:
        _exit_after_handlers(SystemExit(0))
        sys.exit(0)


def _is_the_program(main_fn: Callable[[], object]) -> bool:
    """Whether ``main_fn`` is defined in the script this Python process was started to run."""
    script = os.path.realpath(main_fn.__code__.co_filename)
    return any(os.path.realpath(arg) == script for arg in sys.orig_argv[1:])


def _exit_after_handlers(stop: SystemExit) -> None:
    """Make the coming exit end the process right after the exit handlers, with ``stop``'s status.

    Python runs non-daemon threads to their end and then the ``atexit`` handlers in reverse order of
    registration; the one registered here is the last, so it runs first: it runs the others itself, flushes
    the standard streams (which teardown would have done) and ends the process.
    """
    code = stop.code
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        # As Python does for sys.exit("message"): the message on stderr, status 1.
        status = 1

    def finish() -> None:
        atexit.unregister(finish)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(status)

    atexit.register(finish)
