"""The encoder process over its sockets, driven by hand as the frontend and decoder would."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest
import zmq

from engine import protocol
from engine.adapters import adapter_for
from engine.array_frames import item_frames, tensor_from_frame
from tests.server_harness import REPO
from tests.tiny_vlms import save_tiny_vlm


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return save_tiny_vlm("qwen2_vl", tmp_path_factory.mktemp("vlm") / "qwen2_vl")


@pytest.fixture
def encoder(vlm, tmp_path):
    context = zmq.Context()
    sockets = {"input": context.socket(zmq.PUSH), "output": context.socket(zmq.PULL),
               "embeddings": context.socket(zmq.PULL)}
    for name, socket in sockets.items():
        socket.bind(f"ipc://{tmp_path}/{name}")
    process = subprocess.Popen([sys.executable, "-m", "workers.encoder_process",
                                "--config", json.dumps({"model": str(vlm)}),
                                *[arg for name in ("input", "output", "embeddings")
                                  for arg in (f"--{name}", f"ipc://{tmp_path}/{name}")],
                                "--asks", f"ipc://{tmp_path}/asks"], cwd=REPO)
    asks = context.socket(zmq.PUSH)
    asks.connect(f"ipc://{tmp_path}/asks")
    sockets["asks"] = asks
    try:
        assert sockets["output"].poll(60_000), "the encoder never reported ready"
        assert isinstance(protocol.decode_output(sockets["output"].recv()), protocol.WorkerReady)
        yield sockets
    finally:
        sockets["input"].send(protocol.encode(protocol.Shutdown()))
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        for socket in sockets.values():
            socket.close(linger=0)
        context.term()


def next_output(sockets, kind, timeout_ms=10_000):
    while sockets["output"].poll(timeout_ms):
        message = protocol.decode_output(sockets["output"].recv())
        if isinstance(message, kind):
            return message
    raise AssertionError(f"no {kind.__name__} from the encoder")


def test_an_item_sent_without_pixels_that_is_not_cached_is_asked_for_then_served(encoder, vlm):
    from transformers import AutoConfig

    adapter = adapter_for(vlm, AutoConfig.from_pretrained(vlm))
    item = adapter.process_image(PIL.Image.fromarray(np.full((84, 112, 3), 90, dtype=np.uint8)))
    # The frontend believed it cached: header only.
    headers, frames = item_frames([item], cached={item.mm_hash})
    assert frames == []
    encoder["input"].send_multipart([protocol.encode(protocol.RegisterItems("r1", headers))])
    encoder["asks"].send(protocol.encode(protocol.EncodeItems([item.mm_hash])))
    missing = next_output(encoder, protocol.ItemsMissing)
    assert missing.mm_hashes == [item.mm_hash]
    assert not encoder["embeddings"].poll(300)  # nothing served without pixels
    headers, frames = item_frames([item])
    encoder["input"].send_multipart([protocol.encode(protocol.RegisterItems("r1", headers)), *frames])
    assert encoder["embeddings"].poll(10_000)
    header_frame, payload = encoder["embeddings"].recv_multipart()
    header = protocol.decode_embeddings(header_frame)
    assert header.error is None and header.mm_hash == item.mm_hash
    assert tuple(tensor_from_frame(header, payload).shape) == (item.num_embeddings, adapter.embedding_size())
    changes = next_output(encoder, protocol.CacheChanges)
    assert changes.added == [item.mm_hash]


def test_an_ask_that_overtakes_its_registration_waits_for_it(encoder, vlm):
    from transformers import AutoConfig

    adapter = adapter_for(vlm, AutoConfig.from_pretrained(vlm))
    item = adapter.process_image(PIL.Image.fromarray(np.full((84, 112, 3), 30, dtype=np.uint8)))
    encoder["asks"].send(protocol.encode(protocol.EncodeItems([item.mm_hash])))
    assert not encoder["embeddings"].poll(300)
    headers, frames = item_frames([item])
    encoder["input"].send_multipart([protocol.encode(protocol.RegisterItems("r2", headers)), *frames])
    assert encoder["embeddings"].poll(10_000)
    header = protocol.decode_embeddings(encoder["embeddings"].recv_multipart()[0])
    assert header.error is None and header.mm_hash == item.mm_hash


def test_garbage_frames_do_not_kill_the_encoder(encoder):
    encoder["input"].send_multipart([b"\xc1"])
    encoder["input"].send_multipart([protocol.encode(protocol.RegisterItems("r3", [
        protocol.ItemHeader("h", 4, [1, 2, 2], "image", "<f4", [4, 4])]))])  # header without its frame
    encoder["asks"].send(b"not msgpack")
    assert isinstance(next_output(encoder, protocol.Heartbeat, timeout_ms=3000), protocol.Heartbeat)


def test_encoder_batches_are_capped_by_embeddings_as_well_as_items():
    from workers.encoder_batches import encoder_batches

    costs = {"small1": 64, "small2": 64, "big": 900, "cached": 0, "small3": 64, "huge": 5000}
    batches = encoder_batches(list(costs), costs.__getitem__, max_items=8, max_embeddings=1000)
    # "big" would take the first batch past 1000 embeddings; "huge" alone exceeds the cap and goes alone.
    assert batches == [["small1", "small2"], ["big", "cached", "small3"], ["huge"]]
    assert encoder_batches(["a"] * 10, lambda h: 1, max_items=4, max_embeddings=1000) == [["a"] * 4, ["a"] * 4,
                                                                                           ["a"] * 2]
