"""The flags of `antiphon serve`, made from the config dataclasses.

A flag that sets one field of EngineConfig or ServerConfig has the field's name as its dest,
its annotation as its type and the field's default as its own: defaults are written once, in
the dataclasses. The few flags that do not map one to one (`--no-prefix-caching`,
`--async-scheduling`, ...) are written out below, and `engine_config_from` /
`server_config_from` turn them into fields. `scripts/flag_table.py` makes the flag table of
docs/configuration.md from this parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing

from engine.config import (ATTENTION_BACKENDS, CPU_KV_CACHE_GIB, DECODE_GRAPH_MODES, DTYPES, KV_CACHE_DTYPES,
                           QUANTIZATION_MODES, EngineConfig)
from frontend.replica_router import POLICIES
from frontend.server_config import ServerConfig

# --async-scheduling's words for EngineConfig.async_scheduling (None: on with CUDA, off on CPU).
ON_OFF = {"auto": None, "on": True, "off": False}


def field_default(config: type, name: str):
    """The default a field of a config dataclass has (a fresh one where it has a factory)."""
    spec = next(f for f in dataclasses.fields(config) if f.name == name)
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


# Defaults a value cannot say (None, or an empty list, that the server derives from something
# else), by dest; --help and the docs show these words instead.
DERIVED_DEFAULTS = {
    "model": "the embedded SmolLM2-135M-Instruct",
    "num_kv_blocks": "sized from --kv-cache-memory-gib, capped at what --max-num-seqs full-length requests fill",
    "kv_cache_memory_gib": f"{CPU_KV_CACHE_GIB:g} on a CPU; on CUDA what --gpu-memory-utilization leaves after "
                           "the weights and a profiling step",
    "max_model_len": "the model's",
    "encoder_cache_size": "the larger of a step's token budget and the largest image, plus one more image",
    "quantization": "auto, or $ANTIPHON_QUANTIZATION",
    "asr_model": "the packaged Whisper tiny.en",
    "hidden_state_store_gib": "what the KV pool needs (no bound)",
    "tts_voice": "the packaged Piper joe voice",
    "ray_address": "none: local processes",
    "decoder_threads": "a thread per core; with --data-parallel-size on one machine, the cores split between "
                       "the replicas",
    "api_keys": "$ANTIPHON_API_KEY, comma-separated, else none",
    "cache_salt_per_key": "per key with two or more keys, else shared",
    "allowed_hosts": "loopback names when bound to loopback, else any",
    "max_message_bytes": f"{field_default(ServerConfig, 'max_message_bytes') >> 20} MiB; for a model that takes "
                         "images, that and one largest image as base64",
}


class FieldFlags:
    """Adds to `group` flags that each set the field of `config` named by their dest."""

    def __init__(self, group, config: type) -> None:
        self.group = group
        self.config = config
        self.types = typing.get_type_hints(config)

    def add(self, field: str, help: str, *, flag: str | None = None,
            choices: typing.Sequence[str] | None = None) -> argparse.Action:
        # A field in seconds (`_s`) is the flag without the unit: --idle-timeout.
        flag = flag or "--" + field.removesuffix("_s").replace("_", "-")
        default = field_default(self.config, field)
        kind = self.types[field]
        if isinstance(kind, types.UnionType):  # `int | None` takes an int
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        if kind is bool:
            if default is not False:
                raise TypeError(f"{field}: a flag can only turn a bool on; write the --no- flag out")
            return self.group.add_argument(flag, action="store_true", dest=field, help=help)
        if typing.get_origin(kind) is list:
            if default:
                # argparse's append adds to the default: the flag could never clear those values.
                raise TypeError(f"{field}: a repeatable flag needs an empty default; write the flag out")
            return self.group.add_argument(flag, action="append", default=default, dest=field, help=help)
        return self.group.add_argument(flag, type=None if kind is str else kind, choices=choices, default=default,
                                       dest=field, help=help)


class DefaultsShown(argparse.HelpFormatter):
    """`--help` with each flag's default after its help (the words of `shown_default`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        shown = shown_default(action)
        # argparse %-formats help strings: a default's own % (a percentage, a format) is text.
        return f"{action.help} (default: {shown.replace('%', '%%')})" if shown and action.help else action.help


