"""Where the companion keeps each agent's fast state: a small interface and its SQLite backend.

A store maps agent ids to :class:`Record` s: the serialized fast state (bytes), its SHA-256
digest, the fingerprint of the model that wrote it and the number of tokens the agent has
observed. :meth:`Store.put_many` writes a batch of agents in one transaction (all of them or
none), so an acknowledged observe is on disk and none is half-applied. Reading a record whose
bytes no longer match their digest raises :class:`DamagedState` for that agent only.

:class:`SQLiteStore` uses the standard library's ``sqlite3``: WAL journal, ``synchronous=FULL``
(a commit survives the process being killed, and power loss), one connection per thread. Agent
ids are only ever bound as SQL parameters, never formatted into a statement or a path.

One writer per store: the companion reads an agent's state, runs the model and writes the new
state back, so two processes serving one file would each overwrite the other's acknowledged
observes. A :class:`SQLiteStore` therefore holds the lock ``<file>.lock``
(:class:`nested.run.locks.Lock`) from its opening to :meth:`SQLiteStore.close` or the end of
its process; a second one on the same file, in any process, raises
:class:`nested.run.locks.Busy` naming the holder. Within the holder, requests are serialised by
the engine's batcher (:mod:`nested.companion.server`).
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple, Protocol

from nested.run.locks import Lock


class DamagedState(RuntimeError):
    """A stored state whose bytes do not match their digest; the message names the agent."""


class Record(NamedTuple):
    """One agent's stored state: ``state`` bytes, the model ``fingerprint`` (a string) that
    wrote them, and the ``tokens`` the agent has observed."""

    state: bytes
    fingerprint: str
    tokens: int


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Store(Protocol):
    """What the companion needs of a backend."""

    def get_many(self, ids: Iterable[str]) -> dict[str, Record | DamagedState]:
        """The records of the ids that exist (a damaged one as its error)."""

    def put_many(self, records: Mapping[str, Record]) -> None:
        """Write every record in one transaction."""

    def delete(self, agent_id: str) -> bool:
        """Remove an agent; whether it existed."""

    def count(self) -> int:
        """Agents stored."""

    def writers(self) -> dict[str, int]:
        """Agents stored per fingerprint of the model that wrote them."""


class SQLiteStore:
    """:class:`Store` in a SQLite database file at ``path`` (created if missing)."""

    SCHEMA = (
        "CREATE TABLE IF NOT EXISTS agents (id TEXT PRIMARY KEY, state BLOB NOT NULL, "
        "digest TEXT NOT NULL, fingerprint TEXT NOT NULL, tokens INTEGER NOT NULL, "
        "updated REAL NOT NULL)"
    )

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = Lock(
            self.path.with_name(self.path.name + ".lock"),
            f"companion store {self.path}",
            "one process writes a store: send requests to that server (nested.companion.client), "
            "stop it first, or pass another --store",
        )
        self._local = threading.local()
        with self._connection() as db:
            db.execute(self.SCHEMA)

    def _connection(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            self._local.db = db
        return db

    def get_many(self, ids: Iterable[str]) -> dict[str, Record | DamagedState]:
        ids = list(dict.fromkeys(ids))
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self._connection().execute(
            f"SELECT id, state, digest, fingerprint, tokens FROM agents WHERE id IN ({marks})",
            ids,
        )
        out: dict[str, Record | DamagedState] = {}
        for agent_id, state, stored, fingerprint, tokens in rows:
            if not isinstance(state, bytes) or digest(state) != stored:
                out[agent_id] = DamagedState(
                    f"agent {agent_id!r}: its stored state is damaged (its bytes do not match "
                    f"their digest); forget the agent or import a state exported before"
                )
            else:
                out[agent_id] = Record(state, fingerprint, int(tokens))
        return out

    def put_many(self, records: Mapping[str, Record]) -> None:
        db, now = self._connection(), time.time()
        rows = [
            (agent_id, r.state, digest(r.state), r.fingerprint, r.tokens, now)
            for agent_id, r in records.items()
        ]
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(
                "INSERT INTO agents (id, state, digest, fingerprint, tokens, updated) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET state=excluded.state, "
                "digest=excluded.digest, fingerprint=excluded.fingerprint, "
                "tokens=excluded.tokens, updated=excluded.updated",
                rows,
            )
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def delete(self, agent_id: str) -> bool:
        cursor = self._connection().execute("DELETE FROM agents WHERE id = ?", (agent_id,))
        return cursor.rowcount > 0

    def count(self) -> int:
        return self._connection().execute("SELECT COUNT(*) FROM agents").fetchone()[0]

    def writers(self) -> dict[str, int]:
        rows = self._connection().execute(
            "SELECT fingerprint, COUNT(*) FROM agents GROUP BY fingerprint"
        )
        return {fingerprint: int(n) for fingerprint, n in rows}

    def close(self) -> None:
        """Close this thread's connection and release the store for another writer."""
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None
        self._lock.release()
