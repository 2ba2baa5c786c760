"""Fast-weight state saved and restored alone, per session, so a deployed model keeps learning.

The *memory state* of a program is its carried fast state (``nested.State.fast``): one
:class:`nested.LevelState` per memory, with a leading batch dim (one stream per row), for the
levels with ``persist="stream"``. Saving it after a session and loading it at the start of
the next one continues every stream exactly where it stopped: the result equals one session
over both streams (``tests/run/test_checkpoint.py`` checks it). The slow parameters are not part
of it; they come from the run's checkpoint.

Stored atomically with :func:`nested.run.checkpoint.save_tree`, with the level names, the
signature (path, shape, dtype of every leaf) and the fingerprint of the model that learned it
(:mod:`nested.run.fingerprint`: its architecture and the step of its slow weights), so loading
it into another model fails clearly, even one of the same shapes (``delta`` and
``gated_delta``), and loading it over other slow weights of that model warns.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from absl import logging

from nested.core.scheduler import level_states
from nested.run import checkpoint
from nested.run import fingerprint as fingerprints


class MemoryStateError(ValueError):
    """A memory state that is missing or does not fit this model; the message says which."""


def _levels(fast) -> list[str]:
    return sorted({state.level for state in level_states(fast)})


def save(path: str | Path, fast, *, fingerprint: Mapping[str, Any] | None = None) -> None:
    """Save the fast state ``fast`` (e.g. ``state.fast``) at ``path``, replacing what is there,
    with ``fingerprint``, that of the model it belongs to (:func:`nested.run.fingerprint.of`;
    the entry points always pass it)."""
    if fast is None:
        raise ValueError(
            "fast is None: no level of this system keeps its state across sequences; "
            "set persist='stream' on a level to carry (and save) its memory"
        )
    meta = {
        "levels": _levels(fast),
        "signature": checkpoint.signature(fast),
        "fingerprint": None if fingerprint is None else dict(fingerprint),
    }
    checkpoint.save_tree(path, fast, meta=meta)


def read_meta(path: str | Path) -> dict:
    """What is saved with the memory state at ``path`` (levels, signature, fingerprint);
    raises :class:`MemoryStateError` when there is none there (cheap: no array is read)."""
    if not Path(path).is_dir():
        raise MemoryStateError(
            f"no memory state at {str(path)!r}; save one first (eval.py --save_memory)"
        )
    try:
        return checkpoint.load_meta(path)
    except Exception as error:  # noqa: BLE001 - unreadable means not a memory state
        raise MemoryStateError(
            f"{str(path)!r} is not a readable memory state ({error!r})"
        ) from error


def load(path: str | Path, *, like, fingerprint: Mapping[str, Any] | None = None):
    """The fast state saved at ``path``, in the structure of ``like`` (e.g. the ``fast`` of a
    freshly initialised state of the same model and batch size).

    ``fingerprint``: that of the model loading it; then a state saved by another architecture
    (or without a fingerprint) is refused and one saved with the slow weights of another step
    loads with a logged warning. Raises :class:`MemoryStateError` naming the path when there
    is no memory state there or it belongs to another model (other levels, shapes, batch size
    or fingerprint).
    """
    if like is None:
        raise ValueError(
            "like is None: this system carries no fast state (no level has persist='stream')"
        )
    meta = read_meta(path)
    what = f"the memory state at {str(path)!r}"
    if fingerprint is not None:
        try:
            warnings = fingerprints.check(meta.get("fingerprint"), fingerprint, what)
        except ValueError as error:
            raise MemoryStateError(str(error)) from error
        for warning in warnings:
            logging.warning("%s", warning)
    if meta.get("levels") != _levels(like):
        raise MemoryStateError(
            f"{what} holds levels {meta.get('levels')}, this model has {_levels(like)}"
        )
    expected = checkpoint.signature(like)
    saved = meta.get("signature") or []
    if saved != expected:
        raise MemoryStateError(
            f"{what} does not fit this model ({checkpoint.mismatch(saved, expected)}); a "
            f"memory state is tied to the model and batch size it was saved with"
        )
    return checkpoint.load_tree(path, like=like)
