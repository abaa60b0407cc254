"""When to ask Triton whether a request was cancelled (each ask is a round trip from the stub
to the server)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


class CancelPolls:
    """When to ask Triton whether a request was cancelled. Each `is_cancelled()` is a round
    trip from the stub to the server, costlier than sending a response, so a request is asked
    at most once per `interval` seconds (its first non-final response always), never on its
    final response; a cancel is seen within `interval` plus one response."""

    def __init__(self, interval: float = 0.2, max_entries: int = 65536) -> None:
        self.interval = interval
        self.max_entries = max_entries
        self._asked: OrderedDict[str, float] = OrderedDict()  # least recently seen first
        self._lock = threading.Lock()

    def due(self, key: str, final: bool) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._asked.pop(key, None)
            if final:
                return False
            if last is not None and now - last < self.interval:
                self._asked[key] = last
                return False
            self._asked[key] = now
            while len(self._asked) > self.max_entries:  # requests whose final we never saw
                self._asked.popitem(last=False)
            return True

    def forget(self, key: str) -> None:
        with self._lock:
            self._asked.pop(key, None)
