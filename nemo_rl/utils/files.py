"""Opening the files a recipe names (data files, prompt files, chat templates) with errors a user can act on.

Every check here raises a :class:`~nemo_rl.data.errors.DataError` or
:class:`~nemo_rl.data.errors.MissingDataFileError`, so an example script ends with one line naming the file (and
the config key that names it, or the line at fault) and exit status 2. Files are only read, never changed.
"""

from __future__ import annotations

import pathlib

from nemo_rl.config.errors import DataError, MissingDataFileError


def named(path: str | pathlib.Path, key: str | None) -> str:
    """How a message names a file: ``key=path`` when a config key names it, else the path."""
    return f"{key}={path}" if key else str(path)


def existing_file(path: str | pathlib.Path, *, key: str | None, kind: str = "file") -> pathlib.Path:
    """``path`` (``~`` expanded) as a :class:`~pathlib.Path` once it is known to be a regular file; messages name
    ``path`` as given.

    Raises:
        MissingDataFileError: nothing exists at ``path``.
        DataError: ``path`` is a directory (or another non-file); ``kind`` says what to give instead.
    """
    file = pathlib.Path(path).expanduser()
    if not file.exists():
        raise MissingDataFileError(f"{named(path, key)} does not exist: give the path of a {kind}")
    if file.is_dir():
        raise DataError(f"{named(path, key)} is a directory: give the path of a {kind} in it")
    if not file.is_file():
        raise DataError(f"{named(path, key)} is not a regular file: give the path of a {kind}")
    return file


def read_utf8(file: pathlib.Path) -> str:
    """The file's text.

    Raises:
        DataError: a byte that is not UTF-8, naming its line (1-based) and offset.
    """
    data = file.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(
            f"{file}: line {line} is not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}): "
            "save the file as UTF-8"
        ) from err
