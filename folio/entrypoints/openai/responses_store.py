"""Stored responses (the Responses API's `store`): a bounded map from response id to the
response object, the conversation that led to it, and its prompt + output token ids.

Bounded two ways: at most `max_entries` (the least recently used goes first), and each entry
expires `ttl_s` seconds after its last use (stored, continued, retrieved), so a conversation in
use stays while an abandoned one goes. Every entry is self-contained (its whole conversation:
the items of the responses it continued, shared with them in memory), so evicting one never
breaks another's continuation. The items of the live entries are indexed by id, for the
`item_reference` input items that name them.

With a SQLite file every change is written through (on one writer thread, in order, off the
event loop) and the live entries are read back when the store opens, so stored responses
survive a restart. Memory holds every live entry either way: the file is persistence, not a
second tier.

A stored response's KV blocks stay pinned in the engine's prefix cache for
`kv_pin_ttl_s` (folio/core/kv_pins.py), so its continuation does not compute them again; the
store's `on_delete` hook ends the pin when the entry goes (deleted, evicted, expired).
"""
from __future__ import annotations

import argparse
import json
import logging
import sqlite3
import time
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from folio.config import CacheConfig

logger = logging.getLogger(__name__)

# Token ids as 32-bit signed integers: every vocabulary fits, at 4 bytes a token.
_TOKEN_TYPECODE = "i"


