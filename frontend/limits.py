"""Who may talk to the server: API keys, Host and Origin checks, connection caps, event rates."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import time
from urllib.parse import urlsplit

from frontend.server_config import ServerConfig
from frontend.tenancy import Requester, tenant_of

API_KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."


class LimitExceeded(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def matching_key(config: ServerConfig, presented: str | None) -> str | None:
    """The configured key the client presented, or None. Compares in constant time."""
    if presented is None:
        return None
    found = None
    for key in config.api_keys:
        if hmac.compare_digest(presented.encode(), key.encode()):
            found = key
    return found


def key_accepted(config: ServerConfig, presented: str | None) -> bool:
    return not config.api_keys or matching_key(config, presented) is not None


def cache_salt(config: ServerConfig, presented: str | None) -> str | None:
    """Each tenant's own prefix- and encoder-cache salt (by default with two or more keys);
    never the key itself."""
    key = matching_key(config, presented) if config.salts_per_key() else None
    return None if key is None else hashlib.sha256(b"antiphon-cache-salt\0" + key.encode()).hexdigest()[:32]


def requester_of(config: ServerConfig, presented: str | None, scope) -> Requester:
    """Who sends this request: the tenant counts only when the server has several keys."""
    tenant = tenant_of(matching_key(config, presented)) if config.counts_tenants() else ""
    return Requester(tenant=tenant, client=share_holder(client_address(scope)))


def requester_of_request(config: ServerConfig, connection) -> Requester:
    """`requester_of` for an HTTP request or WebSocket that presents its key as a bearer token."""
    return requester_of(config, bearer_token(connection.headers.get("authorization")), connection.scope)


def share_holder(address: str) -> str:
    """The client a fair share counts: an IPv4 address, or an IPv6 address's /64 (one host
    usually holds a whole /64 and could take a new address for every request)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def bearer_token(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


def key_from_subprotocols(subprotocols: list[str]) -> str | None:
    for protocol in subprotocols:
        if protocol.startswith(API_KEY_SUBPROTOCOL_PREFIX):
            return protocol[len(API_KEY_SUBPROTOCOL_PREFIX):]
    return None


def host_name(host_header: str | None) -> str | None:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    if not host_header:
        return None
    try:
        return urlsplit(f"//{host_header}").hostname
    except ValueError:
        return None


def host_allowed(config: ServerConfig, host_header: str | None) -> bool:
    served = config.served_hosts()
    return served is None or host_name(host_header) in served


def origin_allowed(config: ServerConfig, origin: str | None, host_header: str | None) -> bool:
    """Browsers always send Origin; other clients usually do not, and are not subject to it.

    The server's own page is allowed: its Origin names the Host the request came to, and
    that Host has already passed the Host allowlist, so a rebound DNS name does not pass.
    """
    if origin is None or "*" in config.allowed_origins or origin in config.allowed_origins:
        return True
    return host_header is not None and host_allowed(config, host_header) and \
        origin in (f"http://{host_header}", f"https://{host_header}")


class EventRate:
    """Token bucket over one connection's messages: `rate` per second, bursts up to 2x (or
    `capacity`). `allow(cost)` takes `cost` tokens: seconds of audio, for the audio rate."""

    def __init__(self, rate: float, capacity: float | None = None) -> None:
        self.rate = rate
        self.capacity = 2 * rate if capacity is None else capacity
        self.tokens = self.capacity
        self.updated = time.monotonic()

    def allow(self, cost: float = 1.0) -> bool:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < cost:
            return False
        self.tokens -= cost
        return True


class OpenConnections:
    """Connections the server holds, in all and per client address, against two caps.

    An HTTP request counts while it is handled (a stream for as long as it streams), a
    WebSocket for as long as it is open. An idle keep-alive socket counts for nothing: uvicorn
    closes it within seconds, and the header deadline closes one that never sends a request.
    """

    def __init__(self, max_total: int, max_per_client: int) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.total = 0
        self.per_client: dict[str, int] = {}
        self.refused = 0

    def open(self, client: str) -> str | None:
        """Count a new connection from `client`; over a cap, count nothing and say why."""
        if self.total >= self.max_total:
            self.refused += 1
            return f"the server holds its limit of {self.max_total} connections; retry later"
        if self.per_client.get(client, 0) >= self.max_per_client:
            self.refused += 1
            return f"this client holds its limit of {self.max_per_client} connections; close some or retry later"
        self.total += 1
        self.per_client[client] = self.per_client.get(client, 0) + 1
        return None

    def close(self, client: str) -> None:
        self.total -= 1
        left = self.per_client[client] - 1
        if left:
            self.per_client[client] = left
        else:
            del self.per_client[client]


def client_address(scope) -> str:
    client = scope.get("client")
    return client[0] if client else ""


class ConnectionCap:
    """ASGI middleware: an HTTP request over a connection cap gets a JSON 503 with Retry-After.

    `exempt` paths (health checks, metrics) are neither counted nor refused, so a full server
    still says how it is. WebSockets pass through: their route counts them, so that a refusal
    can be an error event and a close code the client's SDK understands.
    """

    def __init__(self, app, connections: OpenConnections, exempt: tuple[str, ...], retry_after_s: int = 1) -> None:
        self.app = app
        self.connections = connections
        self.exempt = exempt
        self.retry_after_s = retry_after_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        client = client_address(scope)
        refusal = self.connections.open(client)
        if refusal is not None:
            await self._refuse(send, refusal)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.connections.close(client)

    async def _refuse(self, send, message: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                     "code": "too_many_connections"}}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(self.retry_after_s).encode())]})
        await send({"type": "http.response.body", "body": body})
