"""The encoder process: vision and audio towers with the global encoder cache.

Text-only models have no tower, so this process loads nothing: it reports ready and waits
for shutdown. The multimodal work fills it in; the process, its sockets and its lifecycle
are already part of every deployment.

Run by the frontend as `python -m workers.encoder_process --input ADDR --output ADDR`.
"""

from __future__ import annotations

import argparse
import os
import time

import zmq

from engine import protocol
from workers.process_guard import die_with_parent, exit_on_signals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    die_with_parent()
    exit_on_signals()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(args.input)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(args.output)
    try:
        outputs.send(protocol.encode(protocol.WorkerReady(worker="encoder", pid=os.getpid())))
        heartbeat = protocol.encode(protocol.Heartbeat(worker="encoder", pid=os.getpid()))
        last_sent = time.monotonic()
        while True:
            # Beat on a clock, not only when idle: a steady stream of inputs must not keep
            # the frontend from hearing that this loop is alive.
            wait_ms = max(0, int((last_sent + protocol.HEARTBEAT_INTERVAL_S - time.monotonic()) * 1000))
            if inputs.poll(wait_ms):
                if isinstance(protocol.decode_input(inputs.recv()), protocol.Shutdown):
                    break
            if time.monotonic() - last_sent >= protocol.HEARTBEAT_INTERVAL_S:
                outputs.send(heartbeat)
                last_sent = time.monotonic()
    except SystemExit:
        pass
    finally:
        inputs.close(linger=0)
        outputs.close(linger=0)
        context.term()


if __name__ == "__main__":
    main()
