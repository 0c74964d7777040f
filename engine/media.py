"""What a client sends as an image -> a decoded PIL image, refused early and clearly when unsafe.

Sources: a PIL image (offline API), raw bytes, a `data:image/...;base64,` URL (HTTP and
Realtime), a `file://` URL or plain path (only under `allowed_local_media_path`). Remote URLs
are refused: the server has no network. Every refusal is a `MediaError` whose `code` clients
can switch on. Callers run this in a worker pool, never on the event loop: decoding is CPU work.

Order of checks, cheapest first, so a hostile input costs as little as possible: encoded size
(on the base64 text, before decoding it), then the format (only the allowed decoders ever see
client bytes), then the pixel count from the header (before any pixel is decompressed), then
the full decode (so a truncated file fails here, not later inside a model's processor).
"""

from __future__ import annotations

import base64
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import numpy as np
from PIL import Image

MIB = 1 << 20

MEDIA_ERROR_CODES = frozenset({
    "image_too_large", "image_too_many_pixels", "unsupported_image_format", "invalid_image",
    "invalid_image_url", "remote_url_not_supported", "local_file_not_allowed", "too_many_images",
    "invalid_audio", "audio_too_long", "too_many_audio_clips",
})


class MediaError(ValueError):
    """A refused image or audio clip. `code` is one of MEDIA_ERROR_CODES; the message names the limit."""

    def __init__(self, code: str, message: str):
        assert code in MEDIA_ERROR_CODES, code
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class MediaLimits:
    # Encoded size (the file, or what a data URL decodes to).
    max_image_bytes: int = 20 * MIB
    # width * height, read from the header before decoding. Pillow's own Image.MAX_IMAGE_PIXELS
    # (89M by default, an error at twice that) still applies on top.
    max_image_pixels: int = 16_000_000
    # Pillow format names; other decoders never see client bytes.
    allowed_formats: frozenset[str] = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})
    # None: local files are refused. Otherwise files must resolve (symlinks, `..`) inside it.
    allowed_local_media_path: Path | None = None
    # Enforced by the caller, which sees the whole request (check_image_count).
    max_images_per_request: int = 8
    # Audio clips a request may hold (a model that hears them: engine/audio_clips.py).
    max_audio_clips_per_request: int = 8

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request", "max_audio_clips_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MediaLimits.{name} must be an integer > 0, got {value!r}")
        if isinstance(self.allowed_formats, (str, bytes)):
            # "PNG" would otherwise be read as the formats "P", "N", "G".
            raise ValueError("MediaLimits.allowed_formats must be a collection of format names")
        formats = frozenset(name.upper() for name in self.allowed_formats)
        Image.init()
        unknown = sorted(formats - Image.OPEN.keys())
        if not formats or unknown:
            raise ValueError(f"MediaLimits.allowed_formats must name Pillow formats it can open "
                             f"(unknown: {unknown or 'none given'})")
        object.__setattr__(self, "allowed_formats", formats)
        if self.allowed_local_media_path is not None:
            # Resolved once, so the containment check compares real paths on both sides.
            folder = Path(self.allowed_local_media_path).resolve()
            if not folder.is_dir():
                raise ValueError(f"MediaLimits.allowed_local_media_path is not a folder: {folder}")
            object.__setattr__(self, "allowed_local_media_path", folder)


def check_image_count(n: int, limits: MediaLimits) -> None:
    if n > limits.max_images_per_request:
        raise MediaError("too_many_images", f"the request has {n} images; the limit is "
                         f"max_images_per_request = {limits.max_images_per_request}")


def load_image(source: Image.Image | bytes | str | os.PathLike, limits: MediaLimits) -> Image.Image:
    """Decode `source` fully and return it in mode "RGB" or "L", detached from any file.

    An animated image yields its first frame. A PIL image passed in is used at its current
    frame, checked for size and copied, so later changes by the caller do not leak in.
    """
    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits)
        try:
            source.load()
            return _normalise_mode(source)
        except Exception as e:
            raise MediaError("invalid_image", f"the image cannot be decoded: {e}") from e
    if isinstance(source, (bytes, bytearray)):
        return _decode(bytes(source), limits)
    if isinstance(source, os.PathLike):
        return _decode(_read_local_file(Path(source), limits), limits)
    if isinstance(source, str):
        return _decode(_read_url(source, limits), limits)
    raise MediaError("invalid_image_url", f"an image must be a URL, a path, bytes or a PIL image, "
                     f"not {type(source).__name__}")


