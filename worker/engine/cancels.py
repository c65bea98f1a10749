"""Cancellations handed from the event loop (the cancel listener) to the model thread."""
from __future__ import annotations

import threading


class CancelInbox:
    """A thread-safe set of request ids to stop; every engine drains it once per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: set[str] = set()

    def add(self, request_id: str) -> None:
        with self._lock:
            self._ids.add(request_id)

    def take(self) -> set[str]:
        """Everything asked since the last take."""
        with self._lock:
            ids, self._ids = self._ids, set()
        return ids
