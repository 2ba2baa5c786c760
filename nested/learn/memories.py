"""Memories: the parameter set of a level and how it reads, ``f_theta(k)``.

A memory is a frozen, hashable description with two pure functions over one memory (no batch
or head dimensions; the scheduler vmaps them):

* ``init(key) -> params``: the initial parameters (a pytree), the starting point the owner
  level meta-learns;
* ``apply(params, k) -> v_hat``: the read, ``k (d_k,) -> (d_v,)``.

Weights follow the value-by-key convention of DESIGN.md: ``W`` has shape ``(d_out, d_in)`` and
reads ``W k``. Any object with ``d_k``, ``d_v``, ``init`` and ``apply`` is a memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from nested.ops.functions import (  # noqa: F401 - part of this module's API
    ACTIVATIONS,
    layer_norm,
    mlp_forward,
    mlp_output,
    polynomial_features,
)

Params = Any


class Memory(Protocol):
    """The parameter set of a level and its read ``f_theta(k)``."""

    d_k: int
    d_v: int

    def init(self, key: jax.Array) -> Params:
        """Initial parameters of one memory."""

    def apply(self, params: Params, k: jax.Array) -> jax.Array:
        """Read keys: ``(..., d_k) -> (..., d_v)`` (one key, or rows of keys read at once)."""


def _check_dims(memory: object, **dims: int) -> None:
    for field, value in dims.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{type(memory).__name__}.{field} must be a positive int, got {value!r}"
            )


def _rows_times(k: jax.Array, w: jax.Array) -> jax.Array:
    """``W k`` for every row of ``k (..., d_in)``, ``W (d_out, d_in)``: one matmul for a batch of
    keys (a vmapped matrix-vector product compiles to slow transposed dots on CPU)."""
    return jnp.einsum("...i,oi->...o", k, w)


@dataclasses.dataclass(frozen=True)
class Linear:
    """Linear associative memory ``f_W(k) = W k``, ``W (d_v, d_k)`` (Type I).

    The depth-1 case of :class:`MLP`'s layout: parameters ``({"w": W},)``, so every memory
    feeds the kernels in one layout. ``init_scale`` is the standard deviation of the initial
    ``W`` (0 gives the classic empty memory ``W_0 = 0``).
    """

    d_k: int
    d_v: int
    init_scale: float = 0.0

    def __post_init__(self):
        _check_dims(self, d_k=self.d_k, d_v=self.d_v)

    def init(self, key: jax.Array) -> Params:
        return ({"w": self.init_scale * jax.random.normal(key, (self.d_v, self.d_k))},)

    def apply(self, params: Params, k: jax.Array) -> jax.Array:
        return _rows_times(k, params[0]["w"])


@dataclasses.dataclass(frozen=True)
class MLP:
    """Neural memory ``f_theta(k) = W_L s(... s(W_1 k))`` of ``depth`` layers (Type II).

    Hidden width ``hidden``; parameters are a tuple of layers ``({"w": (hidden, d_k)}, ...,
    {"w": (d_v, hidden)})``, no biases (the layout of :mod:`nested.ops.mlp_memory`, so a level's
    state feeds the chunked ops directly). ``residual=True`` gives the TTT form
    ``f(k) = k + LN(MLP(k))`` (needs d_k == d_v); the LayerNorm has no learned gain, scale
    and shift belong to the owner. Initialisation: ``W_i ~ N(0, 1/fan_in)``.
    """

    d_k: int
    d_v: int
    hidden: int
    depth: int = 2
    activation: str = "gelu"
    residual: bool = False

    def __post_init__(self):
        _check_dims(self, d_k=self.d_k, d_v=self.d_v, hidden=self.hidden, depth=self.depth)
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"MLP.activation={self.activation!r} is unknown; use one of {sorted(ACTIVATIONS)}"
            )
        if self.residual and self.d_k != self.d_v:
            raise ValueError(
                f"MLP.residual=True needs d_k == d_v, got d_k={self.d_k}, d_v={self.d_v}"
            )

    @property
    def shapes(self) -> list[tuple[int, int]]:
        dims = [self.d_k] + [self.hidden] * (self.depth - 1) + [self.d_v]
        return [(dims[i + 1], dims[i]) for i in range(self.depth)]

    def init(self, key: jax.Array) -> Params:
        keys = jax.random.split(key, self.depth)
        return tuple(
            {"w": jax.random.normal(k, shape) / jnp.sqrt(shape[1])}
            for k, shape in zip(keys, self.shapes, strict=True)
        )

    def apply(self, params: Params, k: jax.Array) -> jax.Array:
        return mlp_forward(
            lambda layer, u: _rows_times(u, params[layer]["w"]),
            k,
            self.depth,
            ACTIVATIONS[self.activation],
            self.residual,
        )


@dataclasses.dataclass(frozen=True)
class Featurized:
    """``f(phi(k))``: a memory reading polynomial features of its keys (ATLAS's ``phi``).

    ``memory`` reads ``degree * d_k`` features; this memory reads keys of size ``d_k``.
    """

    memory: Any
    degree: int = 2

    def __post_init__(self):
        _check_dims(self, degree=self.degree)
        if self.memory.d_k % self.degree:
            raise ValueError(
                f"Featurized: the inner memory reads {self.memory.d_k} features, not a "
                f"multiple of degree={self.degree}"
            )

    @property
    def d_k(self) -> int:
        return self.memory.d_k // self.degree

    @property
    def d_v(self) -> int:
        return self.memory.d_v

    def init(self, key: jax.Array) -> Params:
        return self.memory.init(key)

    def apply(self, params: Params, k: jax.Array) -> jax.Array:
        return self.memory.apply(params, polynomial_features(k, self.degree))
