"""Images of multimodal rows: read from whatever a row holds, and checked before any training work.

A row's image may be a path (``str`` / ``pathlib.Path``, optionally ``file://``), raw encoded bytes, a PIL
image, or a Hugging Face ``datasets`` ``Image`` feature (decoded: a PIL image; undecoded: a
``{"bytes": ..., "path": ...}`` dict). :func:`load_image` turns each into an RGB PIL image or raises a
:class:`BadImageError` whose one line names the row and the file and says what to do, for each way an image
can be unusable:

- missing: the file does not exist;
- not an image: PIL cannot identify or decode it;
- wrong mode: a pixel format the processor would convert to RGB with a silent loss (16-bit or float
  grey levels, ``I`` / ``I;16`` / ``F``), or one PIL cannot convert;
- too large: more pixels than the configured limit (``data.max_image_pixels``, else the model processor's
  ``max_pixels``); the processor would shrink it below the detail it was captured with.
"""

from __future__ import annotations

import io
import pathlib
from collections.abc import Mapping
from typing import Any

from PIL import Image, UnidentifiedImageError

from nemo_rl.data.errors import DataError

CONVERTIBLE_MODES = frozenset({"RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr"})
"""PIL modes converted to RGB without losing what the processor would read (8 bits per channel)."""


class BadImageError(DataError):
    """An image of a row cannot be used; the message names the row and the file."""


def _describe(value: Any) -> str:
    """How an image value is named in messages: its path, or what kind of value it is."""
    if isinstance(value, str | pathlib.Path):
        return str(value)
    if isinstance(value, Mapping) and value.get("path"):
        return str(value["path"])
    if isinstance(value, Image.Image):
        return getattr(value, "filename", "") or f"an in-memory {value.mode} image"
    if isinstance(value, bytes | bytearray):
        return f"{len(value)} bytes of image data"
    return f"a {type(value).__name__}"


def _open(value: Any, where: str, name: str) -> Image.Image:
    """The PIL image a row's value holds (not yet decoded for files and bytes)."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, Mapping):  # an undecoded `datasets.Image` feature
        data = value.get("bytes")
        value = data if data is not None else value.get("path")
    if isinstance(value, bytes | bytearray):
        source: Any = io.BytesIO(value)
    elif isinstance(value, str | pathlib.Path):
        path = pathlib.Path(str(value).removeprefix("file://")).expanduser()
        if not path.is_file():
            raise BadImageError(f"{where}: image file {name} does not exist: fix the path or remove the row")
        source = path
    else:
        raise BadImageError(
            f"{where}: image {name} is not a path, bytes, a PIL image or a datasets Image: give one of those"
        )
    try:
        return Image.open(source)
    except (UnidentifiedImageError, OSError) as err:
        raise BadImageError(
            f"{where}: {name} is not an image PIL can read ({type(err).__name__}): replace the file"
        ) from None


def load_image(value: Any, *, where: str, max_pixels: int) -> Image.Image:
    """``value`` (see the module docstring) as a decoded RGB image, checked; ``where`` names the row.

    Raises:
        BadImageError: the image is missing, unreadable, of a lossy mode, or has more than ``max_pixels``.
    """
    name = _describe(value)
    image = _open(value, where, name)
    width, height = image.size
    if width * height > max_pixels:
        raise BadImageError(
            f"{where}: image {name} has {width}x{height} = {width * height} pixels, more than the "
            f"{max_pixels} allowed (data.max_image_pixels, else the processor's max_pixels): downscale it or "
            "raise data.max_image_pixels"
        )
    if image.mode not in CONVERTIBLE_MODES:
        raise BadImageError(
            f"{where}: image {name} has mode {image.mode!r}, which converts to 8-bit RGB with a loss: save it "
            f"as RGB (or one of {sorted(CONVERTIBLE_MODES)})"
        )
    try:
        image.load()
    except (OSError, ValueError) as err:  # a truncated or corrupt file is found when its pixels are decoded
        raise BadImageError(f"{where}: {name} is a damaged image ({err}): replace the file") from None
    return image if image.mode == "RGB" else image.convert("RGB")
