"""One writer at a time: a training run owns its workdir, a companion owns its store.

:class:`Lock` takes an advisory ``fcntl.flock`` on a file (created if missing) and writes the
holder into it: pid, host, start time and command line. The operating system drops the lock
when the holder's process ends, however it ends (SIGKILL included), so a dead holder never
leaves a stale lock: its details stay in the file until the next holder overwrites them. A
holder that releases the lock removes the file, so a finished run leaves nothing behind. A
second holder, in this process or another, gets :class:`Busy`, one line naming the first's pid
and host. ``flock`` is reliable on a local file system; on network file systems (NFS) it may
not exclude processes of other hosts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path


class Busy(RuntimeError):
    """The lock is held by another writer; the message names it and the fix."""


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
    return f"pid {holder['pid']} on host {holder['host']} (since {since}: {holder['command']})"


class Lock:
    """An exclusive lock on ``path`` for ``what`` (words for the message: ``"workdir
    runs/x"``), taken at construction; released by :meth:`release` or when the process ends.
    ``fix`` ends the message of :class:`Busy` (what the second writer should do)."""

    def __init__(self, path: str | Path, what: str, fix: str):
        self.path = Path(path)
        while True:
            self._file = self.path.open("a+")
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self.holder()
                self._file.close()
                raise Busy(f"{what} is in use by {_describe(holder)}; {fix}") from None
            # The previous holder may have removed the file between our open and our lock:
            # then we hold a lock on a file no one else can see; open the path again.
            try:
                same = os.stat(self.path).st_ino == os.fstat(self._file.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            self._file.close()
        self._file.seek(0)
        self._file.truncate()
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "command": " ".join(sys.argv),
        }
        self._file.write(json.dumps(holder) + "\n")
        self._file.flush()

    def holder(self) -> dict | None:
        """The holder written in the file (the last one, if the lock is free), or None."""
        with contextlib.suppress(OSError, ValueError, KeyError):
            holder = json.loads(self.path.read_text())
            return {key: holder[key] for key in ("pid", "host", "since", "command")}
        return None

    def release(self) -> None:
        """Remove the file (a finished holder leaves nothing behind), then unlock."""
        if not self._file.closed:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