# Bounded to the first characters: the string may be a huge data URL.
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def _read_url(url: str, limits: MediaLimits) -> bytes:
    if url[:5].lower() == "data:":
        return _decode_data_url(url, limits)
    match = _SCHEME.match(url, 0, 32)
    if match is None:
        return _read_local_file(Path(url), limits)
    scheme = match.group(1).lower()
    if scheme in ("http", "https"):
        raise MediaError("remote_url_not_supported", "this server has no network access and does "
                         "not fetch remote images; send the image inline as a data URL "
                         "(data:image/png;base64,...)")
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError("invalid_image_url", f"file URL host {parts.netloc!r} is not this machine")
        return _read_local_file(Path(unquote(parts.path)), limits)
    raise MediaError("invalid_image_url", f"unsupported URL scheme {scheme!r}; send a data URL")


def _decode_data_url(url: str, limits: MediaLimits) -> bytes:
    # The header is short; looking for its comma only near the start, and slicing the payload
    # only after the size check, keeps a huge string from being copied.
    comma = url.find(",", 0, 256)
    if comma < 0:
        raise MediaError("invalid_image_url", "a data URL must read data:image/<type>;base64,<data>")
    params = url[5:comma].lower().split(";")
    if not params[0].startswith("image/"):
        raise MediaError("invalid_image_url", f"the data URL's MIME type is {params[0]!r}; "
                         "expected image/<type>")
    if params[-1] != "base64":
        raise MediaError("invalid_image_url", "the data URL must be base64 (data:image/<type>;base64,...)")
    padding = 2 if url.endswith("==") else 1 if url.endswith("=") else 0
    decoded_size = (len(url) - comma - 1) * 3 // 4 - padding
    if decoded_size > limits.max_image_bytes:
        raise _too_large(decoded_size, limits)
    try:
        # validate=True: a stray character is an error, not silently skipped data.
        return base64.b64decode(url[comma + 1:], validate=True)
    except ValueError as e:  # binascii.Error, and non-ASCII text
        raise MediaError("invalid_image_url", f"the data URL's payload is not valid base64: {e}") from e


def _read_local_file(path: Path, limits: MediaLimits) -> bytes:
    folder = limits.allowed_local_media_path
    if folder is None:
        raise MediaError("local_file_not_allowed", "this server does not read local files "
                         "(allowed_local_media_path is not set); send the image as a data URL")
    try:
        # Resolving follows symlinks and `..`, so the check sees the file that would be read.
        real = path.resolve()
    except (OSError, ValueError, RuntimeError) as e:
        raise MediaError("invalid_image_url", f"bad file path {str(path)!r}: {e}") from e
    if not real.is_relative_to(folder):
        raise MediaError("local_file_not_allowed", f"{str(path)!r} is outside the folder local "
                         f"images may come from (allowed_local_media_path = {folder})")
    try:
        # is_file() also refuses FIFOs and devices, whose read could block or never end.
        if not real.is_file():
            raise MediaError("invalid_image_url", f"{str(path)!r} is not a file")
        with real.open("rb") as f:
            data = f.read(limits.max_image_bytes + 1)  # +1: enough to tell it is too large
    except OSError as e:
        raise MediaError("invalid_image_url", f"cannot read {str(path)!r}: {e.strerror}") from e
    if len(data) > limits.max_image_bytes:
        raise _too_large(limits.max_image_bytes, limits, at_least=True)
    return data


# Pillow's bomb guards: the Error above 2 * Image.MAX_IMAGE_PIXELS; the Warning above it, an
# exception only if the process's warning filters say so (python -W error). We do not make it
# one with warnings.catch_warnings(): that edits global state and is not thread-safe, and our
# own pixel check right after open refuses those sizes anyway.
_BOMB = (Image.DecompressionBombError, Image.DecompressionBombWarning)


