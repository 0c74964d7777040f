"""Audio as it crosses the edge: the OpenAI Realtime formats, WAV files, resampling.

A Realtime session names its audio by MIME type, each with one fixed rate: "audio/pcm" is
16-bit little-endian PCM, mono, 24 kHz; "audio/pcmu" and "audio/pcma" are the telephone
codecs of ITU-T G.711 (mu-law and A-law), 8 bits a sample at 8 kHz. Inside the server audio
is float32 mono in [-1, 1]; this module converts at the edge, in numpy only (the frontend
imports it without torch).

G.711 is written here, not taken from Python's `audioop` (deprecated, gone in 3.13). Both
codecs follow the ITU's reference code (G.191's g711.c) bit for bit: a negative sample's
magnitude is its one's complement (-x - 1), so -1..-4 encode as mu-law's negative zero as
0..3 do as its positive zero. (`audioop` negates instead: its mu-law differs on 508 of the
32768 negative inputs, each time by the neighbouring level; decoding and A-law agree
everywhere.) Each codec is a table over every 16-bit sample (encoding) or every code
(decoding), built once at import by the vectorized formula.

Float samples become 16-bit by scaling with 32768, the same factor that decoding divides
by, so a decoded stream encodes back to the same bytes.
"""

from __future__ import annotations

import io
import numbers
import struct
import wave
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import soxr

PCM16_SCALE = 32768.0
# A streamed WAV cannot know its length up front; the largest size is the usual stand-in,
# and readers that meet it take the data to the end of the file.
OPEN_LENGTH = 0xFFFFFFFF


# ---- G.711 -----------------------------------------------------------------------------------

# mu-law: a biased magnitude in 14-bit units, clipped to 13 bits; the segment is the place of
# its highest bit above the first 6, the mantissa the 4 bits below that.
_MULAW_BIAS = 33
_MULAW_MAX = 0x1FFF
_MULAW_SEGMENT_STARTS = np.array([64 << s for s in range(7)])
# A-law: a 12-bit magnitude; segment 0 and 1 are both linear (steps of 16 in 16-bit units).
_ALAW_SEGMENT_STARTS = np.array([16 << s for s in range(7)])
_ALAW_EVEN_BIT_INVERSION = 0x55


def _magnitude(linear: np.ndarray) -> np.ndarray:
    """G.191's magnitude of int16 samples: one's complement for negatives (so -32768 fits)."""
    return np.where(linear < 0, ~linear, linear)


def _mulaw_compress(linear: np.ndarray) -> np.ndarray:
    linear = linear.astype(np.int32)
    magnitude = np.minimum((_magnitude(linear) >> 2) + _MULAW_BIAS, _MULAW_MAX)
    segment = np.searchsorted(_MULAW_SEGMENT_STARTS, magnitude, side="right")
    mantissa = (magnitude >> (segment + 1)) & 0x0F
    code = (segment << 4) | mantissa | np.where(linear < 0, 0x80, 0)
    # The code is sent inverted: a quiet line (many small samples) then has many one bits,
    # which the old T1 carriers needed to keep their clocks.
    return (~code & 0xFF).astype(np.uint8)


def _mulaw_expand(code: np.ndarray) -> np.ndarray:
    inverted = ~code.astype(np.int32) & 0xFF
    segment = (inverted >> 4) & 0x07
    mantissa = inverted & 0x0F
    magnitude = (((mantissa << 3) + 4 * _MULAW_BIAS) << segment) - 4 * _MULAW_BIAS
    return np.where(inverted & 0x80, -magnitude, magnitude).astype(np.int16)


def _alaw_compress(linear: np.ndarray) -> np.ndarray:
    linear = linear.astype(np.int32)
    magnitude = _magnitude(linear) >> 4
    segment = np.searchsorted(_ALAW_SEGMENT_STARTS, magnitude, side="right")
    mantissa = (magnitude >> np.maximum(segment - 1, 0)) & 0x0F
    code = (segment << 4) | mantissa | np.where(linear >= 0, 0x80, 0)
    # Every other bit is inverted on the line (same reason as mu-law's full inversion).
    return (code ^ _ALAW_EVEN_BIT_INVERSION).astype(np.uint8)


