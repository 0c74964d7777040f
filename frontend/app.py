"""The Starlette application: routes, lifespan (workers up and down), auth."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from engine.config import EngineConfig
from frontend.admission import Admission
from frontend.engine_client import EngineClient
from frontend.generation import GenerationService
from frontend.heap_trimmer import trim_while_serving
from frontend.host_guard import HostGuard
from frontend.limits import (ConnectionCap, OpenConnections, bearer_token, cache_salt, client_address, key_accepted,
                             key_from_subprotocols, origin_allowed, requester_of)
from frontend.logprobs_format import LogprobFormatter
from frontend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from frontend.metrics import Metrics
from frontend.openai_audio import AudioEndpoints
from frontend.openai_chat import ChatCompletions
from frontend.openai_completions import Completions
from frontend.openai_http import error_response
from frontend.realtime import RealtimeSession
from frontend.server_config import ServerConfig
from frontend.spoken_answers import SpokenAnswerStore
from frontend.structured_output import GrammarChecker

logger = logging.getLogger("antiphon.frontend")

WEB_DIR = Path(__file__).resolve().parent / "web"


@dataclass
class AppState:
    config: ServerConfig
    engine_config: EngineConfig
    client: EngineClient
    metrics: Metrics
    admission: Admission
    model_name: str = ""
    started: int = 0
    generation: GenerationService | None = None
    realtime_sessions: int = 0
    # Structured output specs checked at the edge, and logprobs in OpenAI's shapes.
    grammar_checker: GrammarChecker | None = None
    logprob_formatter: LogprobFormatter | None = None
    # Transcripts of spoken answers, for clients that send one back by its audio id.
    spoken_answers: SpokenAnswerStore | None = None


def image_adapter(path: Path):
    """The model family's preprocessing (placeholders, image processor), or None for text."""
    from transformers import AutoConfig

    from engine.adapters import adapter_for

    return adapter_for(path, AutoConfig.from_pretrained(path))


def speaks_itself(engine_config: EngineConfig) -> None:
    """An omni model with voice on speaks its own answers: the decoder keeps the thinker's rows
    for the talker process, which runs the model's talker and codec instead of Piper."""
    if engine_config.async_scheduling:
        raise ValueError("an omni model's spoken answers read the thinker's rows between steps: "
                         "--async-scheduling off (or --no-voice)")
    engine_config.omni_speech = True
    engine_config.async_scheduling = False
    logger.info("voice: the omni model speaks its own answers (its talker and codec in the talker process)")


