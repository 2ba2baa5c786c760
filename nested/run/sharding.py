"""Meshes with named axes ``data``, ``fsdp``, ``tensor``, and the shardings of a run's state.

A run's mesh (``train.mesh``) has three axes: ``data`` (pure data parallelism: the batch is
split, parameters are not), ``fsdp`` (the batch is split too, and every slow parameter and
its optimizer state is sharded: ZeRO-3) and ``tensor`` (projections split by heads and the MLP
by its hidden width; the memories' heads follow). Where each slow parameter's dimensions go is
:mod:`nested.run.partitioning`: logical axes per parameter, and the rules
(``train.mesh.rules``) mapping them onto these mesh axes. Batches and every per-sequence fast
state (memories, optimizer states of fast levels, caches: all lead with the batch dim) are
split along the ``batch`` rule's axes; a memory's head axis (dim 1 of a ``LevelState``'s
params and optimizer state) along the ``heads`` rule's axes when they divide it. ``jit`` with
these in/out shardings lets XLA insert the collectives (the all-gathers of FSDP, the
reductions of tensor parallelism); the training code is the same on 1 or N devices.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nested.core.level import LevelState
from nested.core.scheduler import Program, State
from nested.run import partitioning

AXES = ("data", "fsdp", "tensor")
# A run's mesh (a config's ``train.mesh``): the size of each axis, -1 for every device the
# others leave; ``train.mesh.rules`` (partitioning.RULE_DEFAULTS) places the logical axes.
MESH_DEFAULTS = types.MappingProxyType({"data": -1, "fsdp": 1, "tensor": 1})
RULE_DEFAULTS = partitioning.RULE_DEFAULTS


def check_mesh(settings: Mapping[str, Any], key: str = "train.mesh") -> dict[str, Any]:
    """:data:`MESH_DEFAULTS` overridden by ``settings`` (``rules``: :data:`RULE_DEFAULTS`
    overridden), checked: raises ``ValueError`` naming ``key.<setting>`` unless every size is
    an int >= 1 or -1 (at most one -1) and every rule names axes of :data:`AXES`."""
    settings = dict(settings)
    rules = {**RULE_DEFAULTS, **dict(settings.pop("rules", {}))}
    mesh = {**MESH_DEFAULTS, **settings}
    for axis in AXES:
        size = mesh[axis]
        if not isinstance(size, int) or isinstance(size, bool) or not (size >= 1 or size == -1):
            raise ValueError(f"{key}.{axis}={size!r} must be an int >= 1, or -1 for the rest")
    rest = [axis for axis in AXES if mesh[axis] == -1]
    if len(rest) > 1:
        raise ValueError(
            f"{key}: {' and '.join(f'{key}.{a}=-1' for a in rest)}: at most one axis takes "
            f"the rest of the devices"
        )
    mesh["rules"] = partitioning.check_rules(rules, AXES, f"{key}.rules")
    return mesh


def mesh_sizes(
    settings: Mapping[str, Any], devices: int, key: str = "train.mesh", platform: str = ""
) -> dict:
    """``{axis: size}`` of the checked mesh ``settings`` over ``devices`` devices (of
    ``platform``; the -1 axis takes the rest); raises ``ValueError`` naming ``key``."""
    sizes = {axis: settings[axis] for axis in AXES}
    fixed = int(np.prod([s for s in sizes.values() if s != -1]))
    for axis, size in sizes.items():
        if size == -1:
            sizes[axis] = devices // fixed if devices % fixed == 0 else 0
    if int(np.prod(list(sizes.values()))) != devices:
        given = " x ".join(f"{key}.{a}={settings[a]}" for a in AXES)
        raise ValueError(
            f"{given} does not fit the {devices} {platform + ' ' if platform else ''}device(s): "
            f"the sizes must multiply to "
            f"{devices} (-1: the devices the other axes leave)"
        )
    return sizes


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, *, devices=None, key: str = "mesh"
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all); -1: the rest."""
    devices = list(devices if devices is not None else jax.devices())
    settings = check_mesh({"data": data, "fsdp": fsdp, "tensor": tensor}, key)
    sizes = mesh_sizes(settings, len(devices), key, devices[0].platform)
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)  # XLA propagates shardings
    return jax.make_mesh(tuple(sizes.values()), AXES, axis_types=auto, devices=devices)


def _sizes(mesh: Mesh) -> dict[str, int]:
    return dict(mesh.shape)


def _fast_spec(x, mesh: Mesh, rules: Mapping[str, str], heads: bool) -> P:
    if x.ndim == 0:
        return P()
    axes = ("batch", "heads") if heads and x.ndim > 1 else ("batch",)
    axes = (*axes, *(None,) * (x.ndim - len(axes)))
    return partitioning.spec_of(axes, x.shape, rules, _sizes(mesh), name="", strict=False)


