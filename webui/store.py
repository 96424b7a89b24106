"""Jobs and their runs in SQLite (standard library); every change is one transaction."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from typing import Any, Optional

ACTIVE = ("queued", "running")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    template TEXT NOT NULL,
    family TEXT NOT NULL,
    mode TEXT NOT NULL,
    launcher TEXT NOT NULL DEFAULT 'python',
    status TEXT NOT NULL DEFAULT 'draft',
    pid INTEGER,
    pid_start TEXT,
    exit_code INTEGER,
    stop_requested INTEGER NOT NULL DEFAULT 0,
    retries INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS revisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    created REAL NOT NULL,
    settings TEXT NOT NULL,
    changes TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    command TEXT NOT NULL,
    started REAL NOT NULL,
    ended REAL,
    status TEXT,
    exit_code INTEGER
);
"""

JOB_FIELDS = ("name", "template", "family", "mode", "launcher", "status", "pid", "pid_start", "exit_code",
              "stop_requested", "retries")


class Store:
    def __init__(self, path: str):
        self.path = path
        self._lock = threading.RLock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(sql, args)
                self._db.execute("COMMIT")
                return cur
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _query(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._db.execute(sql, args).fetchall()]

    def create_job(self, name: str, template: str, family: str, mode: str, launcher: str) -> int:
        now = time.time()
        cur = self._tx("INSERT INTO jobs (name, template, family, mode, launcher, created, updated) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)", (name, template, family, mode, launcher, now, now))
        return int(cur.lastrowid)

    def jobs(self) -> list[dict[str, Any]]:
        return self._query("SELECT * FROM jobs ORDER BY id")

    def job(self, job_id: int) -> Optional[dict[str, Any]]:
        rows = self._query("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return rows[0] if rows else None

    def update_job(self, job_id: int, **values: Any) -> None:
        unknown = set(values) - set(JOB_FIELDS)
        if unknown:
            raise KeyError(f"unknown job fields {sorted(unknown)}")
        sets = ", ".join(f"{k} = ?" for k in values)
        self._tx(f"UPDATE jobs SET {sets}, updated = ? WHERE id = ?", (*values.values(), time.time(), job_id))

    def delete_job(self, job_id: int) -> None:
        with self._lock:
            self._tx("DELETE FROM runs WHERE job_id = ?", (job_id,))
            self._tx("DELETE FROM revisions WHERE job_id = ?", (job_id,))
            self._tx("DELETE FROM jobs WHERE id = ?", (job_id,))

    def add_run(self, job_id: int, command: str) -> int:
        return int(self._tx("INSERT INTO runs (job_id, command, started) VALUES (?, ?, ?)",
                            (job_id, command, time.time())).lastrowid)

    def end_run(self, job_id: int, status: str, exit_code: Optional[int]) -> None:
        self._tx("UPDATE runs SET ended = ?, status = ?, exit_code = ? WHERE job_id = ? AND ended IS NULL",
                 (time.time(), status, exit_code, job_id))

    def runs(self, job_id: int) -> list[dict[str, Any]]:
        return self._query("SELECT * FROM runs WHERE job_id = ? ORDER BY id", (job_id,))

    # --- settings history: one row per save, with what changed ---------------------------------------
    def add_revision(self, job_id: int, settings: dict[str, Any], changes: str) -> int:
        return int(self._tx("INSERT INTO revisions (job_id, created, settings, changes) VALUES (?, ?, ?, ?)",
                            (job_id, time.time(), json.dumps(settings, sort_keys=True), changes)).lastrowid)

    def revisions(self, job_id: int) -> list[dict[str, Any]]:
        """Newest first, without the settings themselves."""
        return self._query("SELECT id, job_id, created, changes FROM revisions WHERE job_id = ? ORDER BY id DESC",
                           (job_id,))

    def revision(self, job_id: int, revision_id: int) -> Optional[dict[str, Any]]:
        rows = self._query("SELECT * FROM revisions WHERE job_id = ? AND id = ?", (job_id, revision_id))
        if not rows:
            return None
        return {**rows[0], "settings": json.loads(rows[0]["settings"])}

    def last_revision(self, job_id: int) -> Optional[dict[str, Any]]:
        rows = self._query("SELECT id FROM revisions WHERE job_id = ? ORDER BY id DESC LIMIT 1", (job_id,))
        return self.revision(job_id, rows[0]["id"]) if rows else None