def _alaw_expand(code: np.ndarray) -> np.ndarray:
    plain = code.astype(np.int32) ^ _ALAW_EVEN_BIT_INVERSION
    segment = (plain >> 4) & 0x07
    mantissa = (plain & 0x0F) + np.where(segment > 0, 16, 0)
    # The decoded value sits in the middle of the step the code stands for.
    magnitude = ((mantissa << 4) + 8) << np.maximum(segment - 1, 0)
    return np.where(plain & 0x80, magnitude, -magnitude).astype(np.int16)


# Indexed by a sample's 16 bits read as unsigned (int16.view(uint16)), and by a code.
_EVERY_INT16 = np.arange(1 << 16, dtype=np.uint16).view(np.int16)
_EVERY_CODE = np.arange(256, dtype=np.uint8)
_MULAW_ENCODE = _mulaw_compress(_EVERY_INT16)
_MULAW_DECODE = _mulaw_expand(_EVERY_CODE)
_ALAW_ENCODE = _alaw_compress(_EVERY_INT16)
_ALAW_DECODE = _alaw_expand(_EVERY_CODE)


def _g711_decoder(table: np.ndarray) -> Callable[[bytes], np.ndarray]:
    return lambda data: table[np.frombuffer(data, dtype=np.uint8)]


def _g711_encoder(table: np.ndarray) -> Callable[[np.ndarray], bytes]:
    return lambda pcm: table[pcm.view(np.uint16)].tobytes()


def _pcm16_decode(data: bytes) -> np.ndarray:
    if len(data) % 2:
        raise ValueError(f"16-bit PCM takes 2 bytes a sample; got {len(data)} bytes, an odd count")
    return np.frombuffer(data, dtype="<i2")


def _pcm16_encode(pcm: np.ndarray) -> bytes:
    return pcm.astype("<i2", copy=False).tobytes()


# ---- the Realtime formats --------------------------------------------------------------------

@dataclass(frozen=True)
class AudioFormat:
    """A wire format: its rate, and how its bytes map to 16-bit samples and back."""

    sample_rate: int
    decode: Callable[[bytes], np.ndarray]  # bytes -> int16 samples
    encode: Callable[[np.ndarray], bytes]  # int16 samples -> bytes


AUDIO_FORMATS: dict[str, AudioFormat] = {
    "audio/pcm": AudioFormat(24000, _pcm16_decode, _pcm16_encode),
    "audio/pcmu": AudioFormat(8000, _g711_decoder(_MULAW_DECODE), _g711_encoder(_MULAW_ENCODE)),
    "audio/pcma": AudioFormat(8000, _g711_decoder(_ALAW_DECODE), _g711_encoder(_ALAW_ENCODE)),
}


def _audio_format(format: str) -> AudioFormat:
    try:
        return AUDIO_FORMATS[format]
    except (KeyError, TypeError):
        raise ValueError(f"unknown audio format {format!r}; supported: {', '.join(AUDIO_FORMATS)}") from None


def sample_rate_of(format: str) -> int:
    return _audio_format(format).sample_rate


def decode_audio(data: bytes, format: str) -> np.ndarray:
    """`data` in a Realtime format -> float32 mono samples in [-1, 1) at the format's rate."""
    pcm = _audio_format(format).decode(data)
    return pcm.astype(np.float32) / np.float32(PCM16_SCALE)


def encode_audio(samples: np.ndarray, format: str) -> bytes:
    """Float mono samples (clipped to [-1, 1]) -> bytes in a Realtime format."""
    return encode_pcm16(to_pcm16(samples), format)