def fast_shardings(fast: Any, mesh: Mesh, rules: Mapping[str, str] = RULE_DEFAULTS) -> Any:
    """Shardings of a fast-state pytree: the batch along the ``batch`` rule's axes, memory
    heads along the ``heads`` rule's, each where it divides (else that dim stays whole)."""

    def of(node):
        if isinstance(node, LevelState):
            memory = jax.tree.map(
                lambda x: NamedSharding(mesh, _fast_spec(x, mesh, rules, True)),
                (node.params, node.opt_state),
            )
            cache = jax.tree.map(
                lambda x: NamedSharding(mesh, _fast_spec(x, mesh, rules, False)), node.cache
            )
            return node.replace(params=memory[0], opt_state=memory[1], cache=cache)
        return NamedSharding(mesh, _fast_spec(node, mesh, rules, False))

    return jax.tree.map(of, fast, is_leaf=lambda x: isinstance(x, LevelState))


def state_shardings(state: State, mesh: Mesh, rules: Mapping[str, str] = RULE_DEFAULTS) -> State:
    """Shardings of a whole :class:`nested.State` (see the module docstring): the slow
    parameters by :func:`nested.run.partitioning.parameter_specs`, every subtree of the
    optimizer state shaped like them (Adam's moments) alike."""
    named = lambda spec: NamedSharding(mesh, spec)
    specs = partitioning.parameter_specs(state.params, rules, _sizes(mesh))
    params = jax.tree.map(named, specs, is_leaf=partitioning._is_spec)
    structure = jax.tree.structure(state.params)

    def opt(node):
        if jax.tree.structure(node) == structure:
            return params
        # outside the parameters' structure: split along fsdp too (ZeRO-3), where it divides
        fsdp = _sizes(mesh)["fsdp"]
        return jax.tree.map(lambda x: named(partitioning.fsdp_spec(P(), x.shape, fsdp)), node)

    opt_state = jax.tree.map(
        opt, state.opt_state, is_leaf=lambda n: jax.tree.structure(n) == structure
    )
    return State(
        step=named(P()),
        params=params,
        opt_state=opt_state,
        fast=None if state.fast is None else fast_shardings(state.fast, mesh, rules),
        rng=named(P()),
    )


def batch_axes(mesh: Mesh, rules: Mapping[str, str] = RULE_DEFAULTS) -> tuple[str, ...]:
    """The mesh axes the batch is split along (the ``batch`` rule's)."""
    return partitioning.mesh_axes(rules["batch"]) or ()


def batch_sharding(
    mesh: Mesh, rules: Mapping[str, str] = RULE_DEFAULTS, *, stacked: bool = False
) -> NamedSharding:
    """Batches split along the ``batch`` rule's axes on their batch axis: axis 0, or axis 1
    when ``stacked`` on a leading axis of steps (the batches of one scanned call)."""
    axes = batch_axes(mesh, rules) or None
    return NamedSharding(mesh, P(None, axes) if stacked else P(axes))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_batch(
    batch_size: int,
    mesh: Mesh,
    rules: Mapping[str, str] = RULE_DEFAULTS,
    *,
    subject: str | None = None,
) -> None:
    """Raise ``ValueError`` naming ``subject`` (default ``"batch_size=<batch_size>"``) unless
    the batch axes' devices divide ``batch_size``."""
    axes = batch_axes(mesh, rules)
    n = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if batch_size % n:
        over = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
        raise ValueError(
            f"{subject or f'batch_size={batch_size}'} is not divisible by the {n} devices "
            f"({over}) the batch is split over; use a multiple of {n}"
        )


def describe(mesh: Mesh) -> str:
    """``"data=2 x fsdp=2 x tensor=2 over 8 cpu device(s)"`` (``"... of 2 processes"``)."""
    platform = mesh.devices.flat[0].platform
    axes = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
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
    """Where a run's arrays live: the mesh, its rules and the shardings of its
    :class:`State`.

    Build it from any state of the run's structure (arrays or ``jax.eval_shape`` output) with
    :meth:`of`; checkpoints restored into a state of these shardings land on this mesh,
    whatever mesh they were saved from.
    """

    mesh: Mesh
    state: State  # a State whose leaves are NamedShardings
    rules: Mapping[str, str] = dataclasses.field(default_factory=lambda: RULE_DEFAULTS)

    @classmethod
    def of(cls, state: State, mesh: Mesh, rules: Mapping[str, str] = RULE_DEFAULTS) -> Layout:
        """Raises ``ValueError`` naming a parameter whose dimension a rule cannot divide."""
        return cls(mesh, state_shardings(state, mesh, rules), rules)

    def batch(self, *, stacked: bool = False) -> NamedSharding:
        return batch_sharding(self.mesh, self.rules, stacked=stacked)

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


def place(state: State, mesh: Mesh, rules: Mapping[str, str] = RULE_DEFAULTS) -> State:
    """Put ``state`` on ``mesh`` with :func:`state_shardings`."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def jit_steps(program: Program, state: State, mesh: Mesh, rules: Mapping[str, str] = RULE_DEFAULTS):
    """``(train_step, eval_step)`` jitted with the mesh's shardings for ``state``'s structure.

    The batch goes along the ``batch`` rule's axes; the new state keeps the input state's
    shardings; metrics come back replicated.
    """
    layout = Layout.of(state, mesh, rules)
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