def _decode(data: bytes, limits: MediaLimits) -> Image.Image:
    if not data:
        raise MediaError("invalid_image", "the image is empty (0 bytes)")
    if len(data) > limits.max_image_bytes:
        raise _too_large(len(data), limits)
    try:
        # Reads the header only; only the allowed formats' parsers are tried.
        image = Image.open(io.BytesIO(data), formats=sorted(limits.allowed_formats))
    except _BOMB as e:
        raise _too_many_pixels(str(e), limits) from e
    except Image.UnidentifiedImageError as e:
        found = _sniff_format(data[:16])
        if found is not None and found not in limits.allowed_formats:
            raise MediaError("unsupported_image_format", f"{found} images are not accepted; allowed "
                             f"formats: {', '.join(sorted(limits.allowed_formats))}") from e
        raise _invalid(limits, "not a readable image (corrupt, or an unknown format)") from e
    except Exception as e:  # a plugin's parser may raise anything on hostile bytes
        raise _invalid(limits, f"the image header is corrupt: {e}") from e
    _check_pixels(image.size, limits)
    try:
        image.load()  # the first frame of an animation; a truncated file fails here
        return _normalise_mode(image)
    except _BOMB as e:
        raise _too_many_pixels(str(e), limits) from e
    except Exception as e:
        raise _invalid(limits, f"the image data is corrupt or truncated: {e}") from e


def _normalise_mode(image: Image.Image) -> Image.Image:
    # Model processors accept 8-bit "RGB" and "L"; palette, alpha, CMYK and 16-bit modes either
    # fail inside them or convert badly there, so they become RGB here, once, done properly.
    # Returns a new image in every case: detached from the file (no later frames to seek, no
    # buffer kept alive) and from the caller's object.
    if image.mode in ("RGB", "L"):
        return image.copy()
    if image.mode.startswith("I;16"):
        # Pillow converts I;16 to L by clipping at 255, which turns nearly every pixel white;
        # keeping the high byte preserves the picture.
        high = (np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8)
        return Image.fromarray(high).convert("RGB")
    if image.has_transparency_data:
        # Transparent pixels often store black: dropping alpha would turn a dark drawing on a
        # transparent background into a black square. Composite on white, as a viewer shows it.
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _check_pixels(size: tuple[int, int], limits: MediaLimits) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise MediaError("invalid_image", f"the image has no pixels ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise _too_many_pixels(f"the image is {width}x{height} = {width * height} pixels", limits)


# Magic numbers, to name a format that was refused; only consulted after the allowed decoders
# all declined, so that unsupported formats get their own code without a parser seeing them.
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
    (b"8BPS", "PSD"), (b"\x00\x00\x01\x00", "ICO"), (b"qoif", "QOI"),
    (b"\xff\x4f\xff\x51", "JPEG2000"), (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG2000"),
)


def _sniff_format(head: bytes) -> str | None:
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[4:8] == b"ftyp":
        return "AVIF" if head[8:12] in (b"avif", b"avis") else "HEIF"
    return next((name for magic, name in _SIGNATURES if head.startswith(magic)), None)


def _too_large(size: int, limits: MediaLimits, at_least: bool = False) -> MediaError:
    more = "more than " if at_least else ""
    return MediaError("image_too_large", f"the image is {more}{size} bytes; the limit is "
                      f"max_image_bytes = {limits.max_image_bytes} ({limits.max_image_bytes / MIB:g} MiB)")


def _too_many_pixels(problem: str, limits: MediaLimits) -> MediaError:
    return MediaError("image_too_many_pixels", f"{problem}; the limit is "
                      f"max_image_pixels = {limits.max_image_pixels}")


def _invalid(limits: MediaLimits, problem: str) -> MediaError:
    return MediaError("invalid_image", f"{problem}; accepted formats: "
                      f"{', '.join(sorted(limits.allowed_formats))}")
