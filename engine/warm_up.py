"""A server's start-up warm-up: two short requests through the whole step loop, then forgotten.

Without it the first user's request pays the first-call costs of everything a step touches:
oneDNN creates its primitives, the native decode stack allocates its buffers, the sampler's
ops and the scheduler's paths run for the first time. Measured on the default model (two CPU
cores, Realtime socket, a short chat turn): the server's first answer had its first token after
182 ms, every later one after ~38 ms. vLLM warms its model runner the same way before it
serves (dummy runs, graph captures); here real requests do it, so every path a user's first
step takes has run once: a prompt's prefill, a prefill beside a decode, two decoding together,
one alone, greedy and sampled tokens.

The requests carry their own cache salt, so they share no KV block with a user, and the prefix
cache and its counters are reset afterwards: the server starts with an empty cache and zero
statistics, as without the warm-up.
"""

from __future__ import annotations

import logging
import time

from engine.core import EngineCore
from engine.kv_cache_manager import PrefixCacheStats
from engine.request import Request
from engine.sampling_params import SamplingParams

logger = logging.getLogger("antiphon.decoder")

# A short chat turn's prompt: long enough for the batched (prefill) products, short enough to
# cost well under a second on two cores.
PROMPT_TOKENS = (40, 24)
MAX_TOKENS = (3, 6)
SALT = "antiphon-warm-up"


def warm_up_prompts(vocab_size: int, max_model_len: int) -> list[list[int]]:
    """Two fixed prompts of ordinary token ids (no placeholders), each leaving room in the
    context for the tokens the warm-up generates."""
    room = max(1, max_model_len - max(MAX_TOKENS))
    return [[(7 * i + 3 + offset) % vocab_size for i in range(min(length, room))]
            for offset, length in enumerate(PROMPT_TOKENS)]


def warm_up(core: EngineCore, vocab_size: int) -> float:
    """Runs the warm-up requests to the end and resets what they left behind; returns the
    seconds it took. A model whose limits refuse the prompts (a tiny test pool) is left cold."""
    started = time.perf_counter()
    first, second = warm_up_prompts(vocab_size, core.sizes.max_model_len)
    requests = [
        Request("warm-up-greedy", first, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[0], ignore_eos=True),
                cache_salt=SALT),
        # Sampled and longer: it decodes alone once the greedy one is done.
        Request("warm-up-sampled", second, SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=0,
                                                           max_tokens=MAX_TOKENS[1], ignore_eos=True),
                cache_salt=SALT),
    ]
    try:
        for request in requests:
            core.check_request(request)
    except ValueError as exc:
        logger.info("start-up warm-up skipped: %s", exc)
        return 0.0
    # The second joins after the first's prefill: a step that mixes a prefill with a decode,
    # then two decoding together, then the sampled one alone.
    core.add_request(requests[0])
    core.step()
    core.add_request(requests[1])
    while core.has_unfinished_requests:
        core.step()
    core.kv.pool.reset_prefix_cache()
    core.kv.stats = PrefixCacheStats()
    core.scheduler.num_preemptions = 0
    return time.perf_counter() - started
