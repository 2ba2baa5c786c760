"""Where the companion keeps each agent's fast state: a small interface and its SQLite backend.

A store maps agent ids to :class:`Record` s: the serialized fast state (bytes), the
fingerprint of the model that wrote it and the number of tokens the agent has observed, with
one SHA-256 digest over all three (:func:`row_digest`). :meth:`Store.put_many` writes a batch
of agents in one transaction (all of them or none), so an acknowledged observe is on disk and
none is half-applied. Reading a record whose columns no longer match their digest (any of them
edited or damaged) gives :class:`DamagedState` for that agent only.

Rows written before the digest covered every column (their ``digest`` the bare SHA-256 of the
state bytes) are upgraded when a :class:`SQLiteStore` opens the file: a row whose state still
matches its old digest gets the new digest, in one transaction; one that does not is left as
it is, and so refused as damaged. After the upgrade only the new digest is accepted, so an
edit of any column made later is caught.

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
import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple, Protocol

from nested.run.locks import Lock


class DamagedState(RuntimeError):
    """A stored row that does not match its digest; the message names the agent."""


class Record(NamedTuple):
    """One agent's stored state: ``state`` bytes, the model ``fingerprint`` (a string) that
    wrote them, and the ``tokens`` the agent has observed."""

    state: bytes
    fingerprint: str
    tokens: int


DIGEST = "sha256-row:"  # how a digest over the whole row begins (a state-only one is bare hex)


def row_digest(state: bytes, fingerprint: str, tokens: int) -> str:
    """The digest of a row's served columns: its fingerprint and tokens (as JSON: unambiguous)
    and its state bytes."""
    head = json.dumps([fingerprint, tokens]).encode() + b"\n"
    return DIGEST + hashlib.sha256(head + state).hexdigest()


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
        db = self._connection()
        db.execute(self.SCHEMA)
        self._upgrade(db)

    def _upgrade(self, db: sqlite3.Connection) -> None:
        """Give rows with a state-only digest that still matches the digest of the whole row
        (module docstring)."""
        old = db.execute(
            "SELECT id, state, digest, fingerprint, tokens FROM agents WHERE digest NOT LIKE ?",
            (DIGEST + "%",),
        ).fetchall()
        rows = [
            (row_digest(state, fingerprint, tokens), agent_id)
            for agent_id, state, stored, fingerprint, tokens in old
            if _columns_ok(state, fingerprint, tokens)
            and hashlib.sha256(state).hexdigest() == stored
        ]
        if rows:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany("UPDATE agents SET digest = ? WHERE id = ?", rows)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

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
            if _columns_ok(state, fingerprint, tokens) and stored == row_digest(
                state, fingerprint, tokens
            ):
                out[agent_id] = Record(state, fingerprint, tokens)
            else:
                out[agent_id] = DamagedState(
                    f"agent {agent_id!r}: its stored state is damaged (its row does not match "
                    f"its digest); forget the agent or import a state exported before"
                )
        return out

    def put_many(self, records: Mapping[str, Record]) -> None:
        db, now = self._connection(), time.time()
        rows = [
            (agent_id, r.state, row_digest(*r), r.fingerprint, r.tokens, now)
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


def _columns_ok(state, fingerprint, tokens) -> bool:
    """Whether a row's columns have the types a :class:`Record` has (an edit may change them)."""
    return isinstance(state, bytes) and isinstance(fingerprint, str) and type(tokens) is int
