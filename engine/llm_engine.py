"""The engine with its input and output processing: prompts in, text and tokens out.

Input processing validates and tokenizes a prompt into a Request; output processing
detokenizes each request's new tokens incrementally and ends it on a stop string.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core import EngineCore, EngineStats
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

# A prompt is text, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}.
Prompt = str | Sequence[int] | dict


@dataclass
class _Tracked:
    output: RequestOutput
    detokenizer: IncrementalDetokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from workers.model_loader import (load_model, load_tokenizer, resolve_device, resolve_dtype,
                                          resolve_model_path)
        from transformers import AutoConfig

        self.config = config
        self.model_path = resolve_model_path(config.model)
        model_config = AutoConfig.from_pretrained(self.model_path)
        device = resolve_device(config.device)
        self.model = load_model(self.model_path, resolve_dtype(config.dtype, model_config, device), device)
        self.tokenizer = load_tokenizer(self.model_path)
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.core = EngineCore(config, self.model, self.model.config)
        self.max_model_len = self.core.sizes.max_model_len
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()

    # ---- input ------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: Prompt) -> list[int]:
        """Validate a prompt and return its token ids; raises ValueError naming the problem."""
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
        if not token_ids:
            raise ValueError("prompt_token_ids is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens, longer than the context of "
                             f"{self.max_model_len} tokens (max_model_len) minus one for output")
        return token_ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> str:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize_prompt(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids,
                          cache_salt=cache_salt)
        self.core.add_request(request)
        self._tracked[request_id] = _Tracked(
            RequestOutput(request_id, token_ids), IncrementalDetokenizer(self.tokenizer, token_ids, params))
        return request_id

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
            out, detok = tracked.output, tracked.detokenizer
            out.new_token_ids = core_output.new_token_ids
            out.token_ids.extend(core_output.new_token_ids)
            out.num_cached_tokens = core_output.num_cached_tokens
            if core_output.logprobs:
                out.logprobs = (out.logprobs or []) + core_output.logprobs
            finish_reason, stop_reason = core_output.finish_reason, core_output.stop_reason
            matched = detok.add_tokens(core_output.new_token_ids)
            if matched is not None:
                finish_reason, stop_reason = "stop", matched
                self.core.abort_requests([out.request_id], RequestStatus.FINISHED_STOPPED)
            if finish_reason is not None:
                detok.flush()
                out.finish_reason, out.stop_reason, out.error = finish_reason, stop_reason, core_output.error
                del self._tracked[out.request_id]
            out.new_text = detok.take_delta(out.finished)
            out.text = detok.text
            results.append(out)
        return results


def _eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is None:
        configured = getattr(model.config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
