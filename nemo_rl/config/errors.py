"""Errors that report bad user input.

Anything a user can fix by editing a config, a command line or a file path raises a :class:`UserError`
subclass. Example scripts run under :func:`nemo_rl.config.cli.run_cli`, which prints such errors as one
message on stderr and exits with status 2, without a traceback: the message itself must say what is wrong
and what to do. Bugs (anything else) still surface with their full traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Base class for errors caused by bad user input (config, command line, paths, data files).

    Other modules raise it (or a subclass) for input the user can fix; the message is shown as is.
    """


class ConfigError(UserError):
    """A config could not be loaded, overridden or validated.

    ``problems`` holds one line per independent problem, so several mistakes are reported at once.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        self.problems: list[str] = list(problems) if problems else []
        full = message
        if self.problems:
            full += "".join(f"\n  - {p}" for p in self.problems)
        super().__init__(full)


class DataError(UserError, ValueError):
    """A data file or one of its rows cannot be used; the message names the file and what to change."""


class MissingDataFileError(UserError, FileNotFoundError):
    """A data, prompt or system-prompt file named in the config does not exist."""
