"""Request construction, one way for every path.

`make_engine_request` turns a tokenized prompt and its parameters into the wire struct the
frontend sends to the decoder and the offline engine hands to its own core;
`to_request` turns that struct into the scheduler's Request on the receiving side.
`expand_items` turns a prompt with one placeholder per image or audio clip into the prompt
the model sees (each placeholder repeated once per embedding) and the items for the encoder.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engine.mm_inputs import ProcessedItem
from engine.protocol import EngineRequest
from engine.request import MultiModalPlaceholder, Request
from engine.sampling_params import SamplingParams


def expand_items(adapter, token_ids: list[int], images: Sequence = (), clips: Sequence = ()
                 ) -> tuple[list[int], list[MultiModalPlaceholder], list[ProcessedItem]]:
    """Preprocess decoded PIL images and `(samples, rate)` audio clips with the model's adapter
    and expand their placeholders. CPU-heavy: never call it on an event loop. Raises
    ValueError naming the problem."""
    if adapter is None:
        raise ValueError("this model takes no images or audio")
    if clips and adapter.audio_token_id is None:
        raise ValueError("this model takes no audio")
    items = [adapter.process_image(image) for image in images]
    items += [adapter.process_audio(samples, rate) for samples, rate in clips]
    expanded, placeholders = adapter.expand_placeholders(list(token_ids), items)
    return expanded, placeholders, items


def make_engine_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        eos_token_ids: Sequence[int], max_model_len: int,
                        cache_salt: str | None = None,
                        mm_placeholders: Sequence[MultiModalPlaceholder] = ()) -> EngineRequest:
    """Raises ValueError for an empty prompt or one that leaves no room for output; caps
    max_tokens to what the context leaves after the prompt."""
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty")
    room = max_model_len - len(prompt_token_ids)
    if room < 1:
        raise ValueError(f"prompt is {len(prompt_token_ids)} tokens, longer than the context of "
                         f"{max_model_len} tokens (max_model_len) minus one for output")
    if params.max_tokens > room:
        params = msgspec.structs.replace(params, max_tokens=room)
    return EngineRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                         eos_token_ids=list(eos_token_ids), cache_salt=cache_salt,
                         mm_placeholders=list(mm_placeholders))


def to_request(message: EngineRequest) -> Request:
    return Request(message.request_id, message.prompt_token_ids, message.sampling_params,
                   eos_token_ids=tuple(message.eos_token_ids), cache_salt=message.cache_salt,
                   mm_placeholders=list(message.mm_placeholders))
