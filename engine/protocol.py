"""Wire messages between the frontend, the decoder and the encoder.

Every process imports these structs; they travel as msgpack over ZeroMQ. Nothing is
pickled. One decoder step sends one `StepOutputs` carrying the new tokens of every request
in it. Arrays (an item's pixels, its embeddings) travel as separate zero-copy frames after a
msgpack header that gives their dtype and shape.
"""

from __future__ import annotations

import msgspec

from engine.request import MultiModalPlaceholder
from engine.sampling_params import SamplingParams


class EngineRequest(msgspec.Struct, tag="add", kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    cache_salt: str | None = None
    # Where each image or audio item sits in the prompt; its pixels go to the encoder.
    mm_placeholders: list[MultiModalPlaceholder] = []


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


DecoderInput = EngineRequest | AbortRequests | Shutdown


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


EncoderInput = RegisterItems | ReleaseItems | EncodeItems | Shutdown


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


class StepOutputs(msgspec.Struct, tag="outputs"):
    deltas: list[RequestDelta]
    stats: EngineStatsSnapshot


class WorkerReady(msgspec.Struct, tag="ready", kw_only=True):
    worker: str
    pid: int
    max_model_len: int = 0
    num_kv_blocks: int = 0
    # Embeddings the decoder may hold at once: a larger image can never be served.
    encoder_budget: int = 0


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


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    """Sent by a worker's main loop (never a side thread) at least every HEARTBEAT_INTERVAL_S
    while it is idle or between steps, so the frontend can tell a hung worker from a busy one."""

    worker: str
    pid: int


# How often an idle worker's main loop reports that it is alive.
HEARTBEAT_INTERVAL_S = 1.0

WorkerOutput = StepOutputs | WorkerReady | WorkerFailed | Heartbeat | EncoderStats | CacheChanges | ItemsMissing

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(DecoderInput)
_output_decoder = msgspec.msgpack.Decoder(WorkerOutput)
_encoder_input_decoder = msgspec.msgpack.Decoder(EncoderInput)
_embeddings_decoder = msgspec.msgpack.Decoder(ItemEmbeddings)


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
