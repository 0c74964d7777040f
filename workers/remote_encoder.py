"""The encoder process, as the decoder's engine core sees it (an EmbeddingSource).

Asks go out on a PUSH socket to the encoder; embeddings come back as frames on a PULL socket
this process binds. The frontend, not the decoder, registers and releases each request's
items with the encoder, so those two calls do nothing here.
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from engine import protocol
from engine.array_frames import tensor_from_frame

logger = logging.getLogger("antiphon.decoder")


class RemoteEncoder:
    def __init__(self, context: zmq.Context, asks_address: str, embeddings_address: str) -> None:
        self.asks = context.socket(zmq.PUSH)
        self.asks.connect(asks_address)
        self.embeddings = context.socket(zmq.PULL)
        self.embeddings.bind(embeddings_address)

    def register(self, request_id: str, items: list) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass

    def request(self, mm_hashes: list[str]) -> None:
        self.asks.send(protocol.encode(protocol.EncodeItems(list(mm_hashes))))

    def poll(self) -> list[tuple[str, object, str | None]]:
        delivered = []
        while True:
            try:
                frames = self.embeddings.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return delivered
            try:
                header = protocol.decode_embeddings(frames[0])
                if header.error is not None:
                    delivered.append((header.mm_hash, None, header.error))
                else:
                    delivered.append((header.mm_hash, tensor_from_frame(header, frames[1]), None))
            except (msgspec.DecodeError, ValueError, IndexError, RuntimeError) as exc:
                # A frame that does not decode names no item: its requests time out instead.
                logger.error("skipped an undecodable embeddings message: %s", exc)

    def close(self) -> None:
        self.asks.close(linger=0)
        self.embeddings.close(linger=0)
