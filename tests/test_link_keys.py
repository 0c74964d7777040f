"""CurveZMQ on the front end's tcp links (engine/link_keys.py): only a worker holding the key
the front end made gets a message through, either way."""

import asyncio

import zmq
import zmq.asyncio

from engine import link_keys
from engine.link_keys import LinkKeys


def _client(context: zmq.Context, kind: int, address: str, keys: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    socket = context.socket(kind)
    socket.linger = 0
    if keys is not None:
        socket.curve_serverkey, socket.curve_publickey, socket.curve_secretkey = keys
    socket.connect(address)
    return socket


async def _exchange(keys: LinkKeys, client_keys) -> tuple[bool, bool]:
    """(whether the front end heard the client, whether the client heard the front end)."""
    context = zmq.asyncio.Context()
    authenticator = link_keys.allow_workers(context, keys)
    try:
        from_workers = context.socket(zmq.PULL)
        to_workers = context.socket(zmq.PUSH)
        for socket in (from_workers, to_workers):
            socket.linger = 0
            keys.serve(socket)
            socket.bind("tcp://127.0.0.1:*")
        sync = zmq.Context()
        sender = _client(sync, zmq.PUSH, from_workers.getsockopt_string(zmq.LAST_ENDPOINT), client_keys)
        receiver = _client(sync, zmq.PULL, to_workers.getsockopt_string(zmq.LAST_ENDPOINT), client_keys)
        sender.send(b"forged step outputs")
        heard = await from_workers.poll(1500)
        try:
            await to_workers.send(b"a request", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no authenticated peer to queue it for
        await asyncio.sleep(0.5)
        read = receiver.poll(1000)
        for socket in (sender, receiver, from_workers, to_workers):
            socket.close(linger=0)
        sync.term()
        return bool(heard), bool(read)
    finally:
        authenticator.stop()
        context.term()


def test_the_worker_key_gets_through():
    keys = LinkKeys.generate()
    assert asyncio.run(_exchange(keys, (keys.server_public, keys.worker_public, keys.worker_secret))) == (True, True)


def test_a_peer_without_keys_or_with_its_own_is_refused():
    keys = LinkKeys.generate()
    assert asyncio.run(_exchange(keys, None)) == (False, False)
    stranger_public, stranger_secret = zmq.curve_keypair()
    # Even knowing the server's public key, a client key the front end did not make is refused.
    assert asyncio.run(_exchange(keys, (keys.server_public, stranger_public, stranger_secret))) == (False, False)


def test_a_worker_connects_with_the_keys_its_launcher_gave_it(monkeypatch):
    keys = LinkKeys.generate()
    for name, value in keys.worker_environment().items():
        monkeypatch.setenv(name, value)

    async def exchange() -> bool:
        context = zmq.asyncio.Context()
        authenticator = link_keys.allow_workers(context, keys)
        from_workers = context.socket(zmq.PULL)
        from_workers.linger = 0
        keys.serve(from_workers)
        from_workers.bind("tcp://127.0.0.1:*")
        sync = zmq.Context()
        worker = sync.socket(zmq.PUSH)
        worker.linger = 0
        link_keys.connect(worker, from_workers.getsockopt_string(zmq.LAST_ENDPOINT))
        worker.send(b"ready")
        heard = await from_workers.poll(1500)
        worker.close()
        sync.term()
        from_workers.close()
        authenticator.stop()
        context.term()
        return bool(heard)

    assert asyncio.run(exchange())


def test_the_worker_environment_holds_no_server_secret():
    keys = LinkKeys.generate()
    environment = keys.worker_environment()
    assert keys.server_secret.decode() not in environment.values()
    assert set(environment) == set(link_keys.ENVIRONMENT)