@dataclass(frozen=True)
class ResponsesConfig:
    """The Responses API's server flags."""

    store_max_entries: int = 1024
    store_ttl_s: float = 86400.0
    store_path: str | None = None
    max_background: int = 64
    # Seconds a stored response's KV blocks stay pinned in the prefix cache after it
    # finishes (0 = not pinned): a continuation within that time computes only its new
    # tokens, whatever other traffic ran meanwhile.
    kv_pin_ttl_s: float = 300.0

    def __post_init__(self) -> None:
        if self.store_max_entries < 1:
            raise ValueError(f"--responses-store-max-entries must be >= 1, got "
                             f"{self.store_max_entries}")
        if self.store_ttl_s <= 0:
            raise ValueError(f"--responses-store-ttl must be > 0, got {self.store_ttl_s}")
        if self.max_background < 1:
            raise ValueError(f"--responses-max-background must be >= 1, got "
                             f"{self.max_background}")
        if not 0 <= self.kv_pin_ttl_s < float("inf"):
            raise ValueError(f"--responses-kv-pin-ttl must be >= 0 seconds, got "
                             f"{self.kv_pin_ttl_s}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ResponsesConfig":
        return cls(store_max_entries=args.responses_store_max_entries,
                   store_ttl_s=args.responses_store_ttl, store_path=args.responses_store_path,
                   max_background=args.responses_max_background,
                   kv_pin_ttl_s=args.responses_kv_pin_ttl)


def add_responses_args(parser: argparse.ArgumentParser) -> None:
    defaults = ResponsesConfig()
    parser.add_argument("--responses-store-max-entries", type=int,
                        default=defaults.store_max_entries,
                        help="most responses /v1/responses keeps for previous_response_id and "
                             "retrieval (store=true); the least recently used goes first")
    parser.add_argument("--responses-store-ttl", type=float, default=defaults.store_ttl_s,
                        help="seconds a stored response is kept after its last use")
    parser.add_argument("--responses-store-path", default=None,
                        help="a SQLite file that keeps stored responses across restarts "
                             "(default: memory only)")
    parser.add_argument("--responses-max-background", type=int,
                        default=defaults.max_background,
                        help="most background responses running at once; more get HTTP 429")
    parser.add_argument("--responses-kv-pin-ttl", type=float, default=defaults.kv_pin_ttl_s,
                        help="seconds a stored response's KV blocks stay pinned in the prefix "
                             "cache, so a previous_response_id continuation reuses them "
                             "whatever other traffic ran meanwhile (pins give way to running "
                             "requests before any preemption); 0 = off")
    parser.add_argument("--responses-kv-pin-max-fraction", type=float,
                        default=CacheConfig.kv_pin_max_fraction,
                        help="the most of the KV cache's blocks those pins may hold (older "
                             "pins go first)")


@dataclass
class StoredResponse:
    id: str
    response: dict[str, Any]  # the response object, final
    # The conversation before the response's output: the continued responses' input and
    # output items, then its own input items.
    input_items: list[dict[str, Any]]
    # The prompt's and the output's token ids (the KV blocks a continuation reuses).
    token_ids: array
    last_used: float = 0.0

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one starts from (instructions are not carried
        over, as OpenAI's are not)."""
        return self.input_items + self.response["output"]


_SCHEMA = ("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, last_used REAL NOT NULL, "
           "response TEXT NOT NULL, input_items TEXT NOT NULL, token_ids BLOB NOT NULL)")


class ResponseStore:
    """LRU + TTL store of StoredResponse; optionally written through to a SQLite file. Used
    from the event loop only (the file's writes run on the store's own thread)."""

    def __init__(self, max_entries: int, ttl_s: float, path: str | None = None, *,
                 clock: Callable[[], float] = time.time,
                 on_delete: Callable[[str], None] | None = None) -> None:
        """`on_delete`: called with the id of each entry that goes (deleted, evicted,
        expired; not one stored again under its own id)."""
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._on_delete = on_delete
        # Wall-clock time: expiry times read back from the file mean the same after a restart.
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # item id -> (the item, how many live entries hold it)
        self._items: dict[str, tuple[dict[str, Any], int]] = {}
        self._db: sqlite3.Connection | None = None
        self._writer: ThreadPoolExecutor | None = None
        if path is not None:
            self._open(path)

    # ---- the file ------------------------------------------------------------------------

    def _open(self, path: str) -> None:
        # Opened here, then used by the writer thread only (one thread: writes stay in order).
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute(_SCHEMA)
            self._db.execute("DELETE FROM responses WHERE last_used < ?",
                             (self._clock() - self.ttl_s,))
            rows = self._db.execute("SELECT id, last_used, response, input_items, token_ids "
                                    "FROM responses ORDER BY last_used DESC").fetchall()
        except sqlite3.Error as exc:
            raise ValueError(f"--responses-store-path {path}: {exc}") from exc
        for row in rows[self.max_entries:]:
            self._db.execute("DELETE FROM responses WHERE id = ?", (row[0],))
        for response_id, last_used, response, items, token_ids in reversed(
                rows[:self.max_entries]):
            ids = array(_TOKEN_TYPECODE)
            ids.frombytes(token_ids)
            self._add(StoredResponse(response_id, json.loads(response), json.loads(items), ids,
                                     last_used))
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="folio-responses")
        logger.info("responses store %s: %d stored responses", path, len(self._entries))

    def _write(self, sql: str, params: tuple[Any, ...] | Callable[[], tuple[Any, ...]]
               ) -> None:
        if self._writer is None:
            return
        db = self._db
        assert db is not None

        def run() -> None:
            try:
                db.execute(sql, params() if callable(params) else params)
            except sqlite3.Error:
                logger.exception("responses store: a write failed")

        self._writer.submit(run)

    def close(self) -> None:
        """Finish the pending writes and close the file."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._db is not None:
            self._db.close()
            self._db = None

    # ---- the map -------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        # Least recently used first, which is also the order they expire in.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.last_used + self.ttl_s > now:
                return
            self.delete(oldest.id)

    def _add(self, entry: StoredResponse) -> None:
        self._remove(entry.id)  # a response stored again replaces itself, items included
        self._entries[entry.id] = entry
        for item in entry.conversation():
            if item.get("id"):
                held = self._items.get(item["id"])
                self._items[item["id"]] = (item, 1 if held is None else held[1] + 1)

    def put(self, entry: StoredResponse) -> None:
        now = self._clock()
        self._expire(now)
        entry.last_used = now
        self._add(entry)
        while len(self._entries) > self.max_entries:
            self.delete(next(iter(self._entries)))
        # Serialized on the writer thread: a long conversation's JSON stays off the loop.
        self._write("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)", lambda: (
            entry.id, now, json.dumps(entry.response, ensure_ascii=False),
            json.dumps(entry.input_items, ensure_ascii=False), entry.token_ids.tobytes()))

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (its use renews its time-to-live), or None: never stored, deleted,
        evicted or expired."""
        now = self._clock()
        self._expire(now)
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        entry.last_used = now
        self._entries.move_to_end(response_id)
        self._write("UPDATE responses SET last_used = ? WHERE id = ?", (now, response_id))
        return entry

    def item(self, item_id: str) -> dict[str, Any] | None:
        """An input or output item of a live entry, by its id."""
        held = self._items.get(item_id)
        return None if held is None else held[0]

    def delete(self, response_id: str) -> bool:
        if not self._remove(response_id):
            return False
        if self._on_delete is not None:
            self._on_delete(response_id)
        return True

    def _remove(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        for item in entry.conversation():
            held = self._items.get(item.get("id") or "")
            if held is not None:
                if held[1] > 1:
                    self._items[item["id"]] = (held[0], held[1] - 1)
                else:
                    del self._items[item["id"]]
        self._write("DELETE FROM responses WHERE id = ?", (response_id,))
        return True

    def __len__(self) -> int:
        return len(self._entries)
