"""The offline API: `LLM(model=None, **config).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Messages = list[dict]


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **config))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of the prompts."""
        finished: dict[str, RequestOutput] = {}
        request_ids = self._add_all(prompts, sampling_params)
        while len(finished) < len(request_ids):
            if not self.engine.has_unfinished_requests:
                missing = [r for r in request_ids if r not in finished]
                raise RuntimeError(f"engine went idle with requests unfinished: {missing}")
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[r] for r in request_ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield each request's output every time it grows; `new_token_ids`/`new_text` hold the step's delta."""
        request_ids = self._add_all(prompts, sampling_params)
        remaining = set(request_ids)
        try:
            while remaining:
                for out in self.engine.step():
                    if out.request_id in remaining:
                        if out.finished:
                            remaining.discard(out.request_id)
                        yield out
        finally:
            if remaining:  # the caller stopped iterating: free the rest
                self.engine.abort_request(list(remaining))

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: Messages, chat_template: str | None = None) -> list[int]:
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=chat_template))

    def _add_all(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        # Validate everything before queuing anything: a bad prompt leaves no half-added batch.
        token_ids = [self.engine.tokenize_prompt(p) for p in prompts]
        return [self.engine.add_request(ids, sp) for ids, sp in zip(token_ids, params)]
