"""What entered and left a cache since it was last reported, netted per key: the last change
wins, so a key that entered and left between two reports is reported once, as gone, and a
mirror that applies removals then additions ends up right (two separate lists would lose the
order: a key added, then evicted, would stay in the mirror for good)."""

from __future__ import annotations

from typing import Generic, TypeVar

Key = TypeVar("Key")


class ChangeLog(Generic[Key]):
    def __init__(self) -> None:
        self._present: dict[Key, bool] = {}
        self.cleared = False

    def __bool__(self) -> bool:
        return bool(self._present) or self.cleared

    def added(self, key: Key) -> None:
        self._present[key] = True

    def removed(self, key: Key) -> None:
        self._present[key] = False

    def clear(self) -> None:
        """Everything left the cache: report `cleared`, and only what enters after it."""
        self._present.clear()
        self.cleared = True

    def take(self) -> tuple[list[Key], list[Key], bool]:
        """(added, removed, cleared) since the last call; `cleared` comes before the others."""
        added = [key for key, present in self._present.items() if present]
        removed = [key for key, present in self._present.items() if not present]
        cleared = self.cleared
        self._present, self.cleared = {}, False
        return added, removed, cleared
