"""How often one worker may be restarted: a few crashes are survivable, a crash loop is not.

A sliding window rather than a lifetime count: a server that lost its decoder three times in
a month should restart it a fourth time, one that lost it four times in a minute should stop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


class RestartBudget:
    """At most `max_restarts` restarts in any `window_s` seconds; older ones are forgiven."""

    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        # When each restart still inside the window happened, oldest first (at most max_restarts).
        self._recent: deque[float] = deque()

    def try_spend(self) -> bool:
        """Records a restart and returns True if the budget allows one now; False changes nothing."""
        now = self.clock()
        self._forget_before(now - self.window_s)
        if len(self._recent) >= self.max_restarts:
            return False
        self._recent.append(now)
        return True

    @property
    def recent(self) -> int:
        """Restarts inside the window as of now."""
        self._forget_before(self.clock() - self.window_s)
        return len(self._recent)

    def _forget_before(self, cutoff: float) -> None:
        while self._recent and self._recent[0] <= cutoff:
            self._recent.popleft()
