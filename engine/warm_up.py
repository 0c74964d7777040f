"""A server's start-up warm-up: two short requests through the whole step loop, then forgotten.

Without it the first user's request pays the first-call costs of what a step touches: oneDNN
creates its primitives, the native kernels (where loaded) and torch's ops run for the first
time, as do the sampler's and the scheduler's paths. Measured on the default model (two CPU
cores, Realtime socket, a short chat turn, fresh servers): the first turn's first token came
after 75-95 ms without it, 62-71 ms with it (later turns 54-70 ms: their system prompt is
cached). vLLM warms up before serving for the same reason, with dummy batches in its workers;
here real requests go through the scheduler and the sampler too, so that each kind of step a
user's first request takes has run once: a prefill alone, a prefill beside a decode, two rows
decoding, one alone, greedy and sampled tokens.

Afterwards the prefix cache, its counters and the scheduler's are reset: the server starts with
an empty cache and zero statistics, as without the warm-up.
"""

from __future__ import annotations

import logging
import time

from engine.core import EngineCore
from engine.request import Request
from engine.sampling_params import SamplingParams

logger = logging.getLogger("antiphon")

# A short chat turn's prompt: long enough for the batched (prefill) products, short enough to
# cost well under a second on two cores. The greedy request generates enough tokens to still
# be decoding when the sampled one has its first, with asynchronous scheduling too (where a
# request that will have finished is not scheduled again).
PROMPT_TOKENS = (40, 24)
MAX_TOKENS = (4, 8)


def warm_up_prompts(vocab_size: int, max_model_len: int) -> list[list[int]]:
    """Two fixed prompts of ordinary token ids (no placeholders), each leaving room in the
    context for the tokens the warm-up generates."""
    room = max(1, max_model_len - max(MAX_TOKENS))
    return [[(7 * i + 3 + offset) % vocab_size for i in range(min(length, room))]
            for offset, length in enumerate(PROMPT_TOKENS)]


def warm_up_requests(core: EngineCore) -> list[Request]:
    greedy, sampled = warm_up_prompts(core.executor.vocab_size, core.sizes.max_model_len)
    return [
        Request("warm-up-greedy", greedy,
                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[0], ignore_eos=True)),
        Request("warm-up-sampled", sampled,
                SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=0, max_tokens=MAX_TOKENS[1],
                               ignore_eos=True)),
    ]


def fits(core: EngineCore, request: Request) -> str | None:
    """Why the request cannot run to its last token here (None if it can): a refused prompt, or
    a pool too small for the whole request, where it would be preempted and failed."""
    try:
        core.check_request(request)
    except ValueError as exc:
        return str(exc)
    needed = core.kv.blocks_needed(len(request.prompt_token_ids) + request.sampling_params.max_tokens)
    if needed > core.kv.pool.num_usable_blocks:
        return f"it needs {needed} KV blocks, the pool holds {core.kv.pool.num_usable_blocks}"
    return None


def warm_up(core: EngineCore) -> float:
    """Runs the warm-up requests to the end and resets what they left behind; returns the
    seconds it took, or 0.0 where the engine's limits refuse them (a tiny test pool: left cold)."""
    started = time.perf_counter()
    greedy, sampled = warm_up_requests(core)
    for request in (greedy, sampled):
        reason = fits(core, request)
        if reason is not None:
            logger.info("start-up warm-up skipped: %s", reason)
            return 0.0
    # The sampled one joins after the greedy one's prefill: a step that mixes a prefill with a
    # decode, then both decoding, then the sampled one alone.
    core.add_request(greedy)
    core.step()
    core.add_request(sampled)
    while core.has_unfinished_requests:
        core.step()
    if not core.reset_prefix_cache():
        logger.warning("the warm-up's KV blocks are still held: its prefix cache entries stay")
    core.scheduler.num_preemptions = 0
    return time.perf_counter() - started
