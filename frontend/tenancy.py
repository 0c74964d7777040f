"""Who a request comes from, and fair shares of the work every client competes for.

A *tenant* is an API key (all clients when the server has none); a *client* is a network
address. Work that one shared process does for everyone (grammar compiles, transcriptions,
spoken answers) is bounded server-wide and, so that one client or one tenant cannot take it
all, per client and per tenant too.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Requester:
    # An opaque name of the API key presented ("" when the server has no keys): the key itself
    # never leaves the edge.
    tenant: str
    # The client's network address (behind a proxy: the proxy's).
    client: str


# Work done for the server itself (warm-up, tests' direct calls): counted only server-wide.
ANONYMOUS = Requester(tenant="", client="")


def tenant_of(key: str | None) -> str:
    """A stable, non-reversible name for an API key; "" for none."""
    if key is None:
        return ""
    return hashlib.sha256(b"antiphon-tenant\0" + key.encode()).hexdigest()[:16]


class ShareExhausted(Exception):
    """The server, this tenant or this client holds as much of this work as it may."""

    def __init__(self, message: str, scope: str) -> None:
        super().__init__(message)
        self.scope = scope  # "server", "tenant" or "client"


def share_of(total: int, fraction: float) -> int:
    """A fraction of a server-wide cap, at least one."""
    return max(1, min(total, math.ceil(total * fraction)))


class FairShare:
    """Slots of one kind of work, counted server-wide, per tenant and per client.

    `take` either counts the slot everywhere or refuses without counting anything; the slot
    it returns is released exactly once, however often `release` is called.
    """

    def __init__(self, what: str, flag: str, total: int, per_tenant: int, per_client: int) -> None:
        self.what = what  # "clips being recognized", for messages
        self.flag = flag  # the server-wide cap's flag, for messages
        self.total = total
        self.per_tenant = per_tenant
        self.per_client = per_client
        self.held = 0
        self.by_tenant: dict[str, int] = {}
        self.by_client: dict[str, int] = {}

    def take(self, requester: Requester) -> "ShareSlot":
        if self.held >= self.total:
            raise ShareExhausted(f"{self.total} {self.what} at once on this server ({self.flag}); try again shortly",
                                 "server")
        if requester.tenant and self.by_tenant.get(requester.tenant, 0) >= self.per_tenant:
            raise ShareExhausted(f"this API key holds its share of {self.per_tenant} {self.what} at once; "
                                 "try again shortly", "tenant")
        if requester.client and self.by_client.get(requester.client, 0) >= self.per_client:
            raise ShareExhausted(f"this client holds its share of {self.per_client} {self.what} at once; "
                                 "try again shortly", "client")
        self.held += 1
        _count(self.by_tenant, requester.tenant, +1)
        _count(self.by_client, requester.client, +1)
        return ShareSlot(self, requester)

    def _release(self, requester: Requester) -> None:
        self.held -= 1
        _count(self.by_tenant, requester.tenant, -1)
        _count(self.by_client, requester.client, -1)


class ShareSlot:
    def __init__(self, share: FairShare, requester: Requester) -> None:
        self._share = share
        self._requester = requester
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._share._release(self._requester)

    def __enter__(self) -> "ShareSlot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _count(counts: dict[str, int], name: str, delta: int) -> None:
    """Counts that drop to zero are removed, so a stream of one-off clients leaves nothing."""
    if not name:
        return
    left = counts.get(name, 0) + delta
    if left:
        counts[name] = left
    else:
        counts.pop(name, None)
