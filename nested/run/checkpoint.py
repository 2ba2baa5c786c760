"""Checkpoints with orbax, wrapped: the only module of ``nested`` that imports orbax.

:class:`Checkpointer` keeps the checkpoints of a training run in ``<directory>/<step>/``: the
whole :class:`nested.State` (slow parameters, optimizer state, carried fast states, step, RNG)
as the item ``state``, and JSON ``meta`` holding the data position (the index of the next
training batch), the signature of the state (path, shape and dtype of every leaf), its
fingerprint (below) and what else the caller saves with it (``extra``: the training loop's
unfinished log window).

* **Periodic, kept K**: ``save`` writes at multiples of ``every`` (or when forced) and keeps
  the ``keep`` latest, and every step *pinned* in ``<directory>/pins/*.json`` (:func:`pin`:
  a companion store pins the steps its agents were written by, so that more training does
  not delete the weights that serve them; read at every deletion, so a running training
  sees a pin made since it started).
* **Async**: ``save`` returns once the arrays are copied; files are written in a background
  thread; ``close`` waits for them.
* **Atomic**: orbax writes a step into a temporary folder and renames it when complete, so a
  killed save never looks like a checkpoint (its leftovers are removed on the next start).
* **Damaged checkpoints**: :meth:`Checkpointer.restore_latest` tries the newest step first; a
  step whose files cannot be read (an empty or truncated folder) is reported in one log line,
  renamed ``<step>.damaged`` (kept for inspection, never listed or overwritten again) and the
  previous step is tried. A readable checkpoint of a *different* model (another config) is
  not damage: it raises :class:`CheckpointError`.
* **Verified**: the meta holds one integer per leaf, the sum of the leaf's bit patterns
  weighted by position modulo 2**32 (:func:`fingerprint`: integer arithmetic, so the same on
  any number of devices); a restored state whose fingerprint differs (files that read without
  error but hold other values: zero-filled chunks, mixed-up folders) is damage too. So a
  checkpoint is either restored bit for bit or not used.
* **Any mesh**: arrays are restored with the shardings of ``like`` (the caller's freshly
  initialised state, placed on its mesh), whatever mesh they were saved from: a checkpoint
  saved on 8 devices restores on 1 and the other way round.

:func:`save_tree` / :func:`load_tree` store one pytree atomically (used by
:mod:`nested.run.memory_state`). Typed PRNG keys are stored as their key data and re-wrapped.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging as pylogging
import os
import shutil
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging

from nested import files
from nested.run import distributed

_policies = ocp.checkpoint_managers
_ORBAX_METADATA = "_CHECKPOINT_METADATA"  # written into every complete step folder


def _quiet_orbax(record) -> bool:
    """Drop orbax's INFO chatter (dozens of lines per save); keep its warnings."""
    return record.levelno >= pylogging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


logging.get_absl_handler().addFilter(_quiet_orbax)


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be used here; the message says why and what to do."""


class Restored(NamedTuple):
    """A restored checkpoint: its step, the state, the index of the next batch, and the
    ``extra`` saved with it."""

    step: int
    state: Any
    data_position: int
    extra: dict = {}


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _storable(tree):
    """``tree`` with typed PRNG keys replaced by their raw key data (orbax stores arrays)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _unstorable(tree, like):
    """Inverse of :func:`_storable`, taking the key implementation from ``like``."""
    return jax.tree.map(
        lambda x, ref: (
            jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref)) if _is_key(ref) else x
        ),
        tree,
        like,
    )


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, _storable(tree))


