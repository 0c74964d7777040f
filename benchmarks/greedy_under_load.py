"""Whether a greedy answer depends on what else the server runs.

Starts `antiphon serve` (the default model, no voice) twice, fresh each time so nothing is
cached: the first server answers each question alone, one at a time; the second answers all of
them at once while other requests arrive every 30 ms, so that their prompts share steps with the
questions' decoding (and the questions' prompts with each other's), then once more in the same
way with the questions' prompts in its prefix cache (the other requests new ones). Greedy,
through the official `openai` client. Prints how many answers differ from the lone ones (and
where the first one does), how many of the other requests arrived before the last question was
answered, and the server's preemptions (a preempted request is recomputed: not this test's
case); exits 1 if an answer differs, keeping the servers' logs.

    python benchmarks/greedy_under_load.py [--quantization auto] [--max-tokens 120]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QUESTIONS = [f"Tell me a long story about a {animal} who found a map."
             for animal in ("cat", "dog", "fox", "owl", "bee", "crow")]
QUESTIONS += ["What is the capital of France?", "Explain how a bicycle works, step by step."]
OTHERS = 12  # requests that arrive while the questions decode
OTHERS_EVERY_S = 0.03


async def ask(client, question: str, max_tokens: int) -> str:
    reply = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=max_tokens)
    return reply.choices[0].message.content or ""


async def alone(url: str, max_tokens: int) -> list[str]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="none") as client:
        return [await ask(client, question, max_tokens) for question in QUESTIONS]


async def under_load(url: str, max_tokens: int, round_name: str) -> tuple[list[str], int]:
    """The questions' answers, and how many other requests were sent before the last one came."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="none") as client:
        sent: list[float] = []

        async def other(index: int) -> None:
            await asyncio.sleep(OTHERS_EVERY_S * index)
            sent.append(time.monotonic())
            await ask(client, f"Describe city number {index} ({round_name}) in detail, with its history and food.", 60)

        others = [asyncio.create_task(other(index)) for index in range(OTHERS)]
        answers = await asyncio.gather(*(ask(client, question, max_tokens) for question in QUESTIONS))
        answered = time.monotonic()
        await asyncio.gather(*others)
        return list(answers), sum(at < answered for at in sent)


def report(label: str, lone: list[str], loaded: list[str], overlapping: int) -> int:
    differ = [(q, a, b) for q, a, b in zip(QUESTIONS, lone, loaded) if a != b]
    print(f"{label}: {len(differ)} of {len(QUESTIONS)} answers differ from the lone ones "
          f"({overlapping} of {OTHERS} other requests sent before the last answer)", flush=True)
    for question, a, b in differ:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  {question!r}: from character {at}: alone {a[at:at + 60]!r}, under load {b[at:at + 60]!r}")
    return len(differ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default=None, help="the server's --quantization (default: its own)")
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
    from tests.server_harness import ServerProcess

    options = [] if args.quantization is None else ["--quantization", args.quantization]
    logs = Path(tempfile.mkdtemp(prefix="greedy-under-load-"))
    server = ServerProcess(None, *options, log_dir=logs, timeout=900)
    try:
        lone = asyncio.run(alone(server.url, args.max_tokens))
    finally:
        server.stop()
    server = ServerProcess(None, *options, log_dir=logs, timeout=900)
    try:
        differ = report("prompts uncached", lone, *asyncio.run(under_load(server.url, args.max_tokens, "first")))
        differ += report("prompts cached", lone, *asyncio.run(under_load(server.url, args.max_tokens, "second")))
        print(f"preemptions: {server.metric('antiphon_preemptions_total'):.0f}")
    finally:
        server.stop()
    if differ:
        print(f"server logs kept in {logs}")
        sys.exit(1)
    for log in logs.iterdir():
        log.unlink()
    logs.rmdir()


if __name__ == "__main__":
    main()
