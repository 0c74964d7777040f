"""Ended requests reach the workers in batches: the decoder's aborts first, so an encoder slow
to take its releases does not keep KV blocks held and work running for requests that ended."""

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


async def test_aborts_go_out_before_releases_and_do_not_wait_for_the_encoder():
    workers = Workers()
    ended = EndedRequests(workers)
    sender = asyncio.ensure_future(ended.send())
    try:
        ended.release_items("a")
        ended.abort("a")
        ended.abort("b")
        for _ in range(20):
            await asyncio.sleep(0)
        assert [worker for worker, _ in workers.sent] == ["decoder"]
        assert ended.abort_messages_sent == 1  # one message for the batch
        workers.encoder_free.set()
        for _ in range(20):
            await asyncio.sleep(0)
        assert workers.sent == [("decoder", protocol.AbortRequests(["a", "b"])),
                                ("encoder", protocol.ReleaseItems(["a"]))]
    finally:
        sender.cancel()


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
        for _ in range(20):
            await asyncio.sleep(0)
        assert [worker for worker, _ in workers.sent] == ["encoder"] and ended.abort_messages_sent == 0
    finally:
        sender.cancel()
