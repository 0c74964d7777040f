"""How a supervisor (frontend/worker_supervisor.py) starts its worker processes, and where the
front end's sockets to them listen.

- LocalLauncher (the default): a child process of the server, sockets on ipc:// paths in the
  supervisor's private directory. Nothing is reachable from another host.
- RayLauncher (frontend/ray_launcher.py, `--data-parallel-size` with `--ray-address`): an actor
  placed by Ray runs the worker process; the front end's sockets listen on TCP, authenticated
  with CurveZMQ (engine/link_keys.py).

A launcher's `start` returns a handle with asyncio.subprocess.Process's surface: `pid`,
`returncode`, `await wait()` (the exit code) and `kill()`; `close()` gives back what the
launcher holds once its supervisor has shut down (a Ray placement group).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path


class LocalLauncher:
    # CurveZMQ keys of the front end's links (engine/link_keys.LinkKeys), or None: ipc needs none.
    keys = None

    def __init__(self, environment: dict[str, str] | None = None) -> None:
        """`environment`: set in the workers' (a data-parallel replica's GPU)."""
        self.environment = environment

    def front_end_address(self, run_dir: Path, name: str) -> str:
        """Where the front end binds socket `name`: a path in its 0700 directory."""
        return f"ipc://{run_dir}/{name}"

    def close(self) -> None:
        """Nothing to give back: the processes are gone with the supervisor's shutdown."""

    async def start(self, worker: str, args: list[str]):
        environment = {**os.environ, **self.environment} if self.environment else None
        return await asyncio.create_subprocess_exec(sys.executable, *args, env=environment)
