"""Errors that report bad data: a missing or unreadable data file, or a row its dataset's schema rejects.

Both derive from :class:`~nemo_rl.config.errors.UserError`, so the example scripts show them as one line and
exit with status 2; they keep the built-in type a caller would catch (``ValueError``, ``FileNotFoundError``).
"""

from __future__ import annotations

from nemo_rl.config.errors import UserError


class DataError(UserError, ValueError):
    """A data file or one of its rows cannot be used; the message names the file and what to change."""


class MissingDataFileError(UserError, FileNotFoundError):
    """A data, prompt or system-prompt file named in the config does not exist."""
