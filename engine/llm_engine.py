"""The engine with its input and output processing: prompts in, text and tokens out.

Input processing validates and tokenizes a prompt into an EngineRequest (the same struct
the frontend sends the decoder process); output processing turns each request's new
tokens into text and ends it on a stop string (engine/output_processor.py, which the
frontend uses too).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from engine.adapters import adapter_for
from engine.checkpoint import eos_token_ids, load_tokenizer, resolve_model_path
from engine.config import EngineConfig
from engine.core import EngineCore, EngineStats
from engine.executor import Executor
from engine.input_processor import expand_items, make_engine_request, to_request
from engine.audio_clips import audio_clip, check_audio_count
from engine.media import MediaLimits, check_image_count, load_image
from engine.output_processor import RequestOutputProcessor
from engine.outputs import RequestOutput
from engine.protocol import EngineRequest
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

# A prompt is text, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."},
# either dict with "multi_modal_data": {"image": [image, ...]} where the prompt holds the
# model's image placeholder once per image, as its chat template writes it.
Prompt = str | Sequence[int] | dict


@dataclass
class _Tracked:
    output: RequestOutput
    processor: RequestOutputProcessor


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor, media_limits: MediaLimits | None = None) -> None:
        from transformers import AutoConfig

        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.tokenizer = load_tokenizer(self.model_path)
        # Preprocessing only (no weights): image placeholders and processors.
        self.adapter = adapter_for(self.model_path, AutoConfig.from_pretrained(self.model_path))
        self.media_limits = media_limits if media_limits is not None else MediaLimits()
        self.eos_token_ids = eos_token_ids(self.model_path, self.tokenizer)
        self.core = EngineCore(config, executor)
        self.vocab_size = executor.vocab_size
        self.max_model_len = self.core.sizes.max_model_len
        self._tracked: dict[str, _Tracked] = {}
        # Preprocessed items of requests made but not yet added, by request id.
        self._items: dict[str, list] = {}
        self._ids = itertools.count()

    # ---- input ------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids; raises ValueError for a malformed prompt or an id outside the vocabulary."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            token_ids = self.tokenizer(prompt).input_ids
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids contains unknown token id {bad[0]!r} "
                                 f"(vocabulary size {self.vocab_size})")
        return token_ids

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     cache_salt: str | None = None) -> EngineRequest:
        """Validate a prompt and its parameters into a request; raises ValueError naming the problem."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        token_ids = self.tokenize_prompt(prompt)
        images, clips = self._media_of(prompt)
        if not images and not clips:
            return make_engine_request(request_id, token_ids, params, self.eos_token_ids, self.max_model_len,
                                       cache_salt)
        token_ids, placeholders, items = expand_items(self.adapter, token_ids, images, clips)
        request = make_engine_request(request_id, token_ids, params, self.eos_token_ids, self.max_model_len,
                                      cache_salt, placeholders)
        self._items[request_id] = items
        return request

    def check_request(self, message: EngineRequest) -> None:
        """Raises ValueError if the engine would refuse the request (too long for the KV pool,
        an image over the encoder budget); queues nothing."""
        self.core.check_request(to_request(message))

    def discard_unadded_items(self) -> None:
        """Forget the items of requests that were made but will not be added."""
        self._items.clear()

    def _media_of(self, prompt: Prompt) -> tuple[list, list]:
        """The prompt's decoded images and `(samples, rate)` audio clips."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return [], []
        unknown = sorted(set(data) - {"image", "audio"})
        if unknown:
            raise ValueError(f"multi_modal_data has unsupported modalities: {', '.join(unknown)}")
        images = data.get("image")
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        check_image_count(len(images), self.media_limits)
        # A lone clip is a (samples, rate) pair; several are a list of them.
        clips = data.get("audio")
        clips = [] if clips is None else [clips] if isinstance(clips, tuple) else list(clips)
        check_audio_count(len(clips), self.media_limits)
        return [load_image(image, self.media_limits) for image in images], [audio_clip(clip) for clip in clips]

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        return self.add_engine_request(self.make_request(prompt, params, request_id, cache_salt))

    def add_engine_request(self, message: EngineRequest) -> str:
        processor = RequestOutputProcessor(self.tokenizer, message.prompt_token_ids, message.sampling_params)
        self.core.add_request(to_request(message), self._items.pop(message.request_id, None))
        self._tracked[message.request_id] = _Tracked(RequestOutput(message.request_id, message.prompt_token_ids),
                                                     processor)
        return message.request_id

    def abort_request(self, request_ids: Sequence[str]) -> None:
        self.core.abort_requests(request_ids)
        for request_id in request_ids:
            self._tracked.pop(request_id, None)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests or bool(self._tracked)

    def stats(self) -> EngineStats:
        return self.core.stats()

    # ---- one step, with output processing -------------------------------------------------

    def step(self) -> list[RequestOutput]:
        results = []
        for core_output in self.core.step():
            tracked = self._tracked.get(core_output.request_id)
            if tracked is None:
                continue
            out = tracked.output
            update = tracked.processor.update(core_output.new_token_ids, core_output.finish_reason,
                                              core_output.stop_reason)
            if update.stopped_by_string:
                self.core.abort_requests([out.request_id], RequestStatus.FINISHED_STOPPED)
            out.new_token_ids = update.token_ids
            out.token_ids.extend(update.token_ids)
            out.num_cached_tokens = core_output.num_cached_tokens
            if core_output.logprobs:
                out.logprobs = (out.logprobs or []) + core_output.logprobs[:len(update.token_ids)]
            out.new_text = update.text
            out.text += update.text
            if update.finished:
                out.finish_reason, out.stop_reason, out.error = (update.finish_reason, update.stop_reason,
                                                                 core_output.error)
                del self._tracked[out.request_id]
            results.append(out)
        return results
