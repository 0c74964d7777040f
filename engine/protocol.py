"""Wire messages between the frontend, the decoder and the encoder.

Every process imports these structs; they travel as msgpack over ZeroMQ. Nothing is
pickled. One decoder step sends one `StepOutputs` carrying the new tokens of every request
in it.
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


class WorkerFailed(msgspec.Struct, tag="failed", kw_only=True):
    worker: str
    message: str


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    """Sent by a worker's main loop (never a side thread) at least every HEARTBEAT_INTERVAL_S
    while it is idle or between steps, so the frontend can tell a hung worker from a busy one."""

    worker: str
    pid: int


# How often an idle worker's main loop reports that it is alive.
HEARTBEAT_INTERVAL_S = 1.0

WorkerOutput = StepOutputs | WorkerReady | WorkerFailed | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(DecoderInput)
_output_decoder = msgspec.msgpack.Decoder(WorkerOutput)


def encode(message) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes) -> DecoderInput:
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> WorkerOutput:
    return _output_decoder.decode(data)
