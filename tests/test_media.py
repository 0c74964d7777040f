"""Client images -> decoded PIL images: limits, refusals with stable codes, mode normalisation."""

import base64
import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from engine.media import MediaError, MediaLimits, check_image_count, load_image

LIMITS = MediaLimits()


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def noise(width: int = 64, height: int = 48, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(0)
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels)


def refused(code: str, source, limits: MediaLimits = LIMITS) -> MediaError:
    with pytest.raises(MediaError) as caught:
        load_image(source, limits)
    assert caught.value.code == code, str(caught.value)
    return caught.value


def png_claiming_size(width: int, height: int) -> bytes:
    """A real, small PNG whose IHDR (with a valid CRC) claims another size."""
    data = bytearray(encode(Image.new("RGB", (8, 8), "red"), "PNG"))
    # Signature (8) + chunk length (4) + b"IHDR" (4), then width and height.
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.fixture
def decoded(monkeypatch):
    """Records every attempt to decompress pixel data (and stops it)."""
    calls = []

    def load(self):
        calls.append(self.size)
        raise OSError("decoding was attempted")
    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


# --- round trips ------------------------------------------------------------------------

LOSSLESS = {"PNG": {}, "BMP": {}, "WEBP": {"lossless": True}, "GIF": {}}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_each_allowed_format_round_trips_through_bytes_and_data_url(fmt):
    # Four flat colours: exact in a GIF palette, near-exact through JPEG.
    original = Image.new("RGB", (32, 24), (200, 30, 40))
    original.paste((20, 180, 60), (16, 0, 32, 12))
    original.paste((10, 20, 230), (0, 12, 16, 24))
    data = encode(original, fmt, **LOSSLESS.get(fmt, {"quality": 95, "subsampling": 0}))
    mime = "image/" + fmt.lower()
    for source in (data, bytearray(data), data_url(data, mime)):
        image = load_image(source, LIMITS)
        assert image.size == (32, 24)
        assert image.mode == "RGB"
        assert not isinstance(image, ImageFile.ImageFile)  # detached from the encoded bytes
        difference = np.abs(np.asarray(image, dtype=int) - np.asarray(original, dtype=int))
        assert difference.max() <= (0 if fmt in LOSSLESS else 12)


def test_grayscale_stays_in_its_decoded_mode():
    image = load_image(encode(noise(mode="L"), "PNG"), LIMITS)
    assert image.mode == "L"


def test_a_pil_image_is_checked_and_copied():
    original = noise(10, 10)
    image = load_image(original, LIMITS)
    original.putpixel((0, 0), (1, 2, 3))
    assert image.getpixel((0, 0)) != (1, 2, 3)
    refused("image_too_many_pixels", noise(100, 100), MediaLimits(max_image_pixels=9999))


# --- decompression bombs ----------------------------------------------------------------

def test_png_header_claiming_100000_by_100000_is_refused_without_decoding(decoded):
    error = refused("image_too_many_pixels", png_claiming_size(100_000, 100_000))
    assert "max_image_pixels" in str(error)
    assert decoded == []


def test_our_pixel_limit_applies_from_the_header_below_pillows_own(decoded):
    # 5000x5000 = 25M pixels: under Pillow's 89M bomb limit, over our 16M default.
    error = refused("image_too_many_pixels", png_claiming_size(5000, 5000))
    assert "5000x5000" in str(error) and "16000000" in str(error)
    assert decoded == []
    # The crafted file itself is a readable PNG: at a size within the limit it gets decoded.
    refused("invalid_image", png_claiming_size(8, 8))
    assert decoded == [(8, 8)]


def test_pixel_limit_is_configurable():
    data = encode(noise(100, 50), "PNG")
    assert load_image(data, MediaLimits(max_image_pixels=5000)).size == (100, 50)
    refused("image_too_many_pixels", data, MediaLimits(max_image_pixels=4999))


