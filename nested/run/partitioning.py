"""Logical axes of the slow parameters, and the rules mapping them onto mesh axes.

Each slow parameter of the built-in models has *logical* axes, named by what they index
(``embed``: the model width, ``mlp``: the SwiGLU or CMS hidden width, ``heads``: the outputs of
the projections that are split into heads, ``vocab``, ``kv``: a memory's own widths inside a
head, ``conv``: taps, ``norm``: a normalisation's scale...), given by :data:`LOGICAL_AXES`, a
table of parameter path patterns (the role MaxText's ``nn.with_logical_partitioning``
annotations play, kept in one table so that the layers stay plain NNX). A run's *rules*
(``train.mesh.rules``, :data:`RULE_DEFAULTS`) map each logical axis to mesh axes, as MaxText's
``logical_axis_rules`` do:

* ``embed -> fsdp``: every slow parameter and its optimizer state is split along ``fsdp``
  (ZeRO-3; XLA gathers each layer's weights where they are used);
* ``mlp, heads, vocab -> tensor``: the MLP is split column-wise (gate, up) then row-wise
  (down), the q/k/v, gate and output projections by heads (Megatron-style tensor
  parallelism), and the memories' learned initial states follow their heads;
* ``kv -> fsdp``: the widths of a memory's learned initial state, so these are sharded too;
* ``batch -> data, fsdp`` (used by the batch and the fast states, not by parameters).

``fsdp`` shards *every* parameter (ZeRO-3): one that its rules leave whole along ``fsdp`` (a
norm's scale, a convolution's taps and channels, a gate's bias) is split along ``fsdp`` on its
largest dimension that ``fsdp`` divides (:func:`fsdp_spec`). A mesh axis serves one dimension
of a parameter: a later dimension mapped to an axis already used stays whole. A dimension
that a rule maps onto mesh axes whose product does not divide it is an error naming the
parameter, the axis and the fix (:func:`spec_of`; for ``vocab``, padding it with
``model.vocab_multiple``). :func:`replicated_large` lists the parameters above a size that no
axis splits, so nothing is replicated by accident.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

# Logical axis -> mesh axes, comma-separated ("" keeps the dimension whole).
RULE_DEFAULTS = types.MappingProxyType(
    {
        "batch": "data,fsdp",
        "embed": "fsdp",
        "mlp": "tensor",
        "heads": "tensor",
        "vocab": "tensor",
        "kv": "fsdp",
        "conv": "",
        "norm": "",
        "tokens": "",
    }
)

# (path pattern, logical axes) in order, first match wins; a path is the parameter's keys
# joined by "/", layer indices as numbers (e.g. "blocks/3/mlp/gate/kernel"), matched with
# ``re.search`` anchored at the end.
LOGICAL_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(^|/)embed/embedding", ("vocab", "embed")),
    (r"(^|/)head/kernel", ("embed", "vocab")),
    (r"mlp/(gate|up)/kernel", ("embed", "mlp")),
    (r"mlp/down/kernel", ("mlp", "embed")),
    (r"cms/initial_params/\d+/0/w", ("mlp", "embed")),  # a CMS block's MLP: (hidden, dim)
    (r"cms/initial_params/\d+/[1-9]\d*/w", ("embed", "mlp")),  # ... then (dim, hidden)
    (r"initial_projections", (None, "embed", "heads")),  # Hope's P_k, P_v, P_q (3, dim, dim)
    (r"initial_params/.*", ("heads", "kv", "kv")),  # a memory's initial state per head
    (r"projection_gates/[^/]+/kernel", ("embed", None)),  # one gate per projection (k, v, q)
    (r"(qkv|query|gate_out|(^|/)gates/[^/]+)/kernel", ("embed", "heads")),
    (r"(qkv|query|gate_out|(^|/)gates/[^/]+)/bias", ("heads",)),
    (r"out/kernel", ("heads", "embed")),
    (r"conv/kernel", ("conv", "heads")),
    (r"conv/bias", ("heads",)),
    (r"persistent", ("tokens", "embed")),
    (r"(norm|norms/\d+)/(scale|bias)", ("norm",)),
)


def path_name(path) -> str:
    """``"blocks/0/mlp/gate/kernel"`` of a pytree key path (NNX's ``.value`` dropped)."""
    parts = []
    for key in path:
        name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
        if str(name) not in (".value", "value"):
            parts.append(str(name))
    return "/".join(parts)


def logical_axes(name: str, ndim: int) -> tuple[str | None, ...] | None:
    """The logical axes of the parameter ``name`` with ``ndim`` dims (the pattern's axes cut
    or padded with None to ``ndim``), or None when no pattern of :data:`LOGICAL_AXES`
    matches."""
    for pattern, axes in LOGICAL_AXES:
        if re.search(f"(?:{pattern})$", name):
            axes = axes[:ndim] if len(axes) >= ndim else (*axes, *(None,) * (ndim - len(axes)))
            return tuple(axes)
    return None


def mesh_axes(rule: str) -> tuple[str, ...]:
    """``"data,fsdp" -> ("data", "fsdp")``; ``"" -> ()``."""
    return tuple(axis.strip() for axis in rule.split(",") if axis.strip())


def check_rules(rules: Mapping[str, str], axes: tuple[str, ...], key: str) -> dict[str, str]:
    """``rules`` checked: raises ``ValueError`` naming ``key.<logical axis>`` for a value that
    is not a string or names an axis the mesh lacks."""
    for logical, rule in rules.items():
        if not isinstance(rule, str):
            raise ValueError(
                f"{key}.{logical}={rule!r} must be a string of mesh axes, e.g. 'fsdp' or "
                f"'data,fsdp' ('' keeps the dimension whole)"
            )
        for axis in mesh_axes(rule):
            if axis not in axes:
                raise ValueError(
                    f"{key}.{logical}={rule!r} names the axis {axis!r}, which the mesh lacks; "
                    f"mesh axes: {list(axes)}"
                )
    return dict(rules)


def spec_of(
    axes: tuple[str | None, ...],
    shape: tuple[int, ...],
    rules: Mapping[str, str],
    mesh_shape: Mapping[str, int],
    *,
    name: str,
    strict: bool = True,
) -> P:
    """The ``PartitionSpec`` of an array of ``shape`` with logical ``axes`` under ``rules``.

    Mesh axes of size 1 are left out, and an axis already used by an earlier dimension.
    ``strict``: a dimension its mesh axes do not divide raises ``ValueError`` naming ``name``,
    the dimension and the fix; otherwise that dimension stays whole.
    """
    used: set[str] = set()
    spec = []
    for dim, (logical, size) in enumerate(zip(axes, shape, strict=True)):
        targets = () if logical is None else mesh_axes(rules.get(logical, ""))
        targets = tuple(a for a in targets if a not in used and mesh_shape[a] > 1)
        split = int(np.prod([mesh_shape[a] for a in targets])) if targets else 1
        if targets and size % split:
            if strict:
                over = " x ".join(f"{a}={mesh_shape[a]}" for a in targets)
                pad = (
                    f", or pad the vocabulary to a multiple of {split}: "
                    f"model.vocab_multiple={math.lcm(split, 128)}"
                    if logical == "vocab"
                    else ""
                )
                raise ValueError(
                    f"train.mesh: parameter {name} {tuple(shape)}: dim {dim} ({logical}) of "
                    f"size {size} is not divisible by the mesh axes {over} that "
                    f"train.mesh.rules.{logical}={rules.get(logical)!r} puts it on; choose "
                    f"mesh sizes that divide {size}, or set train.mesh.rules.{logical}=''{pad}"
                )
            targets = ()
        used.update(targets)
        spec.append(None if not targets else targets[0] if len(targets) == 1 else targets)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def fsdp_spec(spec: P, shape: tuple[int, ...], fsdp: int) -> P:
    """``spec`` with ``fsdp`` added on the largest whole dimension of ``shape`` it divides,
    when ``spec`` does not use ``fsdp`` yet (unchanged if none divides or ``fsdp`` is 1)."""
    entries = [*spec, *(None,) * (len(shape) - len(spec))]
    used = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
    if fsdp == 1 or "fsdp" in used:
        return spec
    whole = [i for i in range(len(shape)) if entries[i] is None and shape[i] % fsdp == 0]
    if not whole:
        return spec
    entries[max(whole, key=lambda i: shape[i])] = "fsdp"
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def parameter_specs(params, rules: Mapping[str, str], mesh_shape: Mapping[str, int]):
    """A pytree of ``PartitionSpec`` of ``params`` (arrays or shape structs): each
    parameter's logical axes (:func:`logical_axes`) under ``rules`` (unmatched: none), then
    split along ``fsdp`` where that leaves it whole (:func:`fsdp_spec`)."""

    def of(path, x):
        name = path_name(path)
        axes = logical_axes(name, x.ndim)
        spec = P() if axes is None else spec_of(axes, x.shape, rules, mesh_shape, name=name)
        return fsdp_spec(spec, x.shape, mesh_shape.get("fsdp", 1))

    return jax.tree_util.tree_map_with_path(of, params)


def replicated_large(params, specs, min_bytes: int = 2**20) -> list[str]:
    """``"name (shape, MiB)"`` of each parameter of at least ``min_bytes`` that ``specs``
    leave whole on every axis (no rule shards it)."""
    out = []
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for (path, x), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=_is_spec), strict=True):
        size = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        if size >= min_bytes and not any(axis is not None for axis in spec):
            out.append(f"{path_name(path)} {tuple(x.shape)} {size / 2**20:.1f} MiB")
    return out


def _is_spec(x) -> bool:
    return isinstance(x, P)