def shown_default(action: argparse.Action) -> str:
    """A flag's default in words, for --help and the docs."""
    default = action.default
    if action.dest in DERIVED_DEFAULTS:
        return DERIVED_DEFAULTS[action.dest]
    if default is argparse.SUPPRESS:
        return ""
    if action.nargs == 0:  # a switch
        return "off"
    if default is None or default == []:
        return "none"
    if action.dest.endswith("_bytes") and isinstance(default, int) and default % 1024 == 0:
        return f"{default >> 20} MiB" if default % (1 << 20) == 0 else f"{default >> 10} KiB"
    if isinstance(default, float):
        default = f"{default:g}"
    if action.dest.endswith(("_s", "_seconds")):
        return f"{default} s"
    if action.dest.endswith("_gib"):
        return f"{default} GiB"
    return str(default)


def serve_parser() -> argparse.ArgumentParser:
    """`antiphon serve`'s parser on its own (the docs' table and the tests read it)."""
    parser = argparse.ArgumentParser(prog="antiphon serve", formatter_class=DefaultsShown)
    add_serve_options(parser)
    return parser


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    _add_engine_options(parser.add_argument_group(
        "engine", "EngineConfig (engine/config.py); the offline LLM takes the same names as keywords"))
    _add_server_options(parser.add_argument_group(
        "server", "ServerConfig (frontend/server_config.py): where the server listens and the limits it enforces"))


def _add_engine_options(group) -> None:
    engine = FieldFlags(group, EngineConfig)
    engine.add("model", "a local Hugging Face folder; nothing is downloaded")
    engine.add("device", "cpu, cuda, cuda:N, or auto: cuda when available, else cpu")
    engine.add("dtype", "auto: float32 on CPU, the checkpoint's dtype on CUDA", choices=DTYPES)
    engine.add("block_size", "tokens per KV block")
    engine.add("num_kv_blocks", "the KV pool's size in blocks")
    engine.add("kv_cache_memory_gib", "the KV pool's size in GiB")
    engine.add("gpu_memory_utilization", "fraction of the GPU's memory the engine may use (weights, activations, KV)")
    engine.add("kv_cache_dtype",
               "what the KV cache holds: auto is the model's dtype (float32 on CPU, which exact greedy parity "
               "needs); bfloat16 halves a float32 CPU model's cache (twice the tokens per GiB, and half the bytes a "
               "decode step reads where the native decode attention serves) at the cost of rounding keys and "
               "values; a dtype other than the model's on CPU only", choices=KV_CACHE_DTYPES)
    engine.add("attention_backend", "auto: Triton kernels on CUDA, torch on CPU; see docs/gpu.md",
               choices=ATTENTION_BACKENDS)
    engine.add("decode_graphs", "CUDA graphs of decode steps: auto captures them with CUDA and the Triton "
                                "backend; padded-eager runs their padded buffers without a capture; see docs/gpu.md",
               choices=DECODE_GRAPH_MODES)
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (same as --decode-graphs off)")
    engine.add("max_graph_batch_size", "largest decode batch captured in a CUDA graph; larger batches run eagerly")
    group.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    engine.add("max_num_batched_tokens", "token budget of one step, decodes and prefill chunks together")
    engine.add("max_num_seqs", "most requests running at once")
    engine.add("max_model_len", "context length; longer prompts are refused up front")
    group.add_argument("--async-scheduling", choices=list(ON_OFF),
                       default=_on_off(field_default(EngineConfig, "async_scheduling")),
                       help="schedule step N+1 while step N runs; auto: on with CUDA, off on CPU, where it "
                            "measures as a loss")
    engine.add("encoder_cache_size", "embeddings the decoder may hold or wait for at once, logged at start; "
                                     "a larger image: 400 image_too_large")
    # None leaves EngineConfig's own default, which reads $ANTIPHON_QUANTIZATION when it is made.
    group.add_argument("--quantization", choices=["auto", *QUANTIZATION_MODES], default=None,
                       help="CPU linear layers: none is exact (float32); bf16 halves the bytes read (fast on CPUs "
                            "with native bfloat16); int4 reads 4-bit weights for small batches (lossy unless the "
                            "checkpoint was 4-bit); int8 loses quality on small models; auto: int4 for layers "
                            "already on the 4-bit grid (the default model's are) where the CPU has native "
                            "bfloat16 or runs the native 4-bit kernel (AVX2), the other layers bf16 with native "
                            "bfloat16, else none; see docs/cpu-backend.md")
    engine.add("encoder_cache_gib", "memory of the encoder's global cross-request cache of image embeddings, "
                                    "logged at start with how many of the largest images it holds")
    group.add_argument("--no-encoder-cache", action="store_true",
                       help="turn the encoder's global cache off: every image is encoded, to measure what the "
                            "cache saves")
    engine.add("encoder_timeout_s", "a request whose image the encoder has not delivered after this long fails")
    # The server serves voice unless told not to; the offline LLM (EngineConfig's default) does not.
    group.add_argument("--no-voice", action="store_true",
                       help="serve text only: no speech recognition (encoder) nor synthesis (talker process); "
                            "audio events and endpoints answer unsupported_modality / 503")
    engine.add("asr_model", "a local Whisper folder for speech recognition")
    engine.add("hidden_state_store_gib", "an omni model's spoken answers: the most host memory the store of the "
                                         "thinker's rows for the talker may take (it mirrors the KV pool: about an "
                                         "eighth of its bytes for Qwen2.5-Omni-7B); a pool that needs more is "
                                         "refused at start")
    engine.add("max_spoken_codes", "an omni model's spoken answers: the most codec tokens one answer's speech "
                                   "may take (Qwen2.5-Omni: 50 a second; Qwen3-Omni: 12.5 frames a second)")
    engine.add("talker_threads", "an omni model's spoken answers on a CPU: the talker process's torch threads "
                                 "(default: a quarter of the cores, at least one)")
    engine.add("decoder_threads", "CPU threads of each decoder's torch")
    engine.add("tts_voice", "a Piper voice .onnx file, its .onnx.json beside it")


