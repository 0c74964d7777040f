"""The ZeroMQ sockets each worker process is started with, written once for both ends: the
supervisor (frontend/worker_supervisor.py) binds or names one address per socket and passes
them as flags; the worker's main (workers/worker_loop.py, worker_main) declares the same flags.

Per worker: flag -> the supervisor's name for the socket. Two workers given one name share that
address: every worker's `output` is the one socket the front end reads; the decoder's
`encoder-asks` is the encoder's `asks`, and both speak of `embeddings`; the decoder hands an
omni model's rows to the talker on `thinker-rows`.
"""

from __future__ import annotations

WORKER_SOCKETS: dict[str, dict[str, str]] = {
    "decoder": {"input": "decoder-in", "output": "outputs", "encoder-asks": "encoder-asks",
                "embeddings": "embeddings", "thinker-rows": "thinker-rows"},
    "encoder": {"input": "encoder-in", "output": "outputs", "asks": "encoder-asks", "embeddings": "embeddings"},
    "talker": {"input": "talker-in", "output": "outputs", "speech": "speech", "thinker-rows": "thinker-rows"},
}

# Every address the supervisor makes.
SOCKET_NAMES = tuple(sorted({name for sockets in WORKER_SOCKETS.values() for name in sockets.values()}))


def worker_flags(worker: str, addresses: dict[str, str]) -> list[str]:
    """The command-line flags that give `worker` its sockets' addresses (by the supervisor's names)."""
    return [part for flag, name in WORKER_SOCKETS[worker].items() for part in (f"--{flag}", addresses[name])]
