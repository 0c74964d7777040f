"""The `antiphon` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from frontend import cli_options


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

    serve = commands.add_parser("serve", help="run the server (HTTP, WebSocket, web page) with the worker processes",
                                formatter_class=cli_options.DefaultsShown)
    cli_options.add_serve_options(serve)

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


def _serve(args) -> int:
    import uvicorn

    from frontend.app import build_app
    from frontend.http_timeouts import protocol_with_timeouts

    try:
        engine_config = cli_options.engine_config_from(args)
        server_config = cli_options.server_config_from(args)
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