def _add_server_options(group) -> None:
    server = FieldFlags(group, ServerConfig)
    server.add("host", "address to listen on")
    server.add("data_parallel_size", "replicas of the engine (each its own decoder, KV pool, prefix cache and "
                                     "encoder) behind a cache-aware router; see docs/scale-out.md")
    server.add("routing_policy", "how a request picks its replica: the longest cached prefix within a load "
                                 "band (cache-aware), or least-loaded, or round-robin", choices=POLICIES)
    server.add("ray_address", "with --data-parallel-size: run the replicas as actors of this Ray cluster (auto: "
                              "the one this machine belongs to), their links to this front end on CurveZMQ tcp; "
                              "needs pip install -e '.[ray]'")
    server.add("port", "port to listen on")
    # None: $ANTIPHON_API_KEY, read by `server_config_from`.
    group.add_argument("--api-key", action="append", default=None, dest="api_keys",
                       help="require this key (repeatable: one per tenant) as Authorization: Bearer KEY, or from "
                            "browsers as the WebSocket subprotocol openai-insecure-api-key.KEY; else 401 "
                            "invalid_api_key")
    salt = group.add_mutually_exclusive_group()
    salt.add_argument("--cache-salt-per-key", action="store_const", const=True,
                      default=field_default(ServerConfig, "cache_salt_per_key"), dest="cache_salt_per_key",
                      help="give each API key its own prefix- and encoder-cache salt, even with one key: tenants "
                           "never share KV blocks or image embeddings, nor learn from each other's cache-hit timing")
    salt.add_argument("--share-cache-across-keys", action="store_const", const=False, dest="cache_salt_per_key",
                      help="let tenants share cached prefixes and image embeddings on purpose, and so learn from "
                           "each other's cache-hit timing")
    server.add("public_metrics", "serve /metrics without an API key when keys are configured; its counters "
                                 "tell one tenant what another sends")
    server.add("share_per_tenant", "fraction of --max-grammar-compiles, --max-transcriptions and "
                                   "--max-spoken-answers one API key may hold, with two or more keys")
    server.add("share_per_client", "the same fraction, for one client address")
    server.add("spoken_answers_per_key", "spoken chat answers whose transcripts are kept per API key, for clients "
                                         "that send an answer back by its audio id")
    server.add("spoken_answer_ttl_s", "how long a spoken answer's audio id stays valid (its expires_at); an "
                                      "unknown or expired id: 400 audio_expired")
    server.add("allowed_origins", "browser Origin allowed on the WebSocket besides the server's own (repeatable; "
                                  "* = any); else close 1008 origin_not_allowed", flag="--allowed-origin")
    server.add("allowed_hosts", "Host header served (repeatable; * = any); else 400 host_not_allowed, which "
                                "stops DNS rebinding", flag="--allowed-host")
    # None: derived from the model by `server_config_from`.
    group.add_argument("--max-message-bytes", type=int, default=None,
                       help="largest HTTP body or WebSocket message; past it 413 request_too_large, or "
                            "message_too_large (over 4x it the socket closes with 1009)")
    server.add("max_image_bytes", "largest image, encoded; past it 400 image_too_large")
    server.add("max_image_pixels", "width x height, read from the header before decoding; past it 400 "
                                   "image_too_many_pixels")
    server.add("max_images_per_request", "images one request may hold; past it 400 too_many_images")
    server.add("max_audio_clips_per_request", "audio clips one request may hold, for a model that hears them (an "
                                              "omni model); past it 400 too_many_audio_clips")
    server.add("allowed_local_media_path", "a folder whose files requests may name as images, by path or file:// "
                                           "URL; else local_file_not_allowed (remote URLs are never fetched)")
    server.add("max_prompt_tokens", "longest prompt after the chat template, within the context; past it 400 "
                                    "prompt_too_long, before tokenizing when its bytes alone show it")
    server.add("default_max_tokens", "output tokens when a client asks for none or for inf")
    server.add("max_waiting_requests", "requests queued beyond the decoder's --max-num-seqs; past it 429 "
                                       "too_many_requests with Retry-After")
    server.add("max_concurrent_per_connection", "responses one connection may run at once; past it too_many_responses")
    server.add("max_connections", "HTTP requests being handled + open WebSockets (/health and /metrics exempt); "
                                  "past it 503 or close 1013, too_many_connections")
    server.add("max_connections_per_client", "the same, per client address; behind a proxy every client has the "
                                             "proxy's, so raise it there")
    server.add("max_conversation_items", "items a Realtime conversation may hold: a client item past it gets "
                                         "conversation_full, an answer evicts the oldest items")
    server.add("max_conversation_bytes", "text a Realtime conversation may hold, instructions and answers included")
    server.add("max_conversation_audio_seconds", "audio a Realtime conversation keeps for a model that hears it (an "
                                                 "omni model); past it, or past max_audio_clips_per_request clips, "
                                                 "its oldest user items with audio are evicted")
    server.add("max_events_per_second", "Realtime client events per connection (bursts of twice that); past it "
                                        "rate_limit_exceeded and the event is dropped")
    server.add("max_stop_strings", "stop strings one request may give; past it 400 invalid_value")
    server.add("max_logprobs", "largest top_logprobs / logprobs a request may ask")
    server.add("max_choices", "largest n (choices per request)")
    server.add("max_grammar_bytes", "largest JSON schema, regex, choice list or grammar of a structured-output "
                                    "request")
    server.add("max_grammar_compiles", "grammar checks compiling at once, each in its own killable process, "
                                       "shared per tenant and per client; past it 429 grammar_busy")
    server.add("max_messages", "messages one chat request may hold, refused before any templating")
    server.add("max_queued_events", "events a Realtime session holds while its earlier work runs; past it an "
                                    "error event and the event is dropped")
    server.add("grammar_compile_timeout_s", "a schema or grammar that takes longer to compile is refused: 400 "
                                            "grammar_too_complex")
    server.add("max_tools", "tools one request may offer")
    server.add("max_prompts_per_request", "prompts in one /v1/completions batch")
    server.add("accept_unknown_fields", "drop (and log) request fields this server does not know, instead of 400 "
                                        "unsupported_parameter naming the field")
    server.add("header_timeout_s", "time a client has to send its request headers; then the connection closes")
    server.add("body_timeout_s", "time a client then has to send its body; then 408 request_timeout")
    server.add("idle_timeout_s", "a WebSocket with no message and no active response for this long is closed")
    server.add("max_worker_restarts", "restarts of one worker within --worker-restart-window; one more and the "
                                      "server exits with status 1")
    server.add("worker_restart_window_s", "time over which a worker's restarts are counted against "
                                          "--max-worker-restarts")
    server.add("worker_timeout_s", "a worker that sends nothing (not even a heartbeat) for this long is killed "
                                   "and restarted")
    server.add("max_audio_bytes", "largest audio upload; past it 413 request_too_large")
    server.add("max_audio_seconds", "longest audio upload; past it 400 audio_too_long")
    server.add("max_speech_input_chars", "longest text one /v1/audio/speech request may speak")
    server.add("max_audio_buffer_seconds", "audio a Realtime session may buffer before a commit, and one "
                                           "input_audio part; past it input_audio_buffer_full")
    server.add("max_transcriptions", "clips (30 s windows) recognized or queued at once, server-wide; past it "
                                     "429 voice_busy")
    server.add("max_spoken_answers", "answers spoken at once, server-wide; past it 429 voice_busy")
    server.add("max_audio_speedup", "seconds of audio a Realtime session may append per second (bursts of 30 s); "
                                    "past it rate_limit_exceeded")
    group.add_argument("--ws-compression", action="store_true",
                       help="accept permessage-deflate on WebSockets; compressing every small event costs "
                            "CPU on both ends and delays tokens")
    group.add_argument("--verbose", action="store_true",
                       help="INFO logs from every part, uvicorn's included; without it the server's own start-up "
                            "lines, warnings and errors")


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    given = _fields_given(EngineConfig, args)
    given.update(enable_prefix_caching=not args.no_prefix_caching, enable_encoder_cache=not args.no_encoder_cache,
                 voice=not args.no_voice, async_scheduling=ON_OFF[args.async_scheduling],
                 decode_graphs=_decode_graphs(args))
    if args.quantization is None:
        del given["quantization"]  # EngineConfig's default: $ANTIPHON_QUANTIZATION, else auto
    return EngineConfig(**given)


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    given = _fields_given(ServerConfig, args)
    given.update(api_keys=_api_keys(args.api_keys),
                 max_message_bytes=_message_bytes(args.max_message_bytes, args.model, args.max_image_bytes))
    return ServerConfig(**given)


