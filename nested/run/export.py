"""A trained model in one portable file: ``export_model`` writes it, ``import_model`` reads it
back and refuses another model's.

The file is flax msgpack (``flax.serialization``, no dependency beyond flax) of one dict:

    {"format": "nested.export", "version": 1,
     "fingerprint": {"architecture": "<16 hex digits>", "step": <int>},
     "config": "<the run's config, JSON>",
     "params": {"blocks/0/mixer/qkv/kernel": <array>, ...},
     "fast": {"0/mixer/params/0/w": <array>, ...}}

``params`` are the slow parameters, ``fast`` (only when exported) a memory session: a carried
fast state, leading batch dim. Arrays are numpy arrays named by their path in the pytree, so
any msgpack reader gets them (``flax.serialization.msgpack_restore``); the optimizer state is
not exported. ``fingerprint`` is :func:`nested.run.fingerprint.of` the config and the step of
the slow weights: importing into a model of another architecture is refused
(:func:`nested.run.fingerprint.check`), and every array must have the path, shape and dtype
the model expects.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, serialization
from ml_collections import config_dict

from nested import files
from nested.run import config as config_lib
from nested.run import fingerprint
from nested.run.loading import Trained

FORMAT, VERSION = "nested.export", 1


class ExportError(ValueError):
    """A file that is not an exported model of this model; the message says why."""


def _named(tree) -> tuple[list[str], list]:
    """The leaves of ``tree`` and their paths, ``"a/0/b"``."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    names = [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in leaves]
    return names, [x for _, x in leaves]


def _flat(tree) -> dict[str, np.ndarray]:
    """``{"a/0/b": array}``: the leaves of ``tree`` by their paths."""
    return dict(zip(*_named(jax.device_get(tree)), strict=True))


def _unflat(arrays: dict[str, np.ndarray], like, what: str):
    """The tree of ``like`` with the ``arrays`` of :func:`_flat`, which must match it."""
    names, leaves = _named(like)
    unknown = sorted(set(arrays) - set(names))
    if unknown:
        raise ExportError(f"{what} holds {unknown[0]!r}, which this model does not have")
    for name, ref in zip(names, leaves, strict=True):
        x = arrays.get(name)
        if x is None or (x.shape, x.dtype) != (ref.shape, ref.dtype):
            got = "missing" if x is None else f"{x.shape} {x.dtype}"
            raise ExportError(
                f"{what} does not fit this model: {name!r} is {got}, the model needs "
                f"{ref.shape} {ref.dtype}; import it into the model that wrote it"
            )
    return jax.tree.unflatten(jax.tree.structure(like), [jnp.asarray(arrays[n]) for n in names])


def export_model(path: str | Path, trained: Trained, *, fast=None) -> Path:
    """Write ``trained``'s slow parameters and fingerprint to ``path`` (replacing it
    atomically), with the memory session ``fast`` (default: ``trained.state.fast``, None when
    no level carries its state) when there is one; returns the path."""
    fast = trained.state.fast if fast is None else fast
    content = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": trained.fingerprint,
        "config": trained.config.to_json_best_effort(),
        "params": _flat(nnx.to_pure_dict(trained.state.params)),
    }
    if fast is not None:
        content["fast"] = _flat(fast)
    path = Path(path)
    return files.write_atomic(path, serialization.msgpack_serialize(content))


def import_model(path: str | Path, config: config_dict.ConfigDict | None = None) -> Trained:
    """The model exported at ``path``: built from ``config`` (None: the file's own config),
    with the file's slow parameters, its memory session as ``state.fast`` (None if it has
    none) and a fresh optimizer state.

    Raises :class:`ExportError` naming the path when it is not an exported model or one of
    another architecture than ``config``'s.
    """
    what = f"the exported model {str(path)!r}"
    try:
        content = serialization.msgpack_restore(Path(path).read_bytes())
    except FileNotFoundError:
        raise ExportError(
            f"no exported model at {str(path)!r}; write one with export_model"
        ) from None
    except Exception as error:  # noqa: BLE001 - whatever does not parse is not an export
        raise ExportError(f"{str(path)!r} is not an exported model ({error!r:.200})") from error
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ExportError(f"{str(path)!r} is not an exported model (no format {FORMAT!r})")
    saved = content.get("fingerprint")
    if config is None:
        config = config_lib.from_json(json.loads(content["config"]))
    step = (saved or {}).get("step")
    try:
        fingerprint.check(saved, fingerprint.of(config, step), what)
    except ValueError as error:
        raise ExportError(str(error)) from None
    experiment = config_lib.build(config)
    arrays = content.get("fast")
    batch_size = None if arrays is None else next(iter(arrays.values())).shape[0]
    init = jax.jit(experiment.program.init, static_argnames="batch_size")
    state = init(jax.random.key(config.seed), batch_size=batch_size)
    pure = _unflat(content["params"], nnx.to_pure_dict(state.params), what)
    nnx.replace_by_pure_dict(state.params, pure)
    fast = None if arrays is None else _unflat(arrays, state.fast, what)
    state = state.replace(step=jnp.asarray(step or 0, jnp.int32), fast=fast)
    return Trained(experiment, state, step)