def test_pillows_bomb_error_and_warning_map_to_too_many_pixels(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    refused("image_too_many_pixels", encode(noise(64, 64), "PNG"))  # > 2 x 1000: the Error
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as under python -W error
        refused("image_too_many_pixels", encode(noise(40, 40), "PNG"))  # > 1000: the Warning


# --- corrupt input ----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated_image_fails_here_not_later(fmt):
    data = encode(noise(256, 256), fmt)
    refused("invalid_image", data[: len(data) // 2])  # header fine, pixel data cut
    refused("invalid_image", data[:20])  # header cut


def test_random_bytes_and_empty_input_are_invalid_images():
    refused("invalid_image", np.random.default_rng(0).bytes(1000))
    refused("invalid_image", b"")
    refused("invalid_image", data_url(b""))


def test_tiff_is_refused_unless_allowed():
    data = encode(noise(), "TIFF")
    error = refused("unsupported_image_format", data)
    assert "TIFF" in str(error) and "PNG" in str(error)
    assert load_image(data, MediaLimits(allowed_formats={"tiff", "png"})).size == (64, 48)


def test_disallowing_a_format_refuses_it():
    refused("unsupported_image_format", encode(noise(), "JPEG"), MediaLimits(allowed_formats={"PNG"}))


# --- data URLs --------------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "data:image/png;base64,@@@@",
    "data:image/png;base64,iVBO Rw0K",  # whitespace is not skipped
    "data:image/png;base64,iVBORw0KGgo=é",  # non-ASCII
    "data:image/png;base64,iVBORw0KGg",  # bad padding
    "data:text/plain;base64,aGVsbG8=",  # not an image MIME type
    "data:image/png,rawbytes",  # not base64
    "data:image/png;base64" + "A" * 400,  # no comma
])
def test_malformed_data_urls_are_invalid_image_urls(url):
    refused("invalid_image_url", url)


def test_oversize_data_url_is_refused_before_decoding_base64(monkeypatch):
    def b64decode(*args, **kwargs):
        raise AssertionError("base64 was decoded")
    monkeypatch.setattr(base64, "b64decode", b64decode)
    error = refused("image_too_large", "data:image/png;base64," + "A" * 40_000_000)
    assert "max_image_bytes" in str(error) and "20 MiB" in str(error)


def test_data_url_size_limit_is_exact():
    data = encode(noise(), "PNG")
    for length in (len(data), len(data) + 1, len(data) + 2):  # every base64 padding
        padded = data + b"\0" * (length - len(data))  # trailing bytes after IEND are ignored
        assert load_image(data_url(padded), MediaLimits(max_image_bytes=length)).size == (64, 48)
        refused("image_too_large", data_url(padded), MediaLimits(max_image_bytes=length - 1))


def test_oversize_bytes_are_refused():
    data = encode(noise(), "PNG")
    refused("image_too_large", data, MediaLimits(max_image_bytes=len(data) - 1))


# --- URLs and local files ---------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://example.com/cat.png", "HTTPS://example.com/cat.png"])
def test_remote_urls_are_refused_with_a_reason(url):
    error = refused("remote_url_not_supported", url)
    assert "no network" in str(error) and "data:image" in str(error)


def test_other_url_schemes_are_invalid():
    refused("invalid_image_url", "ftp://example.com/cat.png")
    refused("invalid_image_url", 12345)


@pytest.fixture
def folders(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "in.png").write_bytes(encode(noise(), "PNG"))
    (outside / "out.png").write_bytes(encode(noise(), "PNG"))
    return allowed, outside, MediaLimits(allowed_local_media_path=allowed)


def test_local_files_are_refused_when_no_folder_is_allowed(folders):
    allowed, _, _ = folders
    for source in (str(allowed / "in.png"), allowed / "in.png", (allowed / "in.png").as_uri()):
        error = refused("local_file_not_allowed", source)
        assert "allowed_local_media_path" in str(error)


def test_local_files_inside_the_allowed_folder_load(folders):
    allowed, _, limits = folders
    path = allowed / "in.png"
    for source in (str(path), path, path.as_uri(), "file://localhost" + str(path)):
        assert load_image(source, limits).size == (64, 48)


def test_local_files_outside_the_allowed_folder_are_refused(folders):
    allowed, outside, limits = folders
    escapes = [
        str(outside / "out.png"),
        str(allowed / ".." / "outside" / "out.png"),
        "file://" + str(allowed) + "/%2e%2e/outside/out.png",
        "/etc/passwd",
    ]
    for source in escapes:
        refused("local_file_not_allowed", source, limits)


def test_symlink_escaping_the_allowed_folder_is_refused(folders):
    allowed, outside, limits = folders
    (allowed / "link.png").symlink_to(outside / "out.png")
    (allowed / "linkdir").symlink_to(outside, target_is_directory=True)
    refused("local_file_not_allowed", str(allowed / "link.png"), limits)
    refused("local_file_not_allowed", (allowed / "linkdir" / "out.png").as_uri(), limits)
    (allowed / "inner.png").symlink_to(allowed / "in.png")  # staying inside is fine
    assert load_image(str(allowed / "inner.png"), limits).size == (64, 48)


def test_missing_files_directories_and_oversize_files_inside_the_folder(folders):
    allowed, _, limits = folders
    refused("invalid_image_url", str(allowed / "missing.png"), limits)
    refused("invalid_image_url", str(allowed), limits)
    refused("invalid_image_url", "file://otherhost" + str(allowed / "in.png"), limits)
    small = MediaLimits(allowed_local_media_path=allowed, max_image_bytes=100)
    refused("image_too_large", str(allowed / "in.png"), small)


# --- frames and modes -------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_animated_image_yields_its_first_frame(fmt):
    frames = [Image.new("RGB", (16, 16), colour) for colour in ("red", "lime", "blue")]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, loop=0,
                  **({"lossless": True} if fmt == "WEBP" else {}))
    assert Image.open(io.BytesIO(data)).n_frames == 3
    image = load_image(data, LIMITS)
    assert image.getpixel((8, 8)) == (255, 0, 0)
    assert not hasattr(image, "n_frames")


