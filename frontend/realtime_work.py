"""Work of one Realtime session that takes effect in the order its events came, without ever
holding up the session's socket.

The receive loop hands an event's handling to an `OrderedWork` and waits for it while it is
quick, as if the handler were awaited in place (so a response.create has started its response
before the next event is read, and replies keep the events' order). A handler that awaits
something with no bound of its own (a transcription waits on the encoder and on every other
client's clips) wraps that await in `off_the_socket`: from then on the loop goes back to
reading, so WebSocket pings are answered, events are rate-limited, and events that do not
depend on the slow work are handled. Work handed over meanwhile waits its turn, and `close`
cancels and awaits all of it.

Why the loop must keep reading: the WebSocket server reads the next frame (a pong included)
only when the application asks for the next message; a session that waits out a busy encoder
in its receive loop misses its pongs and is closed with 1011 (keepalive ping timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger("antiphon.realtime")

# The OrderedWork whose runner task is running the current step (unset outside one).
_running: ContextVar["OrderedWork | None"] = ContextVar("realtime_ordered_work", default=None)


class OrderedWork:
    """Steps run one at a time, in the order handed over, by a task of their own."""

    def __init__(self) -> None:
        self._steps: deque[Callable[[], Awaitable[None]]] = deque()
        self._runner: asyncio.Task | None = None
        # Set when the step its caller waits on goes off the socket.
        self._caller_free: asyncio.Future | None = None

    @property
    def busy(self) -> bool:
        return bool(self._steps)

    @property
    def waiting(self) -> int:
        """Steps handed over that have not started."""
        return max(0, len(self._steps) - 1)

    async def run(self, step: Callable[[], Awaitable[None]]) -> None:
        """Runs `step` after the steps handed over before it. Returns when it is done or has
        gone off the socket; at once when it has to wait for earlier steps. Steps handle their
        own errors (a session sends them as error events); one that escapes is logged."""
        self._steps.append(step)
        if self._runner is not None:
            return
        self._caller_free = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self._run())
        await asyncio.wait([self._runner, self._caller_free], return_when=asyncio.FIRST_COMPLETED)

    async def _run(self) -> None:
        _running.set(self)  # this task's own context: the steps' off_the_socket finds it
        try:
            while self._steps:
                step = self._steps[0]
                try:
                    await step()
                except Exception:
                    logger.exception("a realtime session step failed")
                if self._steps and self._steps[0] is step:  # close() may have dropped it
                    self._steps.popleft()
        finally:
            self._runner = None
            self._free_caller()

    def _free_caller(self) -> None:
        if self._caller_free is not None and not self._caller_free.done():
            self._caller_free.set_result(None)

    async def close(self) -> None:
        """Cancels the running step, drops the waiting ones, and returns once the step has
        unwound (its own cleanup done)."""
        self._steps.clear()
        runner = self._runner
        if runner is not None:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)


async def off_the_socket(awaitable: Awaitable[T]) -> T:
    """Awaits slow work of the step being run, letting whoever waits on the step (the receive
    loop) go on meanwhile. Outside a step (a handler called directly) it is a plain await."""
    work = _running.get()
    if work is not None:
        work._free_caller()
    return await awaitable
