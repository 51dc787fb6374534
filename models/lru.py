"""A least-recently-used map bounded by the bytes it holds: the memory of what a long-lived caller has computed
(token counts, text embeddings, estimated coverage of (subquestion, passage) pairs), kept so that a text seen
again is not computed again, and bounded so that the caller's memory does not grow with what it has been sent.
Not thread-safe: a caller shared by threads holds its own lock around it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """`put(key, value, size)` stores a value with the bytes it takes in memory (its key's included, as the caller
    counts them); once the sizes add up to more than `max_bytes` (None: unbounded) the least recently put or got
    entries are dropped, the newest one too when it alone is over the bound. `nbytes` is the sum held."""

    def __init__(self, max_bytes: int | None = None):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes: expected a size in bytes >= 0 or None, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()  # least recently used first
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K, default: V | None = None) -> V | None:
        """The value of `key`, now the most recently used; `default` when it is not held."""
        entry = self._entries.get(key)
        if entry is None:
            return default
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, size: int) -> None:
        """Hold `value` under `key` as the most recently used, then drop the least recently used while over
        `max_bytes`."""
        if key in self._entries:
            self.nbytes -= self._entries.pop(key)[1]
        self._entries[key] = (value, size)
        self.nbytes += size
        while self.max_bytes is not None and self.nbytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.nbytes -= dropped