def test_palette_png_comes_back_rgb():
    data = encode(noise().convert("P"), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "P"
    assert load_image(data, LIMITS).mode == "RGB"


def test_transparent_pixels_become_white_not_black():
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    for source in (encode(rgba, "PNG"), rgba, encode(rgba.convert("LA"), "PNG")):
        image = load_image(source, LIMITS)
        assert image.mode == "RGB"
        assert image.getpixel((3, 3)) == (255, 255, 255)
    assert load_image(rgba, LIMITS).getpixel((0, 0)) == (10, 20, 30)


def test_cmyk_jpeg_comes_back_rgb():
    data = encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=95)
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    image = load_image(data, LIMITS)
    assert image.mode == "RGB"
    red, green, blue = image.getpixel((4, 4))
    assert red > 200 and green < 50 and blue < 50


def test_16_bit_png_keeps_its_picture_when_made_rgb():
    wide = Image.fromarray(np.array([[0, 256, 32768, 65535]], dtype=np.uint16))
    data = encode(wide, "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    image = load_image(data, LIMITS)
    assert image.mode == "RGB"
    assert [image.getpixel((x, 0))[0] for x in range(4)] == [0, 1, 128, 255]


# --- limits -----------------------------------------------------------------------------

def test_image_count_limit():
    check_image_count(8, LIMITS)
    with pytest.raises(MediaError) as caught:
        check_image_count(9, LIMITS)
    assert caught.value.code == "too_many_images"
    assert "max_images_per_request = 8" in str(caught.value)


@pytest.mark.parametrize("kwargs", [
    {"max_image_bytes": 0}, {"max_image_pixels": -1}, {"max_images_per_request": 0},
    {"max_image_bytes": 1.5}, {"max_images_per_request": True},
    {"allowed_formats": set()}, {"allowed_formats": {"PNG", "NOPE"}}, {"allowed_formats": "PNG"},
    {"allowed_local_media_path": Path("/definitely/not/a/folder")},
])
def test_invalid_limits_are_refused(kwargs):
    with pytest.raises(ValueError):
        MediaLimits(**kwargs)


def test_limits_normalise_format_names_and_resolve_the_folder(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real", target_is_directory=True)
    limits = MediaLimits(allowed_formats=["png", "Jpeg"], allowed_local_media_path=tmp_path / "alias")
    assert limits.allowed_formats == frozenset({"PNG", "JPEG"})
    assert limits.allowed_local_media_path == (tmp_path / "real").resolve()
    assert LIMITS.max_image_bytes == 20 * 2**20 and LIMITS.max_image_pixels == 16_000_000
    assert LIMITS.allowed_local_media_path is None and LIMITS.max_images_per_request == 8
