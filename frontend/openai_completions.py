"""POST /v1/completions: text completions of a prompt or a batch of prompts, n each.

Choice `i * n + j` is the j-th completion of prompt i, as in OpenAI's API. Every choice of
the batch is admitted together (all or a 429) and the choices of one prompt share its KV
blocks (frontend/choices.py). A string prompt is tokenized as it is, with no chat template.
A request runs through frontend/request_lifecycle.py, as chat's does; this module keeps what
is completions' own: the body, the prompts, and the answer's shape.
"""

from __future__ import annotations

import time

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from frontend.choices import Choice, merged, params_per_choice
from frontend.completion_request import CompletionRequest
from frontend.edge_decoding import InvalidInput
from frontend.generation import TextChunk
from frontend.openai_http import sse_data, usage_of
from frontend.request_fields import decode_request
from frontend.request_lifecycle import RequestLifecycle, answer_request
from frontend.structured_output import check_logit_bias
from frontend.tenancy import Requester


class Completions:
    def __init__(self, app_state) -> None:
        self.state = app_state

    async def create(self, request: Request) -> Response:
        return await answer_request(request, self.state.config, self.state.generation, self._answer)

    async def _answer(self, lifecycle: RequestLifecycle, body_bytes: bytes) -> Response:
        # Checked while the client listens: its grammar compile and tokenizing stop if it leaves.
        body, params, prompts = await lifecycle.while_connected(self._check(body_bytes, lifecycle.requester))
        n = body.n or 1
        request_id = lifecycle.admit("cmpl", n * len(prompts))
        per_choice = params_per_choice(params, n) * len(prompts)
        choices = await lifecycle.start([p for p in prompts for _ in range(n)], per_choice)
        echoes = [self._echo(body, p) for p in prompts for _ in range(n)]
        if body.stream:
            return lifecycle.stream(self._sse(request_id, choices, body, echoes, n))
        return await self._complete(lifecycle, request_id, choices, body, echoes, n)

    async def _check(self, body_bytes: bytes, requester: Requester):
        state, config = self.state, self.state.config
        body = decode_request(body_bytes, CompletionRequest, config.accept_unknown_fields)
        body.check_supported()
        params = body.sampling_params(config.max_stop_strings, config.max_logprobs, config.max_choices)
        check_logit_bias(params, state.client.ready["decoder"].vocab_size)
        constraint = body.constraint(config.max_grammar_bytes)
        if constraint is not None:
            await state.grammar_checker.check(*constraint, requester)
            params = msgspec.structs.replace(params, structured_output=constraint[0])
        prompts = await anyio.to_thread.run_sync(self._token_ids, body.prompts(config.max_prompts_per_request))
        return body, params, prompts

    def _token_ids(self, prompts: list) -> list[list[int]]:
        generation = self.state.generation
        vocab = self.state.client.ready["decoder"].vocab_size
        out = []
        # A text that is surely too long is refused before the tokenizer spends seconds on any.
        for prompt in prompts:
            if isinstance(prompt, str):
                generation.check_prompt_text(prompt, "prompt")
        for index, prompt in enumerate(prompts):
            # Control tokens in the text are control tokens: a raw prompt is the model's input as
            # the client wrote it (with its own template, say), as in vLLM's completions; it may
            # be token ids too, so no control token is out of the client's reach here anyway.
            token_ids = generation.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if any(t >= vocab for t in token_ids):
                raise InvalidInput(f"prompt[{index}] holds a token id outside the vocabulary of {vocab}",
                                   "invalid_value", "prompt")
            generation.check_prompt(token_ids, "prompt")
            out.append(token_ids)
        return out

    def _echo(self, body: CompletionRequest, token_ids: list[int]) -> str:
        return self.state.generation.tokenizer.decode(token_ids) if body.echo else ""

    async def _complete(self, lifecycle: RequestLifecycle, request_id: str, choices: list[Choice],
                        body: CompletionRequest, echoes: list[str], n: int) -> Response:
        all_chunks = await lifecycle.all_chunks(choices)
        out = [self._choice(index, echoes[index] + "".join(c.text for c in chunks), chunks, body,
                            len(echoes[index]), chunks[-1].finish_reason)
               for index, chunks in enumerate(all_chunks)]
        return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                             "model": self.state.model_name, "choices": out,
                             "usage": _batch_usage([c[-1] for c in all_chunks], n)})

    def _choice(self, index: int, text: str, chunks: list[TextChunk], body: CompletionRequest, offset: int,
                finish_reason) -> dict:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        token_ids = [t for c in chunks for t in c.token_ids]
        if body.logprobs is not None:
            choice["logprobs"] = self.state.logprob_formatter.completion(
                token_ids, [lp for c in chunks for lp in c.logprobs], offset)
        if body.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    async def _sse(self, request_id: str, choices: list[Choice], body: CompletionRequest, echoes: list[str],
                   n: int):
        created = int(time.time())
        include_usage = body.include_usage
        offsets = [len(echo) for echo in echoes]
        last_chunks: dict[int, TextChunk] = {}

        def event(choice: dict) -> str:
            return sse_data({"id": request_id, "object": "text_completion", "created": created,
                             "model": self.state.model_name, "choices": [choice]})

        stream = merged(choices)
        try:
            out = [event({"index": i, "text": echo, "logprobs": None, "finish_reason": None})
                   for i, echo in enumerate(echoes) if echo]
            async for index, chunk in stream:
                if chunk.finish_reason == "error":
                    out.append(sse_data({"error": {"message": chunk.error, "type": "server_error",
                                                   "code": "engine_error"}}))
                    break
                if chunk.text or chunk.token_ids or chunk.finish_reason is not None:
                    choice = self._choice(index, chunk.text, [chunk], body, offsets[index], chunk.finish_reason)
                    # Offsets follow the tokens (a chunk's text may lag behind its tokens).
                    logprobs = choice["logprobs"]
                    offsets[index] += sum(map(len, logprobs["tokens"])) if logprobs else len(chunk.text)
                    out.append(event(choice))
                if chunk.finish_reason is not None:
                    last_chunks[index] = chunk
                    if len(last_chunks) == len(choices) and include_usage:
                        out.append(sse_data({"id": request_id, "object": "text_completion", "created": created,
                                             "model": self.state.model_name, "choices": [],
                                             "usage": _batch_usage([last_chunks[i] for i in sorted(last_chunks)],
                                                                   n)}))
                if out and len(last_chunks) < len(choices):
                    yield "".join(out)
                    out = []
            out.append("data: [DONE]\n\n")
            yield "".join(out)
        finally:
            await stream.aclose()


def _batch_usage(last_chunks: list[TextChunk], n: int) -> dict:
    """Usage of a batch: each prompt counted once, every choice's completion."""
    per_prompt = [usage_of(last_chunks[i:i + n]) for i in range(0, len(last_chunks), n)]
    total = {key: sum(u[key] for u in per_prompt) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                                           for u in per_prompt)}
    return total
