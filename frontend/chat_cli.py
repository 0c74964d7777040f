"""`antiphon chat`: a terminal chat on the Python SDK. Ctrl-C stops an answer; Ctrl-D quits."""

from __future__ import annotations

import asyncio
import signal
import sys

from frontend.client import RealtimeClient, RealtimeError


def run_chat(args) -> int:
    try:
        return asyncio.run(_chat(args))
    except KeyboardInterrupt:
        return 0


async def _chat(args) -> int:
    try:
        client = await RealtimeClient(args.url, api_key=args.api_key).__aenter__()
    except (OSError, RealtimeError) as exc:
        print(f"antiphon chat: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1
    try:
        settings = {"temperature": args.temperature, "max_output_tokens": args.max_tokens}
        if args.system:
            settings["instructions"] = args.system
        await client.update_session(**settings)
        print(f"connected to {client.session['model']} at {args.url} (Ctrl-C stops an answer, Ctrl-D quits)")
        while True:
            try:
                line = await asyncio.to_thread(input, "you> ")
            except EOFError:
                print()
                return 0
            if not line.strip():
                continue
            response = await client.create_response([{"role": "user", "content": line}])
            print("assistant> ", end="", flush=True)
            # While an answer streams, Ctrl-C cancels that answer instead of the program.
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGINT, lambda: asyncio.ensure_future(response.cancel()))
            try:
                async for delta in response:
                    print(delta, end="", flush=True)
            finally:
                loop.remove_signal_handler(signal.SIGINT)
            usage = response.usage or {}
            print(f"\n[{response.status}; {usage.get('output_tokens', 0)} tokens, "
                  f"{usage.get('input_token_details', {}).get('cached_tokens', 0)} cached]")
    finally:
        await client.close()
