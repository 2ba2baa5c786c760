"""Data parallelism through ``jax.sharding``: one mesh, shardings for the state and the batch.

A mesh has a ``data`` axis (and optionally a ``model`` axis). Batches and every per-sequence
fast state (memories, optimizer states of fast levels, caches: all lead with the batch dim) are
split along ``data``; the memories' head axis (dim 1 of a ``LevelState``'s params and optimizer
state) along ``model`` when it divides; slow parameters and their optimizer state are
replicated, or with ``shard_params`` split along ``data`` on their largest divisible axis
(FSDP-style). ``jit`` with these in/out shardings lets XLA insert the collectives; the
training code is the same on 1 or N devices.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nested.core.level import LevelState
from nested.core.scheduler import Program, State

# A run's mesh (a config's ``train.mesh``): ``data`` devices split the batch (0: every device
# not on ``model``), ``model`` devices split the memory heads; ``shard_params`` splits the slow
# parameters along ``data`` too (else they are replicated).
MESH_DEFAULTS = types.MappingProxyType({"data": 0, "model": 1, "shard_params": False})


def check_mesh(settings: Mapping[str, Any], key: str = "train.mesh") -> dict[str, Any]:
    """:data:`MESH_DEFAULTS` overridden by ``settings``, checked: raises ``ValueError`` naming
    ``key.<setting>`` unless ``data`` is an int >= 0, ``model`` an int >= 1 and
    ``shard_params`` a bool."""
    mesh = {**MESH_DEFAULTS, **settings}
    for axis, low in (("data", 0), ("model", 1)):
        size = mesh[axis]
        if not isinstance(size, int) or isinstance(size, bool) or size < low:
            raise ValueError(f"{key}.{axis}={size!r} must be an int >= {low}")
    if not isinstance(mesh["shard_params"], bool):
        raise ValueError(f"{key}.shard_params={mesh['shard_params']!r} must be True or False")
    return mesh


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A ``(data, model)`` mesh over ``devices`` (default: all); ``data=None`` uses the rest."""
    devices = list(devices if devices is not None else jax.devices())
    if data is None:
        data = len(devices) // model
    if data * model != len(devices) or data < 1 or model < 1:
        raise ValueError(
            f"mesh: data={data} x model={model} does not match the {len(devices)} devices; "
            f"choose sizes whose product is {len(devices)}"
        )
    auto = (jax.sharding.AxisType.Auto,) * 2  # XLA propagates shardings through the step
    return jax.make_mesh((data, model), ("data", "model"), axis_types=auto, devices=devices)


def _size(mesh: Mesh, axis: str) -> int:
    return mesh.shape[axis]


def _fast_spec(x: jax.Array, mesh: Mesh, heads: bool) -> P:
    if x.ndim == 0 or x.shape[0] % _size(mesh, "data"):
        return P()
    if heads and x.ndim > 1 and _size(mesh, "model") > 1 and x.shape[1] % _size(mesh, "model") == 0:
        return P("data", "model")
    return P("data")


def _param_spec(x: jax.Array, mesh: Mesh) -> P:
    n = _size(mesh, "data")
    axes = [i for i in sorted(range(x.ndim), key=lambda i: -x.shape[i]) if x.shape[i] % n == 0]
    if not axes or n == 1:
        return P()
    spec = [None] * x.ndim
    spec[axes[0]] = "data"
    return P(*spec)


def fast_shardings(fast: Any, mesh: Mesh) -> Any:
    """Shardings of a fast-state pytree: batch along ``data``, memory heads along ``model``."""

    def of(node):
        if isinstance(node, LevelState):
            memory = jax.tree.map(
                lambda x: NamedSharding(mesh, _fast_spec(x, mesh, True)),
                (node.params, node.opt_state),
            )
            cache = jax.tree.map(
                lambda x: NamedSharding(mesh, _fast_spec(x, mesh, False)), node.cache
            )
            return node.replace(params=memory[0], opt_state=memory[1], cache=cache)
        return NamedSharding(mesh, _fast_spec(node, mesh, False))

    return jax.tree.map(of, fast, is_leaf=lambda x: isinstance(x, LevelState))


def state_shardings(state: State, mesh: Mesh, *, shard_params: bool = False) -> State:
    """Shardings of a whole :class:`nested.State` (see the module docstring)."""
    replicated = NamedSharding(mesh, P())

    def param(x):
        return NamedSharding(mesh, _param_spec(x, mesh)) if shard_params else replicated

    return State(
        step=replicated,
        params=jax.tree.map(param, state.params),
        opt_state=jax.tree.map(param, state.opt_state),
        fast=None if state.fast is None else fast_shardings(state.fast, mesh),
        rng=replicated,
    )