def build_app(config: ServerConfig, engine_config: EngineConfig, on_fatal=None) -> Starlette:
    client_options = dict(max_restarts=config.max_worker_restarts, restart_window_s=config.worker_restart_window_s,
                          worker_timeout_s=config.worker_timeout_s, on_fatal=on_fatal,
                          max_transcriptions=config.max_transcriptions, max_spoken_answers=config.max_spoken_answers,
                          share_per_tenant=config.share_per_tenant, share_per_client=config.share_per_client)
    if config.data_parallel_size > 1:
        from frontend.replica_set import replica_set

        client = replica_set(engine_config, config.data_parallel_size, config.routing_policy, config.ray_address,
                             **client_options)
        admitted = config.data_parallel_size * engine_config.max_num_seqs + config.max_waiting_requests
    else:
        client = EngineClient(engine_config, **client_options)
        admitted = engine_config.max_num_seqs + config.max_waiting_requests
    state = AppState(config, engine_config, client, Metrics(), Admission(admitted))
    state.spoken_answers = SpokenAnswerStore(config.spoken_answers_per_key, config.spoken_answer_ttl_s)
    chat = ChatCompletions(state)
    completions = Completions(state)
    audio = AudioEndpoints(state)
    connections = OpenConnections(config.max_connections, config.max_connections_per_client)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        from engine.checkpoint import eos_token_ids, load_tokenizer, resolve_model_path

        # Resolving here converts the embedded default model once, before any worker needs it.
        logger.info("preparing the model %s", engine_config.model or "(the embedded default)")
        path = resolve_model_path(engine_config.model)
        state.model_name = path.name
        state.started = int(time.time())
        tokenizer = load_tokenizer(path)
        adapter = image_adapter(path)
        if engine_config.voice and adapter is not None and adapter.talker_row_width() is not None:
            speaks_itself(engine_config)
        if engine_config.voice and engine_config.omni_speech:
            logger.info("starting the decoder, encoder and talker processes (each imports torch and loads its "
                        "part of %s: thinker, towers and Whisper for transcripts, talker and codec); --no-voice "
                        "skips speech", path.name)
        elif engine_config.voice:
            logger.info("starting the decoder, encoder and talker processes (the first two import torch and load "
                        "%s; the encoder also loads Whisper, the talker a Piper voice); --no-voice skips speech",
                        path.name)
        else:
            logger.info("starting the decoder and encoder processes (each imports torch and loads %s)", path.name)
        await state.client.start()
        if engine_config.voice:
            # The turn detector (Silero, torch) loads once here, off the loop: the first
            # spoken session must not freeze every other stream for a second.
            from frontend.realtime_audio import new_turn_detector

            await asyncio.to_thread(new_turn_detector, 0.5, 300, 500)
        max_model_len = state.client.ready["decoder"].max_model_len
        # The same EOS ids as the offline engine: generation_config's, the config's, the tokenizer's.
        eos = eos_token_ids(path, tokenizer)
        state.generation = GenerationService(state.client, state.admission, tokenizer, eos, max_model_len,
                                             config.max_prompt_tokens, state.metrics, adapter, config.media_limits(),
                                             state.client.ready["decoder"].encoder_budget)
        state.grammar_checker = GrammarChecker.for_server(config, tokenizer, state.client.ready["decoder"].vocab_size)
        state.grammar_checker.start_soon()
        state.logprob_formatter = LogprobFormatter(tokenizer)
        heap_trimmer = asyncio.create_task(trim_while_serving(), name="heap-trimmer")
        host = f"[{config.host}]" if ":" in config.host else config.host
        logger.info("serving %s on http://%s:%d/ (chat page), ws://%s:%d/v1/realtime, "
                    "http://%s:%d/v1/chat/completions, /v1/completions%s", state.model_name, host, config.port, host,
                    config.port,
                    host, config.port, ", /v1/audio/transcriptions, /v1/audio/speech" if engine_config.voice else "")
        try:
            yield
        finally:
            heap_trimmer.cancel()
            await asyncio.gather(heap_trimmer, return_exceptions=True)
            await state.grammar_checker.close()
            await state.client.shutdown()

    async def health(request: Request) -> Response:
        replicas = {"replicas": state.client.replica_health()} if config.data_parallel_size > 1 else {}
        if state.client.healthy:
            # Data parallel: serving while any replica does; each one's state is in the list.
            return JSONResponse({"status": "ok", "voice": state.client.voice_status, **replicas})
        return JSONResponse({"status": "unhealthy", "reason": state.client.status, **replicas}, status_code=503)

    async def metrics(request: Request) -> Response:
        gauges = [
            ("antiphon_request_slots_held", "Admitted requests (running or queued) holding a slot.",
             state.admission.held),
            ("antiphon_request_slots_total", "Requests the server admits at once (max_num_seqs + max_waiting_requests).",
             state.admission.capacity),
            ("antiphon_engine_requests_registered", "Requests whose outputs the engine client routes now.",
             state.client.num_registered),
            ("antiphon_realtime_sessions", "Open Realtime WebSocket sessions.", state.realtime_sessions),
            ("antiphon_connections_open", "HTTP requests being handled and open WebSockets (/health and /metrics "
             "not counted).", connections.total),
            ("antiphon_voice_transcriptions_held", "Clips being recognized (of --max-transcriptions).",
             state.client.transcriptions.held),
            ("antiphon_voice_spoken_answers_held", "Answers being spoken (of --max-spoken-answers).",
             state.client.spoken_answers.held),
            ("antiphon_spoken_answer_ids", "Spoken answers' transcripts kept for their audio ids.",
             len(state.spoken_answers)),
        ]
        counters = [("antiphon_requests_refused_total", "Requests refused with 429 (server full).",
                     state.admission.refused),
                    ("antiphon_connections_refused_total", "Connections refused over --max-connections or "
                     "--max-connections-per-client.", connections.refused)]
        counters += [(f"antiphon_{worker}_restarts_total", f"Times the {worker} process was restarted.", count)
                     for worker, count in state.client.restarts.items()]
        counters += [("antiphon_encoder_items_sent_cached_total", "Items sent to the encoder without their pixels "
                      "(its cache held them).", state.client.items_sent_cached),
                     ("antiphon_encoder_items_resent_total", "Items whose pixels the encoder asked for again "
                      "(evicted before use).", state.client.items_resent)]
        replicas = state.client.replica_rows() if config.data_parallel_size > 1 else ()
        return PlainTextResponse(state.metrics.render(state.client.stats, state.client.healthy, gauges, counters,
                                                      state.client.encoder_stats, replicas),
                                 media_type=METRICS_CONTENT_TYPE)

    def authorized(handler):
        async def wrapped(request: Request) -> Response:
            if not key_accepted(config, bearer_token(request.headers.get("authorization"))):
                return error_response(401, "missing or wrong API key", "invalid_api_key",
                                      error_type="authentication_error")
            return await handler(request)
        return wrapped

    async def realtime(websocket: WebSocket) -> None:
        offered = websocket.scope.get("subprotocols") or []
        presented = bearer_token(websocket.headers.get("authorization")) or key_from_subprotocols(offered)
        # Browsers refuse a handshake that selects none of the subprotocols they offered.
        chosen = "realtime" if "realtime" in offered else (offered[0] if offered else None)
        await websocket.accept(subprotocol=chosen)
        session = RealtimeSession(websocket, state, cache_salt(config, presented),
                                  requester_of(config, presented, websocket.scope))
        if not key_accepted(config, presented):
            await session.send_error("missing or wrong API key", "invalid_api_key")
            await websocket.close(code=1008, reason="invalid api key")
            return
        if not origin_allowed(config, websocket.headers.get("origin"), websocket.headers.get("host")):
            await session.send_error("this Origin is not allowed", "origin_not_allowed")
            await websocket.close(code=1008, reason="origin not allowed")
            return
        client = client_address(websocket.scope)
        refusal = connections.open(client)
        if refusal is not None:
            await session.send_error(refusal, "too_many_connections")
            await websocket.close(code=1013, reason="try again later")
            return
        state.realtime_sessions += 1
        try:
            await session.run()
        finally:
            state.realtime_sessions -= 1
            connections.close(client)

    routes = [
        Route("/health", health),
        # With API keys, counters such as the encoder cache's hits would tell one tenant what
        # another sends: /metrics wants a key too unless the operator makes it public.
        Route("/metrics", metrics if config.public_metrics else authorized(metrics)),
        Route("/v1/models", authorized(chat.models)),
        Route("/v1/chat/completions", authorized(chat.create), methods=["POST"]),
        Route("/v1/completions", authorized(completions.create), methods=["POST"]),
        Route("/v1/audio/transcriptions", authorized(audio.transcriptions), methods=["POST"]),
        Route("/v1/audio/speech", authorized(audio.speech), methods=["POST"]),
        WebSocketRoute("/v1/realtime", realtime),
        Mount("/", StaticFiles(directory=WEB_DIR, html=True), name="web"),
    ]
    # Host first: a rebound name is refused before it takes a connection slot.
    middleware = [Middleware(HostGuard, config=config),
                  Middleware(ConnectionCap, connections=connections, exempt=("/health", "/metrics"))]
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware)
