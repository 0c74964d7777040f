"""The Realtime audio formats (16-bit PCM, G.711 mu-law and A-law), WAV files, resampling."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from engine.audio_formats import (AUDIO_FORMATS, decode_audio, encode_audio, read_wav, resample, sample_rate_of,
                                  wav_header, write_wav)

EVERY_INT16 = np.arange(-32768, 32768, dtype=np.int32)
EVERY_CODE = bytes(range(256))


def pcm16_levels(data: bytes, format: str) -> np.ndarray:
    """Decoded samples back in 16-bit units (exact: decoding divides by 32768)."""
    return (decode_audio(data, format) * 32768).astype(np.int32)


def g711_round_trip(format: str) -> np.ndarray:
    """Every 16-bit sample value, encoded then decoded."""
    return pcm16_levels(encode_audio(EVERY_INT16 / 32768, format), format)


# ---- the table -------------------------------------------------------------------------------

def test_each_format_has_its_openai_rate():
    assert {name: sample_rate_of(name) for name in AUDIO_FORMATS} == {
        "audio/pcm": 24000, "audio/pcmu": 8000, "audio/pcma": 8000}


@pytest.mark.parametrize("call", [
    lambda: decode_audio(b"\0\0", "audio/wav"), lambda: encode_audio(np.zeros(2), "pcm16"),
    lambda: sample_rate_of("audio/opus"), lambda: sample_rate_of(None),
])
def test_an_unknown_format_is_refused_naming_the_supported_ones(call):
    with pytest.raises(ValueError, match="audio/pcm, audio/pcmu, audio/pcma"):
        call()


@pytest.mark.parametrize("format", list(AUDIO_FORMATS))
def test_nothing_decodes_to_nothing_and_back(format):
    samples = decode_audio(b"", format)
    assert samples.dtype == np.float32 and samples.shape == (0,)
    assert encode_audio(samples, format) == b""


# ---- 16-bit PCM ------------------------------------------------------------------------------

def test_pcm16_is_little_endian_signed_and_round_trips_exactly():
    data = np.array([0, 1, -1, 32767, -32768, 12345], dtype="<i2").tobytes()
    samples = decode_audio(data, "audio/pcm")
    assert samples.dtype == np.float32
    assert samples.tolist() == [0.0, 1 / 32768, -1 / 32768, 32767 / 32768, -1.0, 12345 / 32768]
    assert decode_audio(b"\x01\x80", "audio/pcm").tolist() == [-32767 / 32768]  # 0x8001, low byte first
    assert encode_audio(samples, "audio/pcm") == data

    noise = np.random.default_rng(0).integers(-32768, 32768, 4000).astype("<i2").tobytes()
    assert encode_audio(decode_audio(noise, "audio/pcm"), "audio/pcm") == noise


def test_pcm16_with_an_odd_byte_count_is_refused():
    with pytest.raises(ValueError, match="odd"):
        decode_audio(b"\x00\x01\x02", "audio/pcm")


def test_encoding_clips_to_full_scale_and_silences_nan():
    samples = np.array([1.0, 1.5, -1.0, -7.0, np.nan, np.inf, -np.inf, 0.5], dtype=np.float32)
    assert np.frombuffer(encode_audio(samples, "audio/pcm"), "<i2").tolist() == [
        32767, 32767, -32768, -32768, 0, 32767, -32768, 16384]


def test_encoding_refuses_more_than_one_channel():
    with pytest.raises(ValueError, match="mono"):
        encode_audio(np.zeros((100, 2)), "audio/pcm")


# ---- G.711 -----------------------------------------------------------------------------------

def test_mulaw_known_code_points():
    levels = pcm16_levels(bytes([0xFF, 0x7F, 0x80, 0x00, 0xFE, 0x7E]), "audio/pcmu")
    # 0xFF and 0x7F are +0 and -0; 0x80 and 0x00 the loudest; the next codes in are one step.
    assert levels.tolist() == [0, 0, 32124, -32124, 8, -8]
    codes = encode_audio(np.array([0, -1, 32767, -32768, 8, -9]) / 32768, "audio/pcmu")
    assert list(codes) == [0xFF, 0x7F, 0x80, 0x00, 0xFE, 0x7E]
    # A negative sample's magnitude is its one's complement (ITU's G.191 reference code):
    # -4 and 3 both read as 14-bit 0 (Python's audioop negated instead, and sent -4 as 0x7E).
    assert list(encode_audio(np.array([3, -4, -5]) / 32768, "audio/pcmu")) == [0xFF, 0x7F, 0x7E]


def test_alaw_known_code_points():
    # A-law has no zero: the codes nearest it decode to +-8; its loudest to +-32256. The line
    # inverts every other bit, so +0 is sent as 0xD5 and -0 as 0x55.
    levels = pcm16_levels(bytes([0xD5, 0x55, 0xAA, 0x2A]), "audio/pcma")
    assert levels.tolist() == [8, -8, 32256, -32256]
    codes = encode_audio(np.array([0, -1, 32767, -32768]) / 32768, "audio/pcma")
    assert list(codes) == [0xD5, 0x55, 0xAA, 0x2A]


@pytest.mark.parametrize("format, levels", [("audio/pcmu", 255), ("audio/pcma", 256)])
def test_g711_decodes_to_distinct_symmetric_levels(format, levels):
    decoded = pcm16_levels(EVERY_CODE, format)
    assert len(set(decoded.tolist())) == levels  # mu-law's two zeros are one level
    assert sorted(decoded.tolist()) == sorted((-decoded).tolist())


@pytest.mark.parametrize("format", ["audio/pcmu", "audio/pcma"])
def test_g711_every_code_but_negative_zero_survives_a_round_trip(format):
    again = encode_audio(decode_audio(EVERY_CODE, format), format)
    changed = [code for code in range(256) if again[code] != code]
    assert changed == ([0x7F] if format == "audio/pcmu" else [])  # -0 comes back as +0


@pytest.mark.parametrize("format, input_step", [("audio/pcmu", 4), ("audio/pcma", 16)])
def test_g711_each_code_decodes_to_the_middle_of_the_inputs_it_stands_for(format, input_step):
    """G.711 cuts the input range into intervals, one per code, and decodes a code to its
    interval's middle. It reads 14-bit (mu-law) or 13-bit (A-law) samples: in 16-bit units an
    interval's edges fall on multiples of that input step, so its middle is known to within
    half a step."""
    decoded = g711_round_trip(format)
    # Monotone (a louder sample never comes back quieter), so each level's inputs are one run.
    assert np.all(np.diff(decoded) >= 0)
    levels, first, count = np.unique(decoded, return_index=True, return_counts=True)
    assert len(levels) == (255 if format == "audio/pcmu" else 256)  # every code is used
    lowest, highest = EVERY_INT16[first], EVERY_INT16[first] + count - 1
    middle = slice(1, -1)  # the loudest codes also take everything past them
    off_centre = np.abs(levels - (lowest + highest) / 2)[middle]
    assert off_centre.max() <= input_step / 2, levels[middle][np.argmax(off_centre)]


@pytest.mark.parametrize("format, loudest", [("audio/pcmu", 32124), ("audio/pcma", 32256)])
def test_g711_error_stays_within_half_a_step_of_its_segment(format, loudest):
    """Logarithmic: a segment's 16 steps span what its samples span, so the error is at most
    half a step, about 3% of the sample (up to 3.5% in mu-law's smaller segments), a few
    units near zero, and clipping past the loudest level."""
    decoded = g711_round_trip(format)
    error = np.abs(decoded - EVERY_INT16)
    inside = np.abs(EVERY_INT16) <= loudest
    bound = np.maximum(16, np.abs(EVERY_INT16) / 24)
    assert np.all(error[inside] <= bound[inside]), EVERY_INT16[inside][np.argmax(error[inside] - bound[inside])]
    assert set(decoded[~inside].tolist()) <= {loudest, -loudest}


def test_g711_carries_a_tone_at_its_rate():
    for format in ("audio/pcmu", "audio/pcma"):
        rate = sample_rate_of(format)
        tone = 0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate).astype(np.float32)
        data = encode_audio(tone, format)
        assert len(data) == rate  # one byte a sample
        back = decode_audio(data, format)
        signal_to_noise_db = 10 * np.log10(np.sum(tone ** 2) / np.sum((back - tone) ** 2))
        assert signal_to_noise_db > 35, (format, signal_to_noise_db)  # G.711 gives about 38 dB


# ---- resampling ------------------------------------------------------------------------------

def test_resample_to_the_same_rate_or_of_nothing_is_identity():
    samples = np.random.default_rng(0).normal(0, 0.1, 1000).astype(np.float32)
    assert np.array_equal(resample(samples, 16000, 16000), samples)
    empty = resample(np.zeros(0, np.float32), 24000, 16000)
    assert empty.dtype == np.float32 and empty.shape == (0,)


@pytest.mark.parametrize("from_rate, to_rate", [(24000, 16000), (8000, 16000), (22050, 16000), (16000, 24000)])
def test_resample_keeps_a_tone_and_scales_the_length(from_rate, to_rate):
    tone = lambda rate: 0.5 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)  # one second
    got = resample(tone(from_rate).astype(np.float32), from_rate, to_rate)
    assert got.dtype == np.float32 and abs(len(got) - to_rate) <= 1
    middle = slice(to_rate // 10, -to_rate // 10)  # away from the filter's edges
    assert np.max(np.abs(got[middle] - tone(to_rate)[:len(got)][middle])) < 1e-3


def test_resample_takes_numpy_integer_rates():
    assert len(resample(np.zeros(300, np.float32), np.int64(24000), np.int32(16000))) == 200


def test_resample_refuses_rates_that_are_not_rates():
    for rates in ((0, 16000), (16000, -1), (16000.5, 16000), (True, 16000)):
        with pytest.raises(ValueError, match="rate"):
            resample(np.zeros(10, np.float32), *rates)


# ---- WAV -------------------------------------------------------------------------------------

def wav_file(frames: np.ndarray, rate: int, width: int) -> bytes:
    """A WAV written by the standard library: frames (n, channels) of raw integer samples."""
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(frames.shape[1])
        writer.setsampwidth(width)
        writer.setframerate(rate)
        writer.writeframes(frames.astype({1: np.uint8, 2: "<i2", 4: "<i4"}[width]).tobytes())
    return out.getvalue()


def test_write_then_read_wav_round_trips_16_bit():
    samples = np.random.default_rng(0).integers(-32768, 32768, 5000) / 32768
    data = write_wav(samples, 22050)
    with wave.open(io.BytesIO(data)) as reader:  # a file the standard reader takes
        assert (reader.getnchannels(), reader.getsampwidth(), reader.getframerate(), reader.getnframes()) == (
            1, 2, 22050, 5000)
    got, rate = read_wav(data)
    assert rate == 22050 and got.dtype == np.float32
    assert np.array_equal(got, samples.astype(np.float32))


@pytest.mark.parametrize("width, left, right, expected", [
    (1, 192, 96, (0.5 - 0.25) / 2),  # 8-bit is unsigned, 128 is silence
    (2, 16384, -8192, (0.5 - 0.25) / 2),
    (4, 2 ** 30, -2 ** 29, (0.5 - 0.25) / 2),
])
def test_read_wav_takes_8_16_and_32_bit_and_mixes_channels_down(width, left, right, expected):
    frames = np.tile([left, right], (1000, 1))
    samples, rate = read_wav(wav_file(frames, 8000, width))
    assert rate == 8000 and samples.shape == (1000,) and samples.dtype == np.float32
    assert np.allclose(samples, expected, atol=1e-7)


def test_read_wav_of_a_streamed_file_with_an_open_length():
    pcm = np.arange(-500, 500, dtype="<i2").tobytes()
    samples, rate = read_wav(wav_header(24000) + pcm)
    assert rate == 24000 and np.array_equal(samples, np.arange(-500, 500) / 32768)


def test_wav_header_announces_an_open_length_or_the_given_one():
    assert len(wav_header(24000)) == 44 and wav_header(24000)[40:44] == b"\xff\xff\xff\xff"
    assert wav_header(16000, 3200)[40:44] == (3200).to_bytes(4, "little")
    assert wav_header(16000, 3200)[4:8] == (3236).to_bytes(4, "little")


@pytest.mark.parametrize("data, message", [
    (b"", "readable"),
    (b"hello world, not a wav file at all", "readable"),
    (write_wav(np.zeros(1000), 16000)[:30], "readable"),  # cut inside the header
    (write_wav(np.zeros(1000), 16000)[:-100], "truncated"),  # cut inside the audio
    (wav_file(np.zeros((10, 1)), 16000, 2).replace(b"\x10\x00\x00\x00\x01\x00", b"\x10\x00\x00\x00\x03\x00"),
     "readable"),  # IEEE float samples
])
def test_read_wav_refuses_a_bad_or_truncated_file(data, message):
    with pytest.raises(ValueError, match=message):
        read_wav(data)


def test_read_wav_refuses_24_bit_naming_what_it_takes():
    frames = io.BytesIO()
    with wave.open(frames, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(3)
        writer.setframerate(16000)
        writer.writeframes(b"\0" * 30)
    with pytest.raises(ValueError, match="24 bits.*8, 16 or 32"):
        read_wav(frames.getvalue())
