"""CurveZMQ on the links between the front end and workers on other machines.

Every tcp:// link is encrypted and both ends are authenticated: the front end's sockets are
Curve servers that accept only the one client key it made for its workers (a ZAP handler), and
a worker's sockets are Curve clients that check the front end's server key. A process without
the worker secret cannot submit requests, read outputs or report cache contents; one without
the server key cannot pose as the front end to a worker that holds it. ipc:// links (one machine, a 0700 directory) stay
as they are.

The front end makes both key pairs when it starts and hands the worker's to each worker through
its launcher (Ray's actor arguments), which puts them in the worker process's environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

ENVIRONMENT = ("ANTIPHON_LINK_SERVER_KEY", "ANTIPHON_LINK_PUBLIC_KEY", "ANTIPHON_LINK_SECRET_KEY")
ZAP_DOMAIN = b"antiphon"


@dataclass(frozen=True)
class LinkKeys:
    server_public: bytes
    server_secret: bytes
    worker_public: bytes
    worker_secret: bytes

    @classmethod
    def generate(cls) -> "LinkKeys":
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CurveZMQ: links between machines cannot be authenticated")
        server_public, server_secret = zmq.curve_keypair()
        worker_public, worker_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, worker_public, worker_secret)

    def worker_environment(self) -> dict[str, str]:
        """What a worker process needs (never the server's secret)."""
        values = (self.server_public, self.worker_public, self.worker_secret)
        return {name: value.decode() for name, value in zip(ENVIRONMENT, values)}

    def serve(self, socket: zmq.Socket) -> None:
        """Makes a front-end socket a Curve server (before it binds); the ZAP handler that
        `allow_workers` starts decides who may connect."""
        socket.curve_server = True
        socket.curve_secretkey = self.server_secret
        socket.zap_domain = ZAP_DOMAIN
        # Fail closed: without a ZAP handler libzmq would admit any client of the server key.
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def connect(socket: zmq.Socket, address: str) -> None:
    """A worker's connect: as a Curve client with the keys from its environment when the
    launcher gave it some (a Ray worker: always, its links being tcp), else as it is (ipc
    within one machine; tcp only in tests that stand in for the front end)."""
    values = [os.environ.get(name) for name in ENVIRONMENT]
    if address.startswith("tcp://") and all(values):
        server_public, public, secret = (value.encode() for value in values)
        socket.curve_serverkey = server_public
        socket.curve_publickey = public
        socket.curve_secretkey = secret
    socket.connect(address)


class WorkerKeyCheck:
    """The ZAP handler's rule: a Curve client is let in only with the workers' public key."""

    def __init__(self, worker_public: bytes) -> None:
        self._allowed = worker_public  # z85, as pyzmq's authenticator hands keys to callback

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._allowed


def allow_workers(context, keys: LinkKeys):
    """Starts the ZAP handler of the front end's asyncio `context` (one per context: every
    supervisor of a replica set shares it), admitting only `keys`' workers; stop() it at
    shutdown."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    authenticator = AsyncioAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=WorkerKeyCheck(
        keys.worker_public))
    return authenticator
