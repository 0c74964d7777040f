"""The offline API: `LLM(model=None, **config).generate(prompts, sampling_params)`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence

from engine.chat_content import split_media
from engine.chat_template import ChatTemplate
from engine.config import EngineConfig
from engine.executor import Executor
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Messages = list[dict]

# The executor an LLM uses unless given one: the model in this process, as in the decoder
# process. It lives in workers/, which the engine never imports (the engine knows only the
# Executor interface), so it is named here as data and resolved when an LLM is built, the
# way vLLM names its worker class by qualified name: the one place where the offline API
# composes the engine with a concrete executor. Pass `executor_factory` to use another.
DEFAULT_EXECUTOR = "workers.inprocess_executor:InProcessExecutor"


class LLM:
    def __init__(self, model: str | None = None, *,
                 executor_factory: Callable[[EngineConfig], Executor] | None = None, **config) -> None:
        engine_config = EngineConfig.from_kwargs(model=model, **config)
        factory = executor_factory if executor_factory is not None else default_executor_factory()
        self.engine = LLMEngine(engine_config, factory(engine_config))
        self.tokenizer = self.engine.tokenizer
        self.template = ChatTemplate(self.tokenizer)
        # An omni model's talker and codec, loaded on the first spoken answer.
        self._speech = None

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 voice: str | None = None, talker_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of the prompts. With an
        omni model and a `voice` (one of its speakers), each answer is spoken too: the output
        carries its codec tokens, waveform and sample rate (`talker_params`: how the talker
        samples; Qwen2.5-Omni's own defaults if None)."""
        if voice is not None:
            return self._generate_spoken(prompts, sampling_params, voice, talker_params)
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
             chat_template: str | None = None, voice: str | None = None,
             talker_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate
        (spoken too with an omni model and a `voice`: see generate)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params, voice, talker_params)

    def _generate_spoken(self, prompts, sampling_params, voice: str,
                         talker_params: SamplingParams | None) -> list[RequestOutput]:
        from engine.omni_speech import OmniSpeech

        if self._speech is None:
            self._speech = OmniSpeech(self.engine)
        speech = self._speech
        talker_params = (speech.talker_params(talker_params) if talker_params is not None
                         else speech.stage.default_params(self.engine.config.max_spoken_codes))
        # Everything checked before anything is queued: a bad voice leaves no half-added batch.
        try:
            requests = [self.engine.make_request(p, sp) for p, sp in zip(*self._pair(prompts, sampling_params))]
            for request in requests:
                self.engine.check_request(request)
                speech.check(voice, len(request.prompt_token_ids), talker_params)
        except Exception:
            self.engine.discard_unadded_items()
            raise
        for request in requests:
            self.engine.add_engine_request(request)
            speech.add(request.request_id, request.prompt_token_ids, request.mm_placeholders, voice, talker_params)
        texts: dict[str, RequestOutput] = {}
        spoken: dict[str, object] = {}
        wanted = {request.request_id for request in requests}
        try:
            # Until every answer's text and speech are done (either may end first).
            while len(texts) < len(requests) or len(spoken) < len(requests):
                if not self.engine.has_unfinished_requests and not speech.talker.has_unfinished_requests:
                    missing = sorted(wanted - set(spoken))
                    raise RuntimeError(f"engines went idle with spoken answers unfinished: {missing}")
                outputs = self.engine.step()
                speech.after_thinker_step(outputs)
                texts.update((out.request_id, out) for out in outputs if out.finished)
                for out in outputs:
                    if out.finished and out.request_id not in speech.answers and out.request_id not in spoken:
                        spoken[out.request_id] = None  # not spoken: its text failed or was aborted
                spoken.update((answer.request_id, answer) for answer in speech.talker_step())
        finally:
            unfinished = [request_id for request_id in wanted if request_id not in texts]
            if unfinished:
                self.engine.abort_request(unfinished)
            for request_id in wanted:
                speech.drop(request_id)
        results = []
        for request in requests:
            out, answer = texts[request.request_id], spoken[request.request_id]
            if answer is not None:
                if answer.error is not None and out.error is None:
                    out.error = f"speech failed: {answer.error}"
                out.codec_token_ids = answer.codes
                out.audio = answer.waveform.cpu().numpy() if answer.waveform is not None else None
                out.sample_rate = speech.spec.sample_rate
            results.append(out)
        return results

    def chat_prompt(self, messages: Messages, chat_template: str | None = None) -> Prompt:
        """The conversation as a prompt: token ids, or with images or audio a dict of token ids
        and the media (content parts `image_url` with a data URL or local file, or `image`;
        `audio` with a (samples, rate) pair)."""
        templated, images, clips = split_media(messages)
        token_ids = self.apply_chat_template(templated, chat_template)
        if not images and not clips:
            return token_ids
        media = {"image": images} if images else {}
        if clips:
            media["audio"] = clips
        return {"prompt_token_ids": token_ids, "multi_modal_data": media}

    def apply_chat_template(self, messages: Messages, chat_template: str | None = None) -> list[int]:
        """The conversation's prompt ids, as the server makes them: control tokens typed in the
        messages are text (engine/chat_template.py)."""
        return self.template.token_ids(messages, chat_template=chat_template)

    @staticmethod
    def _pair(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        """The prompts as a list, each with its sampling parameters."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return prompts, [sampling_params or SamplingParams()] * len(prompts)
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        return prompts, params

    def _add_all(self, prompts, sampling_params) -> list[str]:
        prompts, params = self._pair(prompts, sampling_params)
        # Validate everything before queuing anything: a bad prompt leaves no half-added batch.
        try:
            requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params)]
            for request in requests:
                self.engine.check_request(request)
        except Exception:
            self.engine.discard_unadded_items()
            raise
        return [self.engine.add_engine_request(r) for r in requests]


def default_executor_factory() -> Callable[[EngineConfig], Executor]:
    module, name = DEFAULT_EXECUTOR.split(":")
    return getattr(importlib.import_module(module), name)
