"""The offline API: `LLM(model=None, **config).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
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
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               voice: str | None = None, talker_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each request's output every time it grows; `new_token_ids`/`new_text` hold the step's delta.
        With an omni model and a `voice`, each answer's speech too, as the codec makes it: outputs
        whose `new_audio` is the next chunk (float32 at `sample_rate`; a chunk may come after the
        text's last output). The codec streams (engine/adapters/qwen2_5_omni_codec_stream.py),
        as the server's does: not bit for bit `generate`'s whole decode."""
        if voice is not None:
            yield from self._stream_spoken(prompts, sampling_params, voice, talker_params)
            return
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
        speech, requests = self._add_spoken(prompts, sampling_params, voice, talker_params)
        texts: dict[str, RequestOutput] = {}
        answers: dict[str, object] = {}
        for outputs, updates in self._spoken_steps(speech, requests):
            texts.update((out.request_id, out) for out in outputs if out.finished)
            for update in updates:
                if update.finished:
                    answer = answers[update.answer.request_id] = update.answer
                    if answer.error is None:
                        answer.waveform = speech.stage.waveform(answer)  # whole, as transformers decodes it
        results = []
        for request in requests:
            out, answer = texts[request.request_id], answers.get(request.request_id)
            if answer is not None:  # else not spoken: its text failed or was aborted
                if answer.error is not None and out.error is None:
                    out.error = f"speech failed: {answer.error}"
                out.codec_token_ids = answer.codes
                out.audio = answer.waveform.cpu().numpy() if answer.waveform is not None else None
                out.sample_rate = speech.spec.sample_rate
            results.append(out)
        return results

    def _stream_spoken(self, prompts, sampling_params, voice: str,
                       talker_params: SamplingParams | None) -> Iterator[RequestOutput]:
        speech, requests = self._add_spoken(prompts, sampling_params, voice, talker_params)
        stage = speech.stage
        latest: dict[str, RequestOutput] = {}
        codecs: dict[str, object] = {}
        for outputs, updates in self._spoken_steps(speech, requests):
            for out in outputs:
                latest[out.request_id] = out
                yield out
            for update in updates:
                answer = update.answer
                said = latest[answer.request_id]
                if answer.error is not None:
                    codecs.pop(answer.request_id, None)
                    yield dataclasses.replace(said, new_token_ids=[], new_text="",
                                              error=said.error or f"speech failed: {answer.error}")
                    continue
                codec = codecs.get(answer.request_id)
                if codec is None:
                    codec = codecs[answer.request_id] = stage.codec_stream(answer)
                chunks = codec.feed(update.new_codes) if update.new_codes else []
                if update.finished:
                    chunks.append(codec.finish())
                    del codecs[answer.request_id]
                for chunk in chunks:
                    if chunk.numel():
                        yield dataclasses.replace(said, new_token_ids=[], new_text="", new_audio=chunk.numpy(),
                                                  sample_rate=stage.spec.sample_rate)

    def _add_spoken(self, prompts, sampling_params, voice: str, talker_params: SamplingParams | None):
        """The requests of spoken answers, added to the thinker and the talker stage, all checked
        first: a bad voice leaves no half-added batch."""
        from engine.omni_speech import OmniSpeech

        if self._speech is None:
            self._speech = OmniSpeech(self.engine)
        speech = self._speech
        voice = speech.stage.voice(voice)
        talker_params = (speech.talker_params(talker_params) if talker_params is not None
                         else speech.stage.default_params(self.engine.config.max_spoken_codes))
        try:
            requests = [self.engine.make_request(p, sp) for p, sp in zip(*self._pair(prompts, sampling_params))]
            prompts = []
            for request in requests:
                self.engine.check_request(request)
                prompts.append(speech.talker_prompt(request.prompt_token_ids, request.mm_placeholders))
                speech.check(voice, prompts[-1], talker_params)
        except Exception:
            self.engine.discard_unadded_items()
            raise
        for request, prompt in zip(requests, prompts):
            self.engine.add_engine_request(request)
            speech.add(request.request_id, request.prompt_token_ids, prompt, voice, talker_params)
        return speech, requests

    def _spoken_steps(self, speech, requests):
        """A thinker step, then a talker step, until every answer's text and speech are done
        (either may end first): yields each pair's (text outputs, speech updates). Whatever is
        left when the caller stops is aborted, in both engines."""
        wanted = {request.request_id for request in requests}
        texts: set[str] = set()
        spoken: set[str] = set()
        try:
            while len(texts) < len(wanted) or len(spoken) < len(wanted):
                if not self.engine.has_unfinished_requests and not speech.talker.has_unfinished_requests:
                    raise RuntimeError(f"engines went idle with spoken answers unfinished: {sorted(wanted - spoken)}")
                outputs = self.engine.step()
                speech.after_thinker_step(outputs)
                for out in outputs:
                    if out.finished:
                        texts.add(out.request_id)
                        if out.request_id not in speech.answers:
                            spoken.add(out.request_id)  # spoken already, or never: its text failed
                updates = speech.stage.step()
                spoken.update(update.answer.request_id for update in updates if update.finished)
                yield outputs, updates
        finally:
            unfinished = [request_id for request_id in wanted if request_id not in texts]
            if unfinished:
                self.engine.abort_request(unfinished)
            for request_id in wanted:
                speech.drop(request_id)

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
