"""Stored responses of the Responses API (`store`, `previous_response_id`, GET and DELETE
/v1/responses/{id}): a bounded store, least recently used first out, in memory by default or in a
SQLite file (`armserve serve --responses-store PATH`) that outlives a restart.

Each entry is a response id -> {"response": the Response object as returned, "messages": the
conversation up to and including its output, as chat messages, without instructions (OpenAI
does not carry instructions over to a continuation)}, kept as JSON text.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections import OrderedDict
from typing import Any

from armserve.config import RESPONSES_STORE_MAX_ENTRIES, RESPONSES_STORE_MAX_MB

logger = logging.getLogger("armserve")


def _limit(name: str, default: int) -> int:
    """A bound from config.py, or its ARMSERVE_ environment variable."""
    value = os.environ.get(f"ARMSERVE_{name}")
    if value is None:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"ARMSERVE_{name} must be a whole number >= 1, got {value!r}")
    return int(value)


class ResponseStore:
    """Response id -> stored entry, at most `max_entries` entries and `max_bytes` bytes of JSON;
    past either bound the least recently stored or read entries are dropped. `path`: a SQLite
    file (created if missing), else memory."""

    def __init__(self, path: str | None = None, max_entries: int | None = None, max_bytes: int | None = None) -> None:
        self.max_entries = max_entries or _limit("RESPONSES_STORE_MAX_ENTRIES", RESPONSES_STORE_MAX_ENTRIES)
        self.max_bytes = max_bytes or _limit("RESPONSES_STORE_MAX_MB", RESPONSES_STORE_MAX_MB) * 1024 * 1024
        self.path = path
        self._lock = threading.Lock()
        self._memory: OrderedDict[str, str] = OrderedDict()
        self._db: sqlite3.Connection | None = None
        self._count = self._bytes = self._tick = 0
        if path is not None:
            self._open(path)

    def _open(self, path: str) -> None:
        try:
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, data TEXT NOT NULL, "
                       "size INTEGER NOT NULL, used INTEGER NOT NULL)")
            db.execute("CREATE INDEX IF NOT EXISTS responses_used ON responses (used)")
            count, size, tick = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(MAX(used), 0) "
                                           "FROM responses").fetchone()
        except sqlite3.Error as e:
            raise ValueError(f"--responses-store {path}: cannot use it as a SQLite responses store: {e}") from None
        self._db, self._count, self._bytes, self._tick = db, count, size, tick
        self._evict()  # the bounds may be smaller than when the file was written
        logger.info("responses store %s: %d stored responses", path, count)

    def __len__(self) -> int:
        return self._count

    def get(self, response_id: str) -> dict[str, Any] | None:
        """The entry stored under `response_id` (now the most recently used), or None."""
        with self._lock:
            if self._db is None:
                data = self._memory.get(response_id)
                if data is not None:
                    self._memory.move_to_end(response_id)
            else:
                row = self._db.execute("SELECT data FROM responses WHERE id = ?", (response_id,)).fetchone()
                data = row[0] if row else None
                if data is not None:
                    self._tick += 1
                    self._db.execute("UPDATE responses SET used = ? WHERE id = ?", (self._tick, response_id))
        return json.loads(data) if data is not None else None

    def put(self, response_id: str, entry: dict[str, Any]) -> bool:
        """Store `entry`, dropping the least recently used past the bounds; False (nothing stored)
        when the entry alone is larger than max_bytes."""
        data = json.dumps(entry, separators=(",", ":"))  # ASCII: a lone surrogate in a field cannot fail it
        size = len(data.encode())
        if size > self.max_bytes:
            logger.warning("response %s not stored: %d bytes, more than the store's %d", response_id, size,
                           self.max_bytes)
            return False
        with self._lock:
            self._remove(response_id)
            if self._db is None:
                self._memory[response_id] = data
            else:
                self._tick += 1
                self._db.execute("INSERT INTO responses (id, data, size, used) VALUES (?, ?, ?, ?)",
                                 (response_id, data, size, self._tick))
            self._count += 1
            self._bytes += size
            self._evict()
        return True

    def delete(self, response_id: str) -> bool:
        """Remove an entry; False if there was none."""
        with self._lock:
            return self._remove(response_id)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _remove(self, response_id: str) -> bool:
        if self._db is None:
            data = self._memory.pop(response_id, None)
            size = len(data.encode()) if data is not None else None
        else:
            row = self._db.execute("DELETE FROM responses WHERE id = ? RETURNING size", (response_id,)).fetchone()
            size = row[0] if row else None
        if size is None:
            return False
        self._count -= 1
        self._bytes -= size
        return True

    def _evict(self) -> None:
        while self._count > self.max_entries or self._bytes > self.max_bytes:
            if self._db is None:
                oldest = next(iter(self._memory))
            else:
                oldest = self._db.execute("SELECT id FROM responses ORDER BY used LIMIT 1").fetchone()[0]
            self._remove(oldest)
