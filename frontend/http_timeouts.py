"""uvicorn's HTTP protocol with deadlines for a request's headers and for its body.

uvicorn closes idle keep-alive connections, but a client that sends its headers one byte at
a time (slowloris), or a body one byte at a time to a route that never reads it, holds its
connection for ever. Here the headers must be complete `header_timeout_s` after the
connection opens or after the next request's first byte, and the whole message
`body_timeout_s` after its headers; otherwise the connection is closed. A handler that reads
the body has the same deadline and answers 408 just before this one fires.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# The handler's own body deadline answers first (with a 408); this one is the backstop.
BACKSTOP_MARGIN_S = 1.0


def protocol_with_timeouts(header_timeout_s: float, body_timeout_s: float) -> type[HttpToolsProtocol]:
    class DeadlineProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm(header_timeout_s)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:
                self._arm(header_timeout_s)

        def on_headers_complete(self) -> None:
            self._disarm()
            if not self.parser.should_upgrade():  # a WebSocket has no body, and lives on
                self._arm(body_timeout_s + BACKSTOP_MARGIN_S)
            super().on_headers_complete()

        def handle_websocket_upgrade(self) -> None:
            self._disarm()
            super().handle_websocket_upgrade()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return DeadlineProtocol
