"""Files replaced whole: every writer of nested that must never leave half a file.

``write_atomic(path, data)`` writes to ``<path>.tmp`` in the same folder, flushes it to disk,
then renames it over ``path`` (``os.replace``, atomic on one filesystem): a reader or a
killed run sees the old file or the new one, never part of either.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Replace ``path`` by ``data`` (text as UTF-8, or bytes) in one rename; returns ``path``."""
    path = Path(path)
    fresh = path.with_name(path.name + ".tmp")
    with open(fresh, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(fresh, path)
    return path
