"""The server's own settings: where it listens and the limits it enforces."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # None: no key needed. Otherwise HTTP wants `Authorization: Bearer KEY`; WebSockets take
    # that header or the subprotocol `openai-insecure-api-key.KEY` (for browsers).
    api_key: str | None = None
    # Browser origins allowed on the WebSocket besides the server's own; "*" allows any.
    allowed_origins: list[str] = field(default_factory=list)
    # Largest WebSocket message / HTTP body accepted, in bytes.
    max_message_bytes: int = 1 << 20
    # Largest prompt after the chat template, in tokens (further capped by the context).
    max_prompt_tokens: int = 8192
    # Output tokens when a client asks for none or for "inf".
    default_max_tokens: int = 1024
    max_concurrent_requests: int = 256
    max_concurrent_per_connection: int = 4
    # A WebSocket with no message and no active response for this long is closed.
    idle_timeout_s: float = 600.0
    # The decoder is restarted this many times after crashes, then the server exits non-zero.
    max_worker_restarts: int = 3

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_prompt_tokens", "default_max_tokens", "max_concurrent_requests",
                     "max_concurrent_per_connection"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.idle_timeout_s <= 0:
            raise ValueError("idle_timeout_s must be > 0")
