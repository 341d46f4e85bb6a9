"""Images a user sends: decoded from bytes with limits checked before the pixels are.

Everything that takes an image from outside (the server, the CLI, the app) comes through
``decode_image``: a size cap on the encoded bytes, a format allow-list, and a pixel cap read from
the header, so a 100-megapixel PNG (a few KB of zeros, a "decompression bomb") is refused before
a single row is decoded. ``data_url`` parsing is here as well; fetching URLs is not (the server
refuses them unless told otherwise, see engine/serve/images.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import TandemError

MAX_IMAGE_BYTES = 20 << 20  # encoded size of one image
MAX_IMAGE_PIXELS = 32_000_000  # width x height, read from the header before decoding
MAX_IMAGES = 16  # per request
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)


class ImageError(TandemError):
    """An image that cannot be used: corrupt, too large, an unsupported format, or sent to a
    model that takes no images. The server answers it with a 4xx."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Image:
    """A decoded RGB image and the digest of the bytes it came from."""

    pil: Any  # PIL.Image.Image, RGB
    sha256: str
    format: str
    nbytes: int


def _pil():
    try:
        from PIL import Image as PILImage
    except ImportError:  # pragma: no cover - Pillow comes with the vision extra
        raise ImageError("images need Pillow: pip install 'mlx-tandem[vision]'", status=501) from None
    return PILImage


def decode_image(data: bytes, *, label: str = "image", max_bytes: int = MAX_IMAGE_BYTES,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> Image:
    """Decode ``data`` (PNG, JPEG, WebP, GIF, BMP) into an RGB image, or raise ``ImageError``
    naming ``label`` and the problem."""
    if not data:
        raise ImageError(f"{label}: empty image")
    if len(data) > max_bytes:
        raise ImageError(f"{label}: {len(data) / 2**20:.1f} MiB is over the {max_bytes / 2**20:.0f} MiB image limit",
                         status=413)
    PILImage = _pil()
    try:
        with warnings.catch_warnings():  # Pillow warns of large images; the pixel cap below decides
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            img = PILImage.open(io.BytesIO(data))  # reads the header only
    except PILImage.DecompressionBombError as e:  # Pillow's own cap, should ours be higher
        raise ImageError(f"{label}: too many pixels ({e})", status=413) from None
    except Exception:
        raise ImageError(f"{label}: not an image, or a corrupt one (PNG, JPEG, WebP, GIF or BMP expected)") from None
    fmt = (img.format or "?").upper()
    if fmt not in FORMATS:
        raise ImageError(f"{label}: {fmt} images are not supported (PNG, JPEG, WebP, GIF or BMP)", status=415)
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageError(f"{label}: empty image ({width}x{height})")
    if width * height > max_pixels:
        raise ImageError(f"{label}: {width}x{height} is {width * height / 1e6:.0f} megapixels, over the "
                         f"{max_pixels / 1e6:.0f} MP limit", status=413)
    try:
        img.load()
        rgb = img.convert("RGB")
    except Exception as e:
        raise ImageError(f"{label}: corrupt {fmt} data ({type(e).__name__})") from None
    return Image(rgb, hashlib.sha256(data).hexdigest(), fmt, len(data))


def read_image_bytes(path: str | Path, *, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """A file's bytes, at most ``max_bytes`` + 1 of them (``decode_image`` refuses more); a file
    that cannot be read is an ``ImageError``."""
    p = Path(path).expanduser()
    try:
        with p.open("rb") as f:
            return f.read(max_bytes + 1)
    except OSError as e:
        raise ImageError(f"{p}: cannot read ({e.strerror or type(e).__name__})") from None


def read_image_file(path: str | Path, *, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS) -> Image:
    """``decode_image`` on a file's bytes."""
    data = read_image_bytes(path, max_bytes=max_bytes)
    return decode_image(data, label=str(Path(path).expanduser()), max_bytes=max_bytes, max_pixels=max_pixels)


def parse_data_url(url: str, *, label: str = "image") -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL."""
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageError(f"{label}: not a data URL")
    mime = (m.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise ImageError(f"{label}: a data URL of type {mime}, not an image", status=415)
    if not m.group("b64"):
        raise ImageError(f"{label}: only base64 data URLs are supported")
    return decode_base64(url[m.end():], label=label)


def decode_base64(text: str, *, label: str = "image", max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    if not isinstance(text, str):
        raise ImageError(f"{label}: base64 data must be a string")
    if len(text) > (max_bytes * 4) // 3 + 8:  # refuse before decoding what cannot fit
        raise ImageError(f"{label}: over the {max_bytes / 2**20:.0f} MiB image limit", status=413)
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{label}: invalid base64 data") from None