def _fields_given(config: type, args: argparse.Namespace) -> dict:
    """The fields of `config` that a flag of the same dest sets."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(config) if hasattr(args, f.name)}


def _on_off(value: bool | None) -> str:
    return next(word for word, meant in ON_OFF.items() if meant is value)


def _decode_graphs(args: argparse.Namespace) -> str:
    if args.enforce_eager and args.decode_graphs not in ("auto", "off"):
        raise ValueError(f"--enforce-eager contradicts --decode-graphs {args.decode_graphs}")
    return "off" if args.enforce_eager else args.decode_graphs


def _api_keys(given: list[str] | None) -> list[str]:
    if given:
        return given
    from_env = os.environ.get("ANTIPHON_API_KEY", "")
    return [key.strip() for key in from_env.split(",") if key.strip()]


def _message_bytes(given: int | None, model: str | None, max_image_bytes: int) -> int:
    """--max-message-bytes, or its default: ServerConfig's, and room for one largest image (as
    a base64 data URL) when the model takes images."""
    if given is not None:
        return given
    base = field_default(ServerConfig, "max_message_bytes")
    if model is None:
        return base  # the embedded default model is text-only
    from pathlib import Path

    from transformers import AutoConfig

    from engine.adapters import ADAPTERS

    try:
        takes_images = AutoConfig.from_pretrained(Path(model).expanduser()).model_type in ADAPTERS
    except (OSError, ValueError):
        return base  # the model folder is checked, with a clear error, when it loads
    return base + (max_image_bytes * 4 // 3 + 4 if takes_images else 0)