def _bits_sum(x: jax.Array) -> jax.Array:
    """``sum_i bits(x_i) * (2 i + 1) mod 2**32`` over the flattened ``x``."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    if bits.dtype.itemsize == 8:  # fold 64-bit patterns into 32 bits
        bits = (bits ^ (bits >> 32)).astype(jnp.uint32)
    weights = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * 2 + 1
    return jnp.sum(bits.astype(jnp.uint32) * weights, dtype=jnp.uint32)


_fingerprints = jax.jit(lambda leaves: [_bits_sum(x) for x in leaves])


def fingerprint(tree) -> list[int]:
    """One integer per leaf of ``tree`` that any change of a stored bit changes (almost
    surely); exact, so independent of the devices the arrays are spread over."""
    leaves = jax.tree.leaves(_storable(tree))
    return [int(v) for v in jax.device_get(_fingerprints(leaves))]


def signature(tree) -> list[str]:
    """One line per leaf, ``"<path> <shape> <dtype>"``: what a checkpoint must match."""
    leaves = jax.tree_util.tree_flatten_with_path(_abstract(tree))[0]
    return [f"{jax.tree_util.keystr(p)} {tuple(x.shape)} {x.dtype}" for p, x in leaves]


def mismatch(saved: list[str], expected: list[str]) -> str:
    """The first difference between two :func:`signature` lists, in words."""
    for a, b in zip(saved, expected, strict=False):
        if a != b:
            return f"saved {a!r}, expected {b!r}"
    return f"saved {len(saved)} arrays, expected {len(expected)}"


def _one_line(error: BaseException, limit: int = 160) -> str:
    text = " ".join(str(error).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


def _abandoned_read(error: BaseException) -> bool:
    """Whether ``error`` is what tensorstore's callback meets when it completes a failed
    read's future: the loop already closed (observed), or the future already cancelled
    (inferred from one unexplained CI traceback, not observed here)."""
    closed = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
    return closed or isinstance(error, asyncio.InvalidStateError)


def _quiet_closed_loops() -> None:
    """From the first restore on, drop the errors that tensorstore's callbacks raise into the
    loop of a failed read (:func:`_abandoned_read`), whenever they come (reported as
    unraisable, from C++: dozens of tracebacks per damaged step); every other unraisable
    error goes to the hook as before."""
    hook = sys.unraisablehook
    if getattr(hook, "nested_quiet_closed_loops", False):
        return

    def quiet(unraisable):
        if not _abandoned_read(unraisable.exc_value):
            hook(unraisable)

    quiet.nested_quiet_closed_loops = True
    sys.unraisablehook = quiet


def _collect_abandoned_reads() -> None:
    """A restore (a failed one always, a successful one sometimes) leaves orbax's pending
    array reads to die at garbage collection, each printing an "Exception ignored" traceback;
    collect them now, quietly (a failure itself is reported in one line)."""
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


PINS = "pins"


def pin(directory: str | Path, name: str, steps) -> None:
    """Keep ``steps`` of the checkpoints in ``directory`` from rotation, on behalf of ``name``
    (one file per name, replaced atomically; no steps: the pin is removed)."""
    folder = Path(directory) / PINS
    path = folder / f"{name}.json"
    if not steps:
        path.unlink(missing_ok=True)
        return
    folder.mkdir(parents=True, exist_ok=True)
    files.write_atomic(path, json.dumps({"steps": sorted(int(s) for s in steps)}))


def pinned(directory: str | Path) -> set[int]:
    """Every step pinned in ``directory`` (:func:`pin`); unreadable pin files count as none."""
    steps: set[int] = set()
    for path in sorted((Path(directory) / PINS).glob("*.json")):
        try:
            steps.update(int(s) for s in json.loads(path.read_text())["steps"])
        except (OSError, ValueError, KeyError, TypeError):
            logging.warning("checkpoint pin %s is unreadable; ignored", path)
    return steps


class _Pinned(_policies.PreservationPolicy):
    """Orbax preservation: keep the steps :func:`pinned` in ``directory`` (read each time)."""

    def __init__(self, directory: Path):
        self.directory = directory

    def should_preserve(self, checkpoints, *, context):
        steps = pinned(self.directory)
        return [info.step in steps for info in checkpoints]


class Checkpointer:
    """Periodic, async, atomic checkpoints of a run in ``directory`` (see the module doc).

    Use as a context manager, or call :meth:`close` (it waits for pending writes).
    """

    def __init__(self, directory: str | Path, *, every: int, keep: int, async_save: bool = True):
        self.directory = Path(directory).absolute()
        # Before orbax lists them: incomplete step folders (every process lists the same).
        distributed.barrier("nested: listing checkpoints")
        folders = sorted(self.directory.iterdir()) if self.directory.is_dir() else []
        incomplete = [
            int(folder.name)
            for folder in folders
            if folder.name.isdigit() and not (folder / _ORBAX_METADATA).exists()
        ]
        distributed.barrier("nested: checkpoints listed")
        for step in incomplete:
            self._set_aside(step, f"no {_ORBAX_METADATA}: empty or incomplete")
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=_policies.FixedIntervalPolicy(every),
            preservation_policy=_policies.AnyPreservationPolicy(
                [_policies.LatestN(keep), _Pinned(self.directory)]
            ),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """Steps of the checkpoints on disk, oldest first."""
        return list(self._manager.all_steps())

    def save(
        self,
        step: int,
        state,
        *,
        data_position: int,
        force: bool = False,
        extra: dict | None = None,
    ) -> bool:
        """Save ``state`` at ``step`` if ``step`` is a multiple of ``every`` (or ``force``)
        and not saved yet, with the JSON-able ``extra``; returns whether a save started."""
        if step in self._manager.all_steps() or not (force or self._manager.should_save(int(step))):
            return False
        meta = {
            "step": int(step),
            "data_position": int(data_position),
            "signature": signature(state),
            "fingerprint": fingerprint(state),
            # The write is async: snapshot `extra` now, as the caller goes on mutating it.
            "extra": json.loads(json.dumps(extra or {})),
        }
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_storable(state)), meta=ocp.args.JsonSave(meta)
        )
        return self._manager.save(int(step), args=args, force=force)

    def restore_latest(self, like, step: int | None = None) -> Restored | None:
        """The newest readable checkpoint, restored into the structure of ``like`` (e.g. a
        freshly initialised state), or None if there is none. Damaged steps are reported,
        set aside and skipped; a checkpoint of another model raises :class:`CheckpointError`.
        ``step``: that checkpoint only (a :class:`CheckpointError` naming the steps there if
        it is absent; None if it is damaged).
        """
        expected = signature(like)
        steps = sorted(self._manager.all_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                raise CheckpointError(
                    f"no checkpoint of step {step} in {self.directory}; steps there: "
                    f"{sorted(steps)}"
                )
            steps = [step]
        for found in steps:
            meta = self._attempt(found, meta=ocp.args.JsonRestore())
            if meta is None:
                continue
            meta = meta.meta
            if meta.get("signature") != expected:
                raise CheckpointError(
                    f"checkpoint step {found} in {self.directory} is of another model "
                    f"({mismatch(meta.get('signature') or [], expected)}); use a new workdir "
                    f"or the config it was trained with"
                )
            restored = self._attempt(found, state=ocp.args.StandardRestore(_abstract(like)))
            if restored is None:
                continue
            _collect_abandoned_reads()  # a read can outlive even a successful restore
            state = _unstorable(restored.state, like)
            saved = meta.get("fingerprint")
            if saved is not None and saved != (now := fingerprint(state)):
                leaf = next(i for i, (a, b) in enumerate(zip(saved, now, strict=True)) if a != b)
                self._set_aside(found, f"its arrays differ from the saved ones: {expected[leaf]}")
                continue
            return Restored(int(found), state, int(meta["data_position"]), meta.get("extra", {}))
        return None

    def _attempt(self, step: int, **items):
        """Restore ``items`` of ``step``; None (and the step set aside) if it is unreadable."""
        _quiet_closed_loops()
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as error:  # noqa: BLE001 - any unreadable step is damage
            reason = _one_line(error)
        _collect_abandoned_reads()
        self._set_aside(step, reason)
        return None

    def _set_aside(self, step: int, reason: str) -> None:
        """Rename a damaged step ``<step>.damaged`` (process 0 renames, every process waits
        for it: each found the same damage, reading the same files)."""
        folder = self.directory / str(step)
        aside = folder.with_name(f"{step}.damaged")
        if distributed.is_primary():
            if aside.exists():
                shutil.rmtree(aside)
            folder.rename(aside)
        distributed.barrier(f"nested: checkpoint {step} set aside")
        if hasattr(self, "_manager"):
            self._manager.reload()
        logging.warning(
            "checkpoint step %d is damaged (%s); moved to %s, using the previous one",
            step,
            reason,
            aside,
        )

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_tree(path: str | Path, tree, *, meta: dict | None = None) -> None:
    """Save one pytree (and JSON ``meta``) at ``path``, atomically, replacing what is there.

    The new tree is written beside ``path`` first and swapped in, so a crash leaves either
    the old or the new one readable.
    """
    path = Path(path).absolute()
    fresh = path.with_name(path.name + ".new")
    if fresh.exists():
        shutil.rmtree(fresh)
    args = ocp.args.Composite(
        tree=ocp.args.StandardSave(_storable(tree)), meta=ocp.args.JsonSave(meta or {})
    )
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(fresh, args=args)
    if path.exists():
        old = path.with_name(path.name + ".old")
        path.rename(old)
        fresh.rename(path)
        shutil.rmtree(old)
    else:
        fresh.rename(path)


def load_meta(path: str | Path) -> dict:
    """The JSON ``meta`` saved with a tree by :func:`save_tree`."""
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        return checkpointer.restore(
            Path(path).absolute(), args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        ).meta


def load_tree(path: str | Path, *, like):
    """The pytree saved at ``path`` by :func:`save_tree`, in the structure of ``like``."""
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        restored = checkpointer.restore(
            Path(path).absolute(),
            args=ocp.args.Composite(tree=ocp.args.StandardRestore(_abstract(like))),
        )
    return _unstorable(restored.tree, like)
