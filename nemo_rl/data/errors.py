"""Errors that report bad data: a missing or unreadable data file, or a row its dataset's schema rejects.

They live with :class:`~nemo_rl.config.errors.UserError` in the bottom layer (the tokenizer of ``models``
reports a bad chat-template file with them too) and are re-exported here, where the data code names them.
"""

from __future__ import annotations

from nemo_rl.config.errors import DataError, MissingDataFileError

__all__ = ["DataError", "MissingDataFileError"]
