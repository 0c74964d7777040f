"""Wire messages between the frontend, the decoder, the encoder and the talker.

Every process imports these structs; they travel as msgpack over ZeroMQ. Nothing is
pickled. One decoder step sends one `StepOutputs` carrying the new tokens of every request
in it. Arrays (an item's pixels, its embeddings) travel as separate zero-copy frames after a
msgpack header that gives their dtype and shape.
"""

from __future__ import annotations

import msgspec

from engine.request import MultiModalPlaceholder
from engine.sampling_params import SamplingParams


class SpeechOptions(msgspec.Struct, kw_only=True):
    """An omni model's answer spoken by the model itself: the decoder hands the talker process
    the thinker's rows of the answer as it makes them (StartSpeaking, ThinkerRows), and the
    talker sends its audio to the frontend under `speech_id` (SpeechAudio)."""

    speech_id: str
    voice: str
    sample_rate: int = 24000
    # Seeds the talker's sampling and the codec's noise: the same request, the same audio.
    seed: int | None = None


class EngineRequest(msgspec.Struct, tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    cache_salt: str | None = None
    # Where each image or audio item sits in the prompt; its pixels go to the encoder.
    mm_placeholders: list[MultiModalPlaceholder] = []
    speech: SpeechOptions | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class EncoderLost(msgspec.Struct, tag="encoder_lost"):
    """The encoder process died: what the decoder asked of it will never come."""

    reason: str


DecoderInput = EngineRequest | AbortRequests | Shutdown | EncoderLost


class ItemHeader(msgspec.Struct, array_like=True):
    """One preprocessed item; its pixel array is the next frame of the message, unless
    `shape` is empty: the frontend believes the encoder's cache holds it and sends none."""

    mm_hash: str
    num_embeddings: int
    grid: list[int]
    modality: str
    dtype: str
    shape: list[int]


class RegisterItems(msgspec.Struct, tag="register"):
    """Frontend -> encoder: a request's items, kept until released, so the decoder can ask
    for any of them (again, after an eviction) while the request lives."""

    request_id: str
    items: list[ItemHeader]


class ReleaseItems(msgspec.Struct, tag="release"):
    request_ids: list[str]


class EncodeItems(msgspec.Struct, tag="encode"):
    """Decoder -> encoder: make (or find in the cache) these items' embeddings."""

    mm_hashes: list[str]


class TranscribeAudio(msgspec.Struct, tag="transcribe"):
    """Frontend -> encoder: recognize one clip (the next frame: float32 samples at 16 kHz).
    `owner`: who it is for (tenant and client address), so the recognizer serves each owner's
    clips fairly beside the others' (workers/speech/fair_queue.py)."""

    request_id: str
    owner: str = ""


EncoderInput = RegisterItems | ReleaseItems | EncodeItems | TranscribeAudio | Shutdown


class SpeakText(msgspec.Struct, tag="speak", kw_only=True):
    """Frontend -> talker: more text of one spoken answer. The talker cuts the text into
    clauses and synthesizes each as soon as it is complete; `final` says no more text follows.
    `sample_rate`: the rate the client hears (the first message of an answer sets it)."""

    request_id: str
    text: str
    final: bool = False
    sample_rate: int = 24000
    speed: float = 1.0


class CancelSpeech(msgspec.Struct, tag="cancel_speech"):
    request_ids: list[str]


class StartSpeaking(msgspec.Struct, tag="start_speaking", kw_only=True):
    """Decoder -> talker (omni): an answer to speak, sent when its request is added, with how
    its talker prompt is made of the thinker's (engine/thinker_rows.py TalkerPrompt: `cut`,
    the `kept` and `items` ranges of thinker positions). With `has_positions` the next frame
    holds the talker prompt's M-RoPE positions (int64, [3, talker prompt length]); without,
    they are text positions."""

    speech: SpeechOptions
    cut: int
    kept: list[tuple[int, int]]
    items: list[tuple[int, int]] = []
    has_positions: bool = False
    mrope_delta: int = 0


class ThinkerRows(msgspec.Struct, tag="thinker_rows", kw_only=True):
    """Decoder -> talker (omni): the thinker's rows of one answer from position `start` on (the
    next frame: raw `dtype` values of `shape`, absent when `shape` is empty). `ended`: its text
    is over; `error`: it failed, and is not to be spoken."""

    speech_id: str
    start: int
    dtype: str = ""
    shape: list[int] = []
    ended: bool = False
    error: str | None = None


TalkerInput = SpeakText | CancelSpeech | StartSpeaking | ThinkerRows | Shutdown


class ItemEmbeddings(msgspec.Struct, tag="embeddings", kw_only=True):
    """Encoder -> decoder: one item's embeddings (the next frame, raw `dtype` values of
    `shape`), or why there are none."""

    mm_hash: str
    dtype: str = ""
    shape: list[int] = []
    error: str | None = None


class TokenLogprob(msgspec.Struct, array_like=True):
    sampled_logprob: float
    top: list[tuple[int, float]]


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


class EngineStatsSnapshot(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    # Multimodal: image tokens of admitted prompts; items the decoder asked the encoder for;
    # and, where the encoder runs in the same process, its global cache.
    image_tokens_in: int = 0
    encoder_items_requested: int = 0
    encoder_items_encoded: int = 0
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_used: int = 0
    encoder_cache_budget: int = 0


class PrefixCacheChanges(msgspec.Struct, array_like=True):
    """A data-parallel replica's prefix-cache index since its last StepOutputs: block hashes
    (engine/block_hash.py) that entered and left it; `cleared`: it was dropped before `stored`."""

    stored: list[bytes]
    evicted: list[bytes]
    cleared: bool = False


class StepOutputs(msgspec.Struct, tag="outputs"):
    deltas: list[RequestDelta]
    stats: EngineStatsSnapshot
    # Only from a replica that publishes its cache (EngineConfig.publish_cache_events).
    prefix_changes: PrefixCacheChanges | None = None


class WorkerReady(msgspec.Struct, tag="ready", kw_only=True):
    worker: str
    pid: int
    max_model_len: int = 0
    num_kv_blocks: int = 0
    # Embeddings the decoder may hold at once: a larger image can never be served.
    encoder_budget: int = 0
    # The model's vocabulary (its logits' width): the frontend's grammar checks use it.
    vocab_size: int = 0
    # The talker of an omni model: the speakers it has (a request's voice names one).
    voices: list[str] = []


class WorkerFailed(msgspec.Struct, tag="failed", kw_only=True):
    worker: str
    message: str


class CacheChanges(msgspec.Struct, tag="cache_changes"):
    """Encoder -> frontend: items that entered and left the global cache, for its mirror."""

    added: list[str]
    evicted: list[str]


class ItemsMissing(msgspec.Struct, tag="items_missing"):
    """Encoder -> frontend: asked for items registered without pixels that the cache no
    longer holds; the frontend sends their pixels."""

    mm_hashes: list[str]


class EncoderStats(msgspec.Struct, tag="encoder_stats", kw_only=True):
    """The global encoder cache, sent by the encoder with its heartbeats."""

    items_encoded: int = 0
    cache_queries: int = 0
    cache_hits: int = 0
    cache_used: int = 0
    cache_budget: int = 0
    cache_items: int = 0


class AudioTranscript(msgspec.Struct, tag="transcript", kw_only=True):
    """Encoder -> frontend: what a TranscribeAudio clip said, or why it could not be heard."""

    request_id: str
    text: str = ""
    no_speech_probability: float = 0.0
    audio_seconds: float = 0.0
    seconds: float = 0.0
    error: str | None = None
    # The clip waited past its deadline behind other clips and was not recognized: the
    # client may retry (429), the encoder is fine.
    busy: bool = False


class SpeechAudio(msgspec.Struct, tag="speech_audio", kw_only=True):
    """Talker -> frontend, on the speech socket: the next piece of an answer's audio (the next
    frame: 16-bit little-endian mono PCM at `sample_rate`; absent when empty). `text` is the
    clause it speaks. `final`: the answer's audio is complete (or failed: `error`)."""

    request_id: str
    sample_rate: int
    text: str = ""
    final: bool = False
    error: str | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    """Sent by a worker's main loop (never a side thread) at least every HEARTBEAT_INTERVAL_S
    while it is idle or between steps, so the frontend can tell a hung worker from a busy one."""

    worker: str
    pid: int


# How often an idle worker's main loop reports that it is alive.
HEARTBEAT_INTERVAL_S = 1.0

WorkerOutput = (StepOutputs | WorkerReady | WorkerFailed | Heartbeat | EncoderStats | CacheChanges | ItemsMissing
                | AudioTranscript)

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(DecoderInput)
_output_decoder = msgspec.msgpack.Decoder(WorkerOutput)
_encoder_input_decoder = msgspec.msgpack.Decoder(EncoderInput)
_embeddings_decoder = msgspec.msgpack.Decoder(ItemEmbeddings)
_talker_input_decoder = msgspec.msgpack.Decoder(TalkerInput)
_speech_decoder = msgspec.msgpack.Decoder(SpeechAudio)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes) -> DecoderInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> WorkerOutput:
    return _output_decoder.decode(data)


def decode_encoder_input(data: bytes) -> EncoderInput:
    return _encoder_input_decoder.decode(data)


def decode_embeddings(data: bytes) -> ItemEmbeddings:
    return _embeddings_decoder.decode(data)


def decode_talker_input(data: bytes) -> TalkerInput:
    return _talker_input_decoder.decode(data)


def decode_speech(data: bytes) -> SpeechAudio:
    return _speech_decoder.decode(data)
