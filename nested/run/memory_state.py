"""Fast-weight state saved and restored alone, per session, so a deployed model keeps learning.

The *memory state* of a program is its carried fast state (``nested.State.fast``): one
:class:`nested.LevelState` per memory, with a leading batch dim (one stream per row), for the
levels with ``persist="stream"``. Saving it after a session and loading it at the start of
the next one continues every stream exactly where it stopped: the result equals one session
over both streams (``tests/test_checkpoint.py`` checks it). The slow parameters are not part
of it; they come from the run's checkpoint.

Stored atomically with :func:`nested.run.checkpoint.save_tree`, with the level names and the
signature (path, shape, dtype of every leaf), so loading into another model fails clearly.
"""

from __future__ import annotations

from pathlib import Path

from nested.core.scheduler import level_states
from nested.run import checkpoint


def _levels(fast) -> list[str]:
    return sorted({state.level for state in level_states(fast)})


def save(path: str | Path, fast) -> None:
    """Save the fast state ``fast`` (e.g. ``state.fast``) at ``path``, replacing what is there."""
    if fast is None:
        raise ValueError(
            "fast is None: no level of this system keeps its state across sequences; "
            "set persist='stream' on a level to carry (and save) its memory"
        )
    meta = {"levels": _levels(fast), "signature": checkpoint.signature(fast)}
    checkpoint.save_tree(path, fast, meta=meta)


def load(path: str | Path, *, like):
    """The fast state saved at ``path``, in the structure of ``like`` (e.g. the ``fast`` of a
    freshly initialised state of the same model and batch size).

    Raises ``ValueError`` naming the path when there is no memory state there or it belongs
    to another model (other levels, shapes or batch size).
    """
    path = Path(path)
    if like is None:
        raise ValueError(
            "like is None: this system carries no fast state (no level has persist='stream')"
        )
    if not path.is_dir():
        raise ValueError(f"no memory state at {str(path)!r}")
    try:
        meta = checkpoint.load_meta(path)
    except Exception as error:  # noqa: BLE001 - unreadable means not a memory state
        raise ValueError(f"{str(path)!r} is not a readable memory state ({error!r})") from error
    if meta.get("levels") != _levels(like):
        raise ValueError(
            f"the memory state at {str(path)!r} holds levels {meta.get('levels')}, "
            f"this model has {_levels(like)}"
        )
    expected = checkpoint.signature(like)
    saved = meta.get("signature") or []
    if saved != expected:
        raise ValueError(
            f"the memory state at {str(path)!r} does not fit this model "
            f"({checkpoint.mismatch(saved, expected)}); a memory "
            f"state is tied to the model and batch size it was saved with"
        )
    return checkpoint.load_tree(path, like=like)
