"""The server's own settings: where it listens and the limits it enforces."""

from __future__ import annotations

from dataclasses import dataclass, field

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Empty: no key needed. Otherwise HTTP wants `Authorization: Bearer KEY`; WebSockets take
    # that header or the subprotocol `openai-insecure-api-key.KEY` (for browsers).
    api_keys: list[str] = field(default_factory=list)
    # Browser origins allowed on the WebSocket besides the server's own; "*" allows any.
    allowed_origins: list[str] = field(default_factory=list)
    # Largest WebSocket message / HTTP body accepted, in bytes.
    max_message_bytes: int = 1 << 20
    # Largest prompt after the chat template, in tokens (further capped by the context).
    max_prompt_tokens: int = 8192
    # Output tokens when a client asks for none or for "inf".
    default_max_tokens: int = 1024
    # Requests admitted at once: the decoder's batch (max_num_seqs) plus this many waiting
    # in its queue. Past that: 429 with Retry-After.
    max_waiting_requests: int = 4096
    max_concurrent_per_connection: int = 4
    # Connections held (HTTP requests being handled and open WebSockets), in all and per
    # client address; past either, HTTP gets a JSON 503 with Retry-After and a WebSocket an
    # error event and close 1013. /health and /metrics are exempt. Behind a proxy every
    # client has the proxy's address: raise the per-client cap there.
    max_connections: int = 4096
    max_connections_per_client: int = 64
    # Images (engine/media.py): encoded size, pixels (checked before decoding), images per
    # request, and the one folder whose files may be named as images (None: none).
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 16_000_000
    max_images_per_request: int = 8
    # Audio clips one request may hold, for a model that hears them (an omni model).
    max_audio_clips_per_request: int = 8
    allowed_local_media_path: str | None = None
    # Per Realtime session: items kept in the conversation (a client item past it is refused:
    # delete some to go on; an answer evicts the oldest items instead), their text, and client
    # messages per second (a burst of twice that is allowed).
    max_conversation_items: int = 512
    # Text bytes a conversation may hold, the session's instructions and the answers included
    # (an answer evicts the oldest items to fit; one answer alone may take it past).
    max_conversation_bytes: int = 1 << 20
    # Audio a conversation keeps for a model that hears it (an omni model; float32 at 16 kHz,
    # 7.7 MB for 120 s); keeping more evicts its oldest user items with audio (as do more clips
    # than max_audio_clips_per_request, the most one response may hear).
    max_conversation_audio_seconds: float = 120.0
    max_events_per_second: float = 200.0
    max_stop_strings: int = 8
    # OpenAI API completeness: top_logprobs per token, choices per request (n), a grammar's or
    # schema's size, tools per request, prompts in one /v1/completions batch. A request field
    # the server does not know is refused (400 unsupported_parameter) unless this is set.
    max_logprobs: int = 20
    max_choices: int = 16
    max_grammar_bytes: int = 64 << 10
    grammar_compile_timeout_s: float = 10.0
    max_tools: int = 128
    max_prompts_per_request: int = 64
    accept_unknown_fields: bool = False
    # A client has this long to send its request headers, and then its body.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # Host headers served (DNS rebinding: a page on any name can resolve to 127.0.0.1).
    # Empty: loopback names when bound to loopback, any host otherwise; "*" allows any.
    allowed_hosts: list[str] = field(default_factory=list)
    # Each API key (tenant) its own prefix-cache and encoder-cache salt, so tenants never share
    # KV blocks or encoder outputs nor learn from each other's cache-hit timing. None: on when
    # more than one key is configured; False shares the caches across keys on purpose.
    cache_salt_per_key: bool | None = None
    # /metrics wants an API key when keys are configured, unless this makes it public.
    public_metrics: bool = False
    # Shares of grammar compiles, transcriptions and spoken answers one tenant (API key, when
    # more than one is configured) and one client address may hold, as fractions of the
    # server-wide caps (at least one each), so that no client takes them all.
    share_per_tenant: float = 0.5
    share_per_client: float = 0.25
    # Spoken chat answers' transcripts kept for clients that send an answer back by its audio
    # id: per API key, and for how long (the answer's `expires_at`).
    spoken_answers_per_key: int = 4096
    spoken_answer_ttl_s: float = 3600.0
    # A WebSocket with no message and no active response for this long is closed.
    idle_timeout_s: float = 600.0
    # A worker that crashes or hangs is restarted at most this many times within
    # worker_restart_window_s (counted per worker); one more and the server exits non-zero.
    max_worker_restarts: int = 3
    # Data parallel (frontend/replica_set.py): this many replicas, each its own decoder and
    # encoder (and talker), behind a router; 1 is the single engine (nothing of it is loaded).
    data_parallel_size: int = 1
    # How the router picks a replica (frontend/replica_router.py).
    routing_policy: str = "cache-aware"
    # With data parallel: None runs the replicas as local processes; "auto" or HOST:PORT joins
    # that Ray cluster, whose actors run them (frontend/ray_launcher.py).
    ray_address: str | None = None
    # Restarts are counted per worker over this many seconds; older ones are forgiven.
    worker_restart_window_s: float = 600.0
    # A worker that sends nothing (not even a heartbeat) for this long is killed and restarted.
    worker_timeout_s: float = 30.0
    # Voice: an uploaded audio file's bytes and length, and the text one speech request may speak.
    max_audio_bytes: int = 25 << 20
    max_audio_seconds: float = 600.0
    max_speech_input_chars: int = 4096
    # A Realtime session's input audio buffer (and one input_audio part), in seconds.
    max_audio_buffer_seconds: float = 120.0
    # Server-wide: clips (30 s windows) being recognized and answers being spoken at once;
    # past either, 429 / `voice_busy`.
    max_transcriptions: int = 16
    max_spoken_answers: int = 16
    # Audio a Realtime session may append, in seconds of audio per second (bursts of 30 s):
    # real-time clients send 1; more lets one session keep the VAD busy for everyone.
    max_audio_speedup: float = 4.0
    # Events a Realtime session holds while its earlier work (a transcription, a grammar
    # compile, templating) goes on; past it an event gets an error event and is dropped.
    max_queued_events: int = 64
    # Grammar compiles the front end runs at once to check specs, each in its own process
    # (frontend/grammar_workers.py); shared per tenant and per client. Past it: 429 grammar_busy.
    max_grammar_compiles: int = 2
    # Messages one chat request may hold: refused past it before any templating work.
    max_messages: int = 2048

    def media_limits(self):
        """The image and clip limits as engine/media.py takes them (raises ValueError for bad values)."""
        from pathlib import Path

        from engine.media import MediaLimits

        folder = Path(self.allowed_local_media_path) if self.allowed_local_media_path else None
        return MediaLimits(max_image_bytes=self.max_image_bytes, max_image_pixels=self.max_image_pixels,
                           max_images_per_request=self.max_images_per_request,
                           max_audio_clips_per_request=self.max_audio_clips_per_request,
                           allowed_local_media_path=folder)

    def __post_init__(self) -> None:
        for name in ("worker_restart_window_s", "worker_timeout_s", "max_audio_bytes", "max_audio_seconds",
                     "max_speech_input_chars", "max_audio_buffer_seconds",
                     "max_transcriptions", "max_spoken_answers", "max_audio_speedup", "spoken_answers_per_key",
                     "spoken_answer_ttl_s", "max_conversation_audio_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("max_message_bytes", "max_prompt_tokens", "default_max_tokens", "max_concurrent_per_connection",
                     "max_connections", "max_connections_per_client", "max_conversation_items",
                     "max_conversation_bytes", "max_stop_strings", "max_choices", "max_grammar_bytes",
                     "max_tools", "max_prompts_per_request", "max_queued_events"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 1 <= self.max_grammar_bytes <= 1 << 20:
            raise ValueError("max_grammar_bytes must be in [1, 1 MiB]")
        if not 0 <= self.max_logprobs <= 1024:
            raise ValueError("max_logprobs must be in [0, 1024]")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        for name in ("idle_timeout_s", "header_timeout_s", "body_timeout_s", "max_events_per_second",
                     "grammar_compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        # An idle worker beats once a second: a shorter timeout would kill healthy workers.
        if self.worker_timeout_s <= 2.0:
            raise ValueError("worker_timeout_s must be > 2 (workers send a heartbeat every second)")
        for name in ("share_per_tenant", "share_per_client"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        if self.ray_address is not None and self.data_parallel_size < 2:
            raise ValueError("--ray-address places data-parallel replicas: give --data-parallel-size 2 or more")
        from frontend.replica_router import POLICIES

        if self.routing_policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(POLICIES)}")
        if self.max_worker_restarts < 0:
            raise ValueError("max_worker_restarts must be >= 0")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.max_messages < 1:
            raise ValueError("max_messages must be >= 1")
        if self.max_grammar_compiles < 1:
            raise ValueError("max_grammar_compiles must be >= 1")

    def salts_per_key(self) -> bool:
        if self.cache_salt_per_key is None:
            return len(self.api_keys) > 1
        return self.cache_salt_per_key

    def counts_tenants(self) -> bool:
        """Whether per-tenant shares apply: with one key (or none) every client is one tenant."""
        return len(self.api_keys) > 1

    def served_hosts(self) -> set[str] | None:
        """Host names the server answers to; None means any."""
        if "*" in self.allowed_hosts:
            return None
        if self.allowed_hosts:
            return {h.lower() for h in self.allowed_hosts}
        if self.host in LOOPBACK_NAMES:
            return set(LOOPBACK_NAMES)
        return None
