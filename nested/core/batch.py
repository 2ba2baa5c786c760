"""The batch a program takes, and its checks: raised before compilation, naming the field.

A :class:`Batch` (or a mapping of its arrays) holds ``inputs`` and ``targets`` (B, T) token
ids, a ``mask`` (B, T) and named extras; :func:`check_arrays` refuses what the model would
misread silently (the embedding gather clamps ids). The scheduler (:mod:`nested.core.scheduler`)
owns these; the data tasks (:mod:`nested.data`) produce batches of this shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np


class Batch(NamedTuple):
    """One batch of sequences.

    Attributes:
      inputs: (B, T) int32 token ids fed to the model.
      targets: (B, T) int32 token to predict at each input position; 0 where ``mask`` is 0
        (never negative, so a gather-based cross-entropy stays in range).
      mask: (B, T) float32, 1 where the position counts toward loss and accuracy.
      extras: task-specific numpy arrays with a leading batch axis (documented by each task),
        e.g. per-row setting ids for MQAR mixtures or the needle depth for NIAH.
    """

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    extras: Mapping[str, np.ndarray]


def as_arrays(batch: Batch | Mapping[str, Any], *, extras: Sequence[str] = ()) -> dict[str, Any]:
    """The arrays a program's steps take (``nested.Program.train_step``, ``eval_step``,
    ``loss``): ``inputs``, ``targets`` and ``mask`` of a :class:`Batch` and those of its
    ``extras`` named in ``extras`` that it has (the masks of sub-metrics), or a mapping's
    entries as they are."""
    if isinstance(batch, Batch):
        out = {"inputs": batch.inputs, "targets": batch.targets, "mask": batch.mask}
        return {**out, **{name: batch.extras[name] for name in extras if name in batch.extras}}
    if isinstance(batch, Mapping):
        return dict(batch)
    raise ValueError(
        f"batch is a {type(batch).__name__}; pass a nested.data.Batch or a mapping of "
        f"'inputs' and 'targets' (B, T) token ids and optionally 'mask' (B, T)"
    )


def check_tokens(x: Any, vocab: int, name: str, *, source: str, fix: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``x`` is ``(B, T)`` integer token ids in
    ``[0, vocab)``; the ids are checked where their values are known (not on a tracer, inside
    ``jax.jit``), shape and dtype always. ``source`` says where ``vocab`` comes from, ``fix``
    what to do (both end the message)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise ValueError(f"{name} is a {type(x).__name__}; pass an array (B, T) of token ids")
    if len(x.shape) != 2:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; token ids come as (B, T)")
    if not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got {x.dtype}")
    if isinstance(x, jax.core.Tracer) or not x.size:
        return
    x = np.asarray(x)
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"{name} holds token ids in [{low}, {high}], outside [0, {vocab}) ({source}); {fix}"
        )


def check_arrays(
    arrays: Mapping[str, Any], vocab: int, where: str, *, source: str, fix: str, grid: int = 1
):
    """Refuse a batch the model would misread silently (the embedding gather clamps ids):
    ``inputs`` and ``targets`` missing, arrays of different shapes, token ids that are not
    integers in ``[0, vocab)`` (:func:`check_tokens`), documents starting off the declared
    ``grid`` (:func:`check_document_grid`). ``where`` names the batch."""
    for key in ("inputs", "targets"):
        if key not in arrays:
            raise ValueError(
                f"{where} has no {key!r}; a batch holds 'inputs' and 'targets' (B, T) token "
                f"ids and optionally 'mask' (B, T), got {sorted(arrays)}"
            )
    shape = tuple(np.shape(arrays["inputs"]))
    for key, x in arrays.items():
        if tuple(np.shape(x)) != shape:
            raise ValueError(
                f"{where}: {key} has shape {tuple(np.shape(x))}, inputs {shape}; they must match"
            )
    for key in ("inputs", "targets"):
        check_tokens(arrays[key], vocab, f"{where}: {key}", source=source, fix=fix)
    if "documents" in arrays:
        check_documents(arrays["documents"], shape, where)
        check_document_grid(arrays["documents"], grid, where)


def check_documents(documents: Any, shape: tuple, where: str) -> None:
    """Raise ``ValueError`` unless ``documents`` is an integer array of ``shape`` (B, T):
    document ids of packed rows, a new document where the id changes."""
    dtype = getattr(documents, "dtype", None)
    if tuple(np.shape(documents)) != tuple(shape) or not np.issubdtype(dtype, np.integer):
        raise ValueError(
            f"{where}: documents must be integer document ids of shape {tuple(shape)} like the "
            f"inputs, got {dtype or type(documents).__name__} {tuple(np.shape(documents))}"
        )


def off_grid(documents: Any, grid: int) -> tuple[int, int] | None:
    """``(row, position)`` of the first document of ``documents (B, T)`` (ids known, not a
    tracer) that starts off a multiple of ``grid`` positions of its row; None if none does."""
    ids = np.asarray(documents)
    rows, before = np.nonzero(ids[:, 1:] != ids[:, :-1])
    off = (before + 1) % grid != 0
    return (int(rows[off][0]), int(before[off][0]) + 1) if off.any() else None


def check_document_grid(documents: Any, grid: int, where: str) -> None:
    """Raise ``ValueError`` unless every document of ``documents (B, T)`` after a row's first
    starts at a multiple of ``grid`` positions of the row, as the program was declared to take
    them (``nested.compile(..., document_grid=grid)``: its ops then restart only at chunk
    starts, ``nested.ops.documents.on_grid``). Checked where the ids are known, not on a
    tracer inside ``jax.jit``."""
    if grid == 1 or isinstance(documents, jax.core.Tracer):
        return
    found = off_grid(documents, grid)
    if found is not None:
        raise ValueError(
            f"{where}: a document starts at position {found[1]} of row {found[0]}, off the "
            f"program's document_grid={grid} (a multiple of {grid} positions, the task's align); "
            f"lay rows out with nested.data.tokens.align_documents(..., {grid}) or compile the "
            f"program with document_grid=1"
        )