def encode_pcm16(pcm: np.ndarray, format: str) -> bytes:
    """16-bit samples -> bytes in a Realtime format (no round trip through floats)."""
    return _audio_format(format).encode(pcm)


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """Float mono samples -> int16, clipped; NaN becomes silence rather than garbage."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"audio must be mono, one sample per entry; got an array of shape {samples.shape}")
    scaled = np.rint(np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0) * PCM16_SCALE)
    # +1.0 lands one past the largest int16: the clip takes it to 32767.
    return np.clip(scaled, -PCM16_SCALE, PCM16_SCALE - 1).astype(np.int16)


def _rate(name: str, rate: int) -> int:
    # numpy's integers are welcome (a rate read from an array); floats are not: a rate with
    # a fraction is a bug upstream, better found here than heard as a pitch shift.
    if isinstance(rate, bool) or not isinstance(rate, numbers.Integral) or rate <= 0:
        raise ValueError(f"{name} must be a positive whole number of Hz, got {rate!r}")
    return int(rate)


# ---- resampling ------------------------------------------------------------------------------

def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Float32 mono `samples` at `from_rate` Hz -> at `to_rate` Hz (soxr, high quality).
    For a stream cut into chunks use soxr.ResampleStream: this treats each call as a whole
    clip, so chunk edges would click."""
    from_rate, to_rate = _rate("from_rate", from_rate), _rate("to_rate", to_rate)
    samples = np.asarray(samples, dtype=np.float32)
    if from_rate == to_rate or len(samples) == 0:
        return samples
    return soxr.resample(samples, from_rate, to_rate).astype(np.float32, copy=False)


# ---- WAV ---------------------------------------------------------------------------------------

def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A WAV file's audio as (float32 mono in [-1, 1], rate). Integer PCM of 8, 16 or 32 bits;
    channels are averaged. A file shorter than its header says is refused, except a streamed
    one whose header announces an open length (read to the end)."""
    try:
        with wave.open(io.BytesIO(data)) as reader:
            channels, width, rate = reader.getnchannels(), reader.getsampwidth(), reader.getframerate()
            declared = reader.getnframes()
            frames = reader.readframes(declared)
    except (wave.Error, EOFError, struct.error) as exc:
        raise ValueError(f"not a readable WAV file ({str(exc) or 'it ends early'})") from None
    if width not in (1, 2, 4):
        raise ValueError(f"WAV samples of {8 * width} bits are not supported (8, 16 or 32-bit PCM)")
    if rate <= 0 or channels < 1:
        raise ValueError(f"a WAV file of {channels} channels at {rate} Hz holds no audio")
    frame_bytes = channels * width
    got = len(frames) // frame_bytes
    if got < declared and declared != OPEN_LENGTH // frame_bytes:
        raise ValueError(f"the WAV file is truncated: its header announces {declared} frames, it holds {got}")
    samples = _pcm_to_float(frames[:got * frame_bytes], width)
    return samples.reshape(got, channels).mean(axis=1, dtype=np.float32), rate


def _pcm_to_float(frames: bytes, width: int) -> np.ndarray:
    if width == 1:  # 8-bit WAV is unsigned, silence at 128
        return (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128) / 128
    dtype, scale = ("<i2", PCM16_SCALE) if width == 2 else ("<i4", 2.0 ** 31)
    return (np.frombuffer(frames, dtype=dtype).astype(np.float64) / scale).astype(np.float32)


def wav_header(rate: int, data_bytes: int | None = None) -> bytes:
    """The 44-byte header of a 16-bit mono PCM WAV; `data_bytes=None` announces an open
    length, for audio streamed before its end is known."""
    rate = _rate("rate", rate)
    data_size = OPEN_LENGTH if data_bytes is None else data_bytes
    riff_size = OPEN_LENGTH if data_bytes is None else 36 + data_bytes
    fmt = struct.pack("<HHIIHH", 1, 1, rate, 2 * rate, 2, 16)  # PCM, mono, rate, bytes/s, align, bits
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", data_size))


def write_wav(samples: np.ndarray, rate: int) -> bytes:
    """Float mono samples -> a 16-bit mono WAV file."""
    pcm = to_pcm16(samples).astype("<i2", copy=False).tobytes()
    if 36 + len(pcm) >= OPEN_LENGTH:
        raise ValueError(f"{len(pcm)} bytes of audio do not fit a WAV file (4 GiB at most)")
    return wav_header(rate, len(pcm)) + pcm
