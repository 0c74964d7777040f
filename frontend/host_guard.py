"""ASGI middleware that refuses requests for host names the server does not serve.

A page on any domain can make its name resolve to 127.0.0.1 (DNS rebinding) and then talk
to a local server as a same-origin page. The Host header still carries that domain, so a
Host allowlist stops it, for HTTP and WebSocket handshakes alike.
"""

from __future__ import annotations

import json

from frontend.limits import host_allowed
from frontend.server_config import ServerConfig


class HostGuard:
    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not host_allowed(self.config, host):
                await self._refuse(scope, send, host)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope, send, host: str | None) -> None:
        if scope["type"] == "websocket":
            # Closing before accepting refuses the handshake (HTTP 403).
            await send({"type": "websocket.close", "code": 1008, "reason": "host not allowed"})
            return
        body = json.dumps({"error": {"message": f"this server does not serve the host {host!r}",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "host_not_allowed"}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
