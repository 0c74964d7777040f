"""Several choices for one prompt (`n`, and completions' batches of prompts).

Each choice is its own engine request with its own lease (admission counts them all, and
refuses the whole request if they do not all fit). Choices of one prompt are sent together:
the decoder registers a prompt's KV blocks when it schedules them, so the siblings find the
prompt in the prefix cache and only the first computes it (one prefill, n decodes; the
prefix-cache metrics show the hits). Seeded choices get seeds seed, seed+1, ...: the same
request gives the same n answers, and they differ from each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from engine.sampling_params import SEED_RANGE, SamplingParams
from frontend.admission import RequestLease
from frontend.generation import GenerationService, TextChunk


_ENDED = object()


@dataclass
class Choice:
    index: int
    stream: AsyncIterator[TextChunk]
    first: TextChunk


def admit_choices(generation: GenerationService, request_id: str, count: int) -> list[RequestLease]:
    """One lease per choice (the first keeps the response's id); all or none (AdmissionRefused)."""
    leases: list[RequestLease] = []
    try:
        for index in range(count):
            leases.append(generation.admit(request_id if index == 0 else f"{request_id}-{index}"))
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    return leases


def params_per_choice(params: SamplingParams, count: int) -> list[SamplingParams]:
    if params.seed is None or count == 1:
        return [params] * count
    # Wraps within the seed range: seed + index for any valid seed.
    low, high = SEED_RANGE
    return [msgspec.structs.replace(params, seed=(params.seed + index - low) % (high - low + 1) + low)
            for index in range(count)]


async def start_choices(generation: GenerationService, leases: list[RequestLease], prompts: list, params: list,
                        cache_salt: str | None, first_index: int = 0, speech=None) -> list[Choice]:
    """Starts every choice at once and waits for each one's first chunk. If one fails or the
    caller is cancelled, all of them are closed (their engine requests aborted). `speech`: the
    SpeechOptions of a spoken answer (one choice) an omni model speaks."""
    streams = [generation.stream(lease, prompt, p, cache_salt, speech) for lease, prompt, p in zip(leases, prompts,
                                                                                                   params)]
    firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
    try:
        await asyncio.gather(*firsts)
    except BaseException:
        for task in firsts:
            task.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        await asyncio.gather(*(stream.aclose() for stream in streams), return_exceptions=True)
        raise
    return [Choice(first_index + i, stream, task.result()) for i, (stream, task) in enumerate(zip(streams, firsts))]


async def close_choices(choices: list[Choice]) -> None:
    await asyncio.gather(*(choice.stream.aclose() for choice in choices), return_exceptions=True)


async def collect(choice: Choice) -> list[TextChunk]:
    chunks = [choice.first]
    if choice.first.finish_reason is None:
        chunks += [chunk async for chunk in choice.stream]
    return chunks


async def collect_all(choices: list[Choice]) -> list[list[TextChunk]]:
    """Every choice's chunks; the choices are closed however this ends (also cancelled)."""
    try:
        return await asyncio.gather(*(collect(choice) for choice in choices))
    finally:
        await close_choices(choices)


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[int, TextChunk]]:
    """(choice index, chunk) from every choice as they come, the first chunks first; each
    choice's chunks in order, ending with its last. Closing this closes every choice."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for chunk in choice.stream:
                queue.put_nowait((choice.index, chunk))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((choice.index, exc))
        else:
            queue.put_nowait((choice.index, _ENDED))

    pumps = []
    try:
        for choice in choices:
            yield choice.index, choice.first
        live = [choice for choice in choices if choice.first.finish_reason is None]
        pumps = [asyncio.ensure_future(pump(choice)) for choice in live]
        remaining = len(live)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is _ENDED:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await close_choices(choices)
