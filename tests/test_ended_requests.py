"""Ended requests reach the workers in batches, each worker's on its own: an encoder slow to
take its releases does not keep KV blocks held and work running for requests that ended."""

import asyncio

from engine import protocol
from frontend.ended_requests import EndedRequests
from frontend.engine_errors import EngineUnavailable


class Workers:
    """Records what is sent to each worker; the encoder's sends wait until `encoder_free`."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.encoder_free = asyncio.Event()

    async def send(self, worker: str, data: bytes) -> None:
        if worker == "encoder":
            await self.encoder_free.wait()
        decode = protocol.decode_encoder_input if worker == "encoder" else protocol.decode_input
        self.sent.append((worker, decode(data)))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def stop(sender: asyncio.Task) -> None:
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)


async def test_aborts_do_not_wait_for_an_encoder_that_blocks():
    workers = Workers()
    ended = EndedRequests(workers)
    sender = asyncio.ensure_future(ended.send())
    try:
        ended.release_items("a")
        ended.abort("a")
        ended.abort("b")
        await settle()
        assert workers.sent == [("decoder", protocol.AbortRequests(["a", "b"]))]
        assert ended.abort_messages_sent == 1  # one message for the batch
        # Requests that end while the encoder still blocks: their aborts go out too.
        ended.release_items("c")
        ended.abort("c")
        await settle()
        assert workers.sent[-1] == ("decoder", protocol.AbortRequests(["c"]))
        workers.encoder_free.set()
        await settle()
        assert workers.sent[2:] == [("encoder", protocol.ReleaseItems(["a"])),
                                    ("encoder", protocol.ReleaseItems(["c"]))]
    finally:
        await stop(sender)


async def test_a_lost_decoder_does_not_stop_the_releases():
    workers = Workers()
    workers.encoder_free.set()

    async def send(worker: str, data: bytes) -> None:
        if worker == "decoder":
            raise EngineUnavailable("engine unavailable: decoder lost")
        workers.sent.append((worker, data))

    workers.send = send
    ended = EndedRequests(workers)
    sender = asyncio.ensure_future(ended.send())
    try:
        ended.abort("a")
        ended.release_items("a")
        await settle()
        assert [worker for worker, _ in workers.sent] == ["encoder"] and ended.abort_messages_sent == 0
    finally:
        await stop(sender)