def batch_sharding(mesh: Mesh, *, stacked: bool = False) -> NamedSharding:
    """Batches split along ``data`` on their batch axis: axis 0, or axis 1 when ``stacked``
    on a leading axis of steps (the batches of one scanned call)."""
    return NamedSharding(mesh, P(None, "data") if stacked else P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_batch(batch_size: int, mesh: Mesh, *, name: str = "batch_size") -> None:
    """Raise ``ValueError`` naming ``name`` unless the data axis divides ``batch_size``."""
    n = _size(mesh, "data")
    if batch_size % n:
        raise ValueError(
            f"{name}={batch_size} is not divisible by the mesh's data axis ({n} devices); "
            f"use a multiple of {n}"
        )


def describe(mesh: Mesh) -> str:
    """``"data=4 x model=2 over 8 cpu devices"`` (``"... of 2 processes"`` when several)."""
    platform = mesh.devices.flat[0].platform
    axes = f"data={mesh.shape['data']} x model={mesh.shape['model']}"
    processes = len({d.process_index for d in mesh.devices.flat})
    where = f" of {processes} processes" if processes > 1 else ""
    return f"{axes} over {mesh.size} {platform} device(s){where}"


def process_rows(sharding: NamedSharding, shape: tuple[int, ...], axis: int) -> slice:
    """The rows ``[start, stop)`` along ``axis`` of a global array of ``shape`` that this
    process's devices hold under ``sharding`` (all of them in a single-process run); raises
    ``ValueError`` if they are not one contiguous block."""
    spans = sorted(
        {
            (index[axis].start or 0, shape[axis] if index[axis].stop is None else index[axis].stop)
            for index in sharding.addressable_devices_indices_map(shape).values()
        }
    )
    for (_, stop), (start, _) in zip(spans, spans[1:], strict=False):
        if start != stop:
            raise ValueError(f"this process's rows of a {shape} batch are not contiguous: {spans}")
    return slice(spans[0][0], spans[-1][1])


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a run's arrays live: the mesh and the shardings of its :class:`State`.

    Build it from any state of the run's structure (arrays or ``jax.eval_shape`` output) with
    :meth:`of`; checkpoints restored into a state of these shardings land on this mesh,
    whatever mesh they were saved from.
    """

    mesh: Mesh
    state: State  # a State whose leaves are NamedShardings

    @classmethod
    def of(cls, state: State, mesh: Mesh, *, shard_params: bool = False) -> Layout:
        return cls(mesh, state_shardings(state, mesh, shard_params=shard_params))

    def batch(self, *, stacked: bool = False) -> NamedSharding:
        return batch_sharding(self.mesh, stacked=stacked)

    def rows(self, batch_size: int) -> slice:
        """The rows of a global batch of ``batch_size`` sequences that this process feeds."""
        return process_rows(self.batch(), (batch_size, 1), 0)

    def put(self, arrays: Mapping[str, Any], batch_size: int, *, stacked: bool = False) -> dict:
        """Global arrays of a batch from this process's rows of it (``arrays``, numpy, rows
        :meth:`rows`; on axis 1 when ``stacked`` on a leading axis of steps)."""
        sharding, axis = self.batch(stacked=stacked), 1 if stacked else 0
        out = {}
        for name, local in arrays.items():
            shape = (*local.shape[:axis], batch_size, *local.shape[axis + 1 :])
            out[name] = jax.make_array_from_process_local_data(sharding, local, shape)
        return out

    @property
    def replicated(self) -> NamedSharding:
        return replicated(self.mesh)


def place(state: State, mesh: Mesh, *, shard_params: bool = False) -> State:
    """Put ``state`` on ``mesh`` with :func:`state_shardings`."""
    return jax.device_put(state, state_shardings(state, mesh, shard_params=shard_params))


def jit_steps(program: Program, state: State, mesh: Mesh, *, shard_params: bool = False):
    """``(train_step, eval_step)`` jitted with the mesh's shardings for ``state``'s structure.

    The batch goes along ``data``; the new state keeps the input state's shardings; metrics
    come back replicated.
    """
    layout = Layout.of(state, mesh, shard_params=shard_params)
    train = jax.jit(
        program.train_step,
        in_shardings=(layout.state, layout.batch()),
        out_shardings=(layout.state, layout.replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        program.eval_step,
        in_shardings=(layout.state, layout.batch()),
        out_shardings=layout.replicated,
    )
    return train, evaluate
