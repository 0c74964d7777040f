"""Admission limits shared by every protocol: API key, origin, concurrency."""

from __future__ import annotations

import hmac

from frontend.server_config import ServerConfig

API_KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."


class LimitExceeded(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class ConcurrencyLimiter:
    """Counts streaming requests server-wide; per-connection counts live with the connection."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def acquire(self) -> None:
        if self.active >= self.limit:
            raise LimitExceeded(f"the server is at its limit of {self.limit} concurrent requests; retry later",
                                "too_many_requests")
        self.active += 1

    def release(self) -> None:
        self.active -= 1


def key_matches(config: ServerConfig, presented: str | None) -> bool:
    if config.api_key is None:
        return True
    return presented is not None and hmac.compare_digest(presented.encode(), config.api_key.encode())


def bearer_token(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


def key_from_subprotocols(subprotocols: list[str]) -> str | None:
    for protocol in subprotocols:
        if protocol.startswith(API_KEY_SUBPROTOCOL_PREFIX):
            return protocol[len(API_KEY_SUBPROTOCOL_PREFIX):]
    return None


def origin_allowed(config: ServerConfig, origin: str | None, host_header: str | None) -> bool:
    """Browsers always send Origin; other clients usually do not, and are not subject to it."""
    if origin is None or "*" in config.allowed_origins:
        return True
    if origin in config.allowed_origins:
        return True
    # The page the server itself serves.
    return host_header is not None and origin in (f"http://{host_header}", f"https://{host_header}")
