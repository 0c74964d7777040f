"""The `antiphon` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="antiphon", description="Antiphon serving engine")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate offline with a model (default: the embedded one)")
    generate.add_argument("prompt", nargs="+", help="one or more prompts")
    generate.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2)")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    generate.add_argument("--verbose", action="store_true")

    serve = commands.add_parser("serve", help="run the server (HTTP, WebSocket, web page) with the worker processes")
    serve.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2)")
    _add_engine_options(serve)
    _add_server_options(serve)
    serve.add_argument("--verbose", action="store_true")

    chat = commands.add_parser("chat", help="chat in the terminal with a running server (Realtime WebSocket)")
    chat.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime")
    chat.add_argument("--api-key", default=os.environ.get("ANTIPHON_API_KEY"))
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--system", default=None, help="instructions for the assistant")
    chat.add_argument("--verbose", action="store_true")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve":
        # A server says where it listens and what it is doing while it starts.
        logging.getLogger("antiphon").setLevel(logging.INFO)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "chat":
        from frontend.chat_cli import run_chat
        return run_chat(args)
    return 2


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument("--kv-cache-memory-gib", type=float, default=None,
                       help="KV pool size (default: 2 on a CPU; on CUDA what --gpu-memory-utilization leaves "
                            "after the weights and a profiling step)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of the GPU's memory the engine may use (weights, activations, KV)")
    from engine.config import ATTENTION_BACKENDS, DECODE_GRAPH_MODES, DTYPES

    group.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    group.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="auto: float32 on CPU, the checkpoint's dtype on CUDA")

    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                       help="auto: Triton kernels on CUDA, torch on CPU")
    group.add_argument("--decode-graphs", choices=DECODE_GRAPH_MODES, default="auto",
                       help="CUDA graphs for decode steps (auto: on with CUDA and the Triton backend)")
    group.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (same as --decode-graphs off)")
    group.add_argument("--max-graph-batch-size", type=int, default=256,
                       help="largest decode batch captured in a CUDA graph; larger batches run eagerly")
    group.add_argument("--no-prefix-caching", action="store_true")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument("--max-num-seqs", type=int, default=256)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                       help="schedule step N+1 while step N runs (auto: on with CUDA, off on CPU)")
    group.add_argument("--encoder-cache-size", type=int, default=None,
                       help="embeddings the decoder may hold or wait for at once (default: derived from the "
                            "largest image and the token budget, plus one image)")
    from engine.config import KV_CACHE_DTYPES, QUANTIZATION_MODES

    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="what the KV cache holds: auto (default) is the model's dtype (float32 on CPU, which "
                            "exact greedy parity needs); bfloat16 halves a float32 CPU model's cache (twice the "
                            "tokens per GiB; where the native decode attention serves, as for the default model "
                            "here, half the bytes a decode step reads: ~1.1x at 16 streams) at the cost of rounding "
                            "keys and values; another dtype than the model's on CPU only")

    group.add_argument("--quantization", choices=["auto", *QUANTIZATION_MODES],
                       default=None,
                       help="CPU linear layers: none is exact (float32; own AVX-512 kernel, else oneDNN); bf16 halves the bytes read "
                            "(fast on CPUs with native bfloat16); int4 reads 4-bit weights for small batches (lossy "
                            "unless the checkpoint was 4-bit); int8 loses quality on small models; auto (default, or "
                            "$ANTIPHON_QUANTIZATION): where the CPU has native bfloat16, int4 for layers already on "
                            "the 4-bit grid (the default model's are: bf16-level accuracy) and bf16 for the rest, else none")
    group.add_argument("--encoder-cache-gib", type=float, default=1.0,
                       help="memory of the encoder's global cross-request cache of image embeddings (default 1)")
    group.add_argument("--no-encoder-cache", action="store_true",
                       help="turn the global cross-request encoder cache off (every image is encoded)")
    group.add_argument("--encoder-timeout", type=float, default=60.0, dest="encoder_timeout_s",
                       help="a request whose image the encoder has not delivered after this long fails")


def _add_server_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", action="append", default=None, dest="api_keys",
                       help="require this key (repeatable: one per tenant; default: $ANTIPHON_API_KEY, "
                            "comma-separated, or none)")
    salt = group.add_mutually_exclusive_group()
    salt.add_argument("--cache-salt-per-key", action="store_const", const=True, default=None,
                      dest="cache_salt_per_key",
                      help="give each API key its own prefix- and encoder-cache salt even with one key (the default "
                           "with two or more keys: tenants never share KV blocks or image embeddings)")
    salt.add_argument("--share-cache-across-keys", action="store_const", const=False, dest="cache_salt_per_key",
                      help="let tenants share cached prefixes and image embeddings on purpose (and so learn from "
                           "each other's cache-hit timing)")
    group.add_argument("--public-metrics", action="store_true",
                       help="serve /metrics without an API key when keys are configured")
    group.add_argument("--share-per-tenant", type=float, default=0.5,
                       help="fraction of the grammar-compile, transcription and spoken-answer caps one API key may "
                            "hold (with two or more keys; default 0.5)")
    group.add_argument("--share-per-client", type=float, default=0.25,
                       help="fraction of those caps one client address may hold (default 0.25)")
    group.add_argument("--spoken-answers-per-key", type=int, default=4096,
                       help="spoken chat answers whose transcripts are kept per API key, for clients that send an "
                            "answer back by its audio id (default 4096)")
    group.add_argument("--spoken-answer-ttl", type=float, default=3600.0, dest="spoken_answer_ttl_s",
                       help="seconds a spoken answer's audio id stays valid (its expires_at; default 3600)")
    group.add_argument("--allowed-origin", action="append", default=[], dest="allowed_origins",
                       help="browser Origin allowed on the WebSocket besides the server's own (repeatable; * = any)")
    group.add_argument("--allowed-host", action="append", default=[], dest="allowed_hosts",
                       help="Host header served (repeatable; * = any; default: loopback names when bound to "
                            "loopback, else any)")
    group.add_argument("--max-message-bytes", type=int, default=None,
                       help="largest HTTP body / WebSocket message (default 1 MiB; for a model that takes "
                            "images, 1 MiB more than one largest image as base64)")
    group.add_argument("--max-image-bytes", type=int, default=20 << 20)
    group.add_argument("--max-image-pixels", type=int, default=16_000_000,
                       help="width x height, checked from the header before decoding")
    group.add_argument("--max-images-per-request", type=int, default=8)
    group.add_argument("--allowed-local-media-path", default=None,
                       help="a folder whose files requests may name as images (default: none)")
    group.add_argument("--max-prompt-tokens", type=int, default=8192)
    group.add_argument("--default-max-tokens", type=int, default=1024)
    group.add_argument("--max-waiting-requests", type=int, default=4096,
                       help="requests queued beyond the decoder's --max-num-seqs before 429")
    group.add_argument("--max-concurrent-per-connection", type=int, default=4)
    group.add_argument("--max-connections", type=int, default=4096,
                       help="HTTP requests being handled + open WebSockets (/health and /metrics exempt)")
    group.add_argument("--max-connections-per-client", type=int, default=64,
                       help="the same, per client address (behind a proxy every client has the proxy's)")
    group.add_argument("--max-conversation-items", type=int, default=512)
    group.add_argument("--max-conversation-bytes", type=int, default=1 << 20,
                       help="text a Realtime conversation may hold, instructions and answers included")
    group.add_argument("--max-events-per-second", type=float, default=200.0,
                       help="Realtime client events per connection (bursts of twice that)")
    group.add_argument("--max-stop-strings", type=int, default=8)
    group.add_argument("--max-logprobs", type=int, default=20, help="largest top_logprobs / logprobs a request may ask")
    group.add_argument("--max-choices", type=int, default=16, help="largest n (choices per request)")
    group.add_argument("--max-grammar-bytes", type=int, default=64 << 10,
                       help="largest JSON schema, regex, choice list or grammar of a structured-output request")
    group.add_argument("--max-grammar-compiles", type=int, default=2,
                       help="grammar checks compiling at once, each in its own killable process (default 2; shared "
                            "per tenant and per client); past it 429 grammar_busy")
    group.add_argument("--max-messages", type=int, default=2048,
                       help="messages one chat request may hold, refused before any templating (default 2048)")
    group.add_argument("--max-queued-events", type=int, default=64,
                       help="events a Realtime session holds while its earlier work runs (default 64); past it an "
                            "error event and the event is dropped")
    group.add_argument("--grammar-compile-timeout", type=float, default=10.0, dest="grammar_compile_timeout_s",
                       help="a schema or grammar that takes longer to compile is refused (400 grammar_too_complex)")
    group.add_argument("--max-tools", type=int, default=128, help="tools one request may offer")
    group.add_argument("--max-prompts-per-request", type=int, default=64,
                       help="prompts in one /v1/completions batch")
    group.add_argument("--accept-unknown-fields", action="store_true",
                       help="ignore request fields this server does not know (default: 400 unsupported_parameter)")
    group.add_argument("--header-timeout", type=float, default=10.0, dest="header_timeout_s")
    group.add_argument("--body-timeout", type=float, default=30.0, dest="body_timeout_s")
    group.add_argument("--idle-timeout", type=float, default=600.0, dest="idle_timeout_s")
    group.add_argument("--max-worker-restarts", type=int, default=3)
    group.add_argument("--worker-restart-window", type=float, default=600.0, dest="worker_restart_window_s",
                       help="seconds over which a worker's restarts are counted against --max-worker-restarts")
    group.add_argument("--worker-timeout", type=float, default=30.0, dest="worker_timeout_s",
                       help="a worker that sends nothing for this many seconds is killed and restarted")
    group.add_argument("--no-voice", action="store_true",
                       help="serve text only: no speech recognition (encoder) nor synthesis (talker process)")
    group.add_argument("--asr-model", default=None,
                       help="a local Whisper folder for speech recognition (default: the packaged tiny.en)")
    group.add_argument("--tts-voice", default=None,
                       help="a Piper voice .onnx file (its .onnx.json beside it; default: the packaged joe voice)")
    group.add_argument("--max-audio-bytes", type=int, default=25 << 20, help="largest audio upload")
    group.add_argument("--max-audio-seconds", type=float, default=600.0, help="longest audio upload")
    group.add_argument("--max-speech-input-chars", type=int, default=4096,
                       help="longest text one /v1/audio/speech request may speak")
    group.add_argument("--max-audio-buffer-seconds", type=float, default=120.0,
                       help="audio a Realtime session may buffer before a commit (and one input_audio part)")
    group.add_argument("--max-transcriptions", type=int, default=16,
                       help="clips (30 s windows) recognized or queued at once, server-wide")
    group.add_argument("--max-spoken-answers", type=int, default=16, help="answers spoken at once, server-wide")
    group.add_argument("--max-audio-speedup", type=float, default=4.0,
                       help="seconds of audio a Realtime session may append per second (bursts of 30 s)")
    group.add_argument("--ws-compression", action="store_true",
                       help="accept permessage-deflate on WebSockets (off: compressing every small event "
                            "costs CPU on both ends and delays tokens)")


def _message_bytes(given: int | None, model: str | None, max_image_bytes: int) -> int:
    """--max-message-bytes, or its default: 1 MiB, and room for one largest image (as a
    base64 data URL) when the model takes images."""
    if given is not None:
        return given
    base = 1 << 20
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


def _decode_graphs(args) -> str:
    if args.enforce_eager and args.decode_graphs not in ("auto", "off"):
        raise ValueError(f"--enforce-eager contradicts --decode-graphs {args.decode_graphs}")
    return "off" if args.enforce_eager else args.decode_graphs


def _serve(args) -> int:
    import uvicorn

    from engine.config import EngineConfig
    from frontend.app import build_app
    from frontend.http_timeouts import protocol_with_timeouts
    from frontend.server_config import ServerConfig

    try:
        engine_config = EngineConfig(
            model=args.model, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_gib=args.kv_cache_memory_gib, enable_prefix_caching=not args.no_prefix_caching,
            gpu_memory_utilization=args.gpu_memory_utilization, device=args.device, dtype=args.dtype,
            attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
            decode_graphs=_decode_graphs(args),
            max_graph_batch_size=args.max_graph_batch_size,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
            encoder_cache_size=args.encoder_cache_size, enable_encoder_cache=not args.no_encoder_cache,
            encoder_cache_gib=args.encoder_cache_gib,
            # Unset: EngineConfig's default ($ANTIPHON_QUANTIZATION, else auto).
            **({} if args.quantization is None else {"quantization": args.quantization}),
            encoder_timeout_s=args.encoder_timeout_s, voice=not args.no_voice, asr_model=args.asr_model,
            tts_voice=args.tts_voice)
        server_config = ServerConfig(
            host=args.host, port=args.port, api_keys=_api_keys(args.api_keys),
            cache_salt_per_key=args.cache_salt_per_key, public_metrics=args.public_metrics,
            share_per_tenant=args.share_per_tenant, share_per_client=args.share_per_client,
            spoken_answers_per_key=args.spoken_answers_per_key, spoken_answer_ttl_s=args.spoken_answer_ttl_s,
            allowed_origins=args.allowed_origins,
            allowed_hosts=args.allowed_hosts,
            max_message_bytes=_message_bytes(args.max_message_bytes, args.model, args.max_image_bytes),
            max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
            max_images_per_request=args.max_images_per_request,
            allowed_local_media_path=args.allowed_local_media_path,
            max_prompt_tokens=args.max_prompt_tokens, default_max_tokens=args.default_max_tokens,
            max_waiting_requests=args.max_waiting_requests,
            max_concurrent_per_connection=args.max_concurrent_per_connection, max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
            max_conversation_items=args.max_conversation_items,
            max_conversation_bytes=args.max_conversation_bytes, max_events_per_second=args.max_events_per_second,
            max_stop_strings=args.max_stop_strings, max_logprobs=args.max_logprobs, max_choices=args.max_choices,
            max_grammar_bytes=args.max_grammar_bytes, grammar_compile_timeout_s=args.grammar_compile_timeout_s,
            max_grammar_compiles=args.max_grammar_compiles, max_messages=args.max_messages,
            max_queued_events=args.max_queued_events,
            max_tools=args.max_tools,
            max_prompts_per_request=args.max_prompts_per_request, accept_unknown_fields=args.accept_unknown_fields,
            header_timeout_s=args.header_timeout_s,
            body_timeout_s=args.body_timeout_s, idle_timeout_s=args.idle_timeout_s,
            max_worker_restarts=args.max_worker_restarts, worker_restart_window_s=args.worker_restart_window_s,
            worker_timeout_s=args.worker_timeout_s, max_audio_bytes=args.max_audio_bytes,
            max_audio_seconds=args.max_audio_seconds, max_speech_input_chars=args.max_speech_input_chars,
            max_audio_buffer_seconds=args.max_audio_buffer_seconds, max_transcriptions=args.max_transcriptions,
            max_spoken_answers=args.max_spoken_answers, max_audio_speedup=args.max_audio_speedup)
        server_config.media_limits()
    except ValueError as exc:
        print(f"antiphon: {exc}", file=sys.stderr)
        return 2
    fatal: list[bool] = []

    def on_fatal() -> None:
        fatal.append(True)
        server.should_exit = True

    # The front end is one event loop and a pool of short thread jobs: a few arenas hold its
    # peak of free memory a few times, glibc's default many (on two cores a flood of uploads
    # grew eight arenas ~50 MiB and kept it: benchmarks/mixed_soak.py). Before any thread of
    # the server starts; MALLOC_ARENA_MAX overrides.
    from workers import heap

    heap.limit_arenas_unless_set(heap.arenas_for_a_front_end())
    app = build_app(server_config, engine_config, on_fatal=on_fatal)
    _raise_open_files_limit(server_config.max_connections)
    # The transport's own message cap sits above ours, so a merely oversized message gets an
    # error event (and the connection lives on) instead of a hard close. Connections are
    # capped by the app (frontend/limits.py), which can exempt /health and answer in JSON.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, ws="websockets-sansio",
                                           http=protocol_with_timeouts(server_config.header_timeout_s,
                                                                       server_config.body_timeout_s),
                                           ws_per_message_deflate=args.ws_compression,
                                           ws_max_size=4 * server_config.max_message_bytes,
                                           log_level="info" if args.verbose else "warning"))
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it caught once its graceful shutdown (workers
        # included) is done; by then there is nothing left to clean up.
        pass
    if fatal or not server.started:
        print("antiphon: the server stopped because a worker failed", file=sys.stderr)
        return 1
    return 0


def _api_keys(given: list[str] | None) -> list[str]:
    if given:
        return given
    from_env = os.environ.get("ANTIPHON_API_KEY", "")
    return [key.strip() for key in from_env.split(",") if key.strip()]


def _raise_open_files_limit(max_connections: int) -> None:
    """Each connection is a file descriptor; the soft limit is often 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + 256  # worker sockets, log files, the model's files
    if soft < wanted:
        new_soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
        if new_soft < wanted:
            logging.getLogger("antiphon").warning(
                "open-files limit %d is below --max-connections %d + 256", new_soft, max_connections)


def _generate(args) -> int:
    from transformers.utils import logging as hf_logging

    from engine import LLM, SamplingParams

    hf_logging.disable_progress_bar()
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens)
    except ValueError as exc:
        print(f"antiphon: {exc}", file=sys.stderr)
        return 2
    llm = LLM(args.model)
    prompts = args.prompt if args.raw else [
        llm.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompt]
    # One prompt streams as it is generated; several print in order when all are done.
    if len(prompts) == 1:
        for out in llm.stream(prompts, params):
            print(out.new_text, end="", flush=True)
        print()
    else:
        for prompt, out in zip(args.prompt, llm.generate(prompts, params)):
            print(f"### {prompt}\n{out.text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
