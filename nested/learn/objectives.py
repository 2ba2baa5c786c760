"""Objectives: what a level minimises.

Two kinds, told apart by their call signature:

* **local objectives** of fast levels, the loss of one context item,
  ``objective(memory, params, item) -> scalar``, where ``item`` maps ``"k"``, ``"v"``, ``"q"``
  and every gate name to one token's arrays (``k (d_k,)``, ``v (d_v,)``, gates scalars). An
  objective that needs gates lists them in ``gates`` (name -> :class:`nested.rules.Gate`), so the
  owner level knows to produce them.
* **outer objectives** of the outermost level, ``objective(logits, batch) -> (loss, metrics)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import optax

from nested.learn.rules import Gate


@dataclasses.dataclass(frozen=True)
class L2:
    """``1/2 |f(k) - v|^2``: the delta rule's regression loss (DeltaNet, TTT, Titans)."""

    gates: ClassVar[Mapping[str, Gate]] = MappingProxyType({})

    def __call__(self, memory, params, item) -> jax.Array:
        return 0.5 * jnp.sum((memory.apply(params, item["k"]) - item["v"]) ** 2)


@dataclasses.dataclass(frozen=True)
class Dot:
    """``-<f(k), v>``: the dot-product (Hebbian) objective; one step of lr 1 writes ``v k^T``."""

    gates: ClassVar[Mapping[str, Gate]] = MappingProxyType({})

    def __call__(self, memory, params, item) -> jax.Array:
        return -jnp.vdot(memory.apply(params, item["k"]), item["v"])


@dataclasses.dataclass(frozen=True)
class NormalizedRidge:
    """Falcon's input-normalised ridge regression (Falcon-1).

    ``(1/2 |f(k) - v|^2 + lam/2 |theta|^2) / (|k|^2 + lam + eps)``: one SGD step of lr
    ``beta`` on it is ``W <- (1 - e lam) W + e (v - W k) k^T`` with the normalised step
    ``e = beta / (|k|^2 + lam + eps)``. ``lam >= 0`` is the gate named ``lam``.
    """

    lam: str = "lam"
    eps: float = 1e-6

    @property
    def gates(self) -> Mapping[str, Gate]:
        return {self.lam: Gate("positive", init=0.1)}

    def __call__(self, memory, params, item) -> jax.Array:
        lam, k = item[self.lam], item["k"]
        residual = 0.5 * jnp.sum((memory.apply(params, k) - item["v"]) ** 2)
        ridge = 0.5 * lam * sum(jnp.sum(p**2) for p in jax.tree.leaves(params))
        return (residual + ridge) / (jnp.sum(k**2) + lam + self.eps)


@dataclasses.dataclass(frozen=True)
class ErasedL2:
    """MemT's Stable GDN-2 regression: ``1/2 |f(sqrt(b) * k) - w * v|^2``.

    ``b`` (gate ``erase``, in (0,1)^{d_k}) selects the key channels a write erases and ``w``
    (gate ``write``, in (0,1)^{d_v}) scales the value written; one SGD step of lr 1 on it at
    the decayed state ``W D`` is ``W D (I - u u^T) + (w * v) u^T`` with ``u = sqrt(b) * k``.
    """

    erase: str = "erase"
    write: str = "write"

    @property
    def gates(self) -> Mapping[str, Gate]:
        return {
            self.erase: Gate("unit", init=0.5, size="d_k"),
            self.write: Gate("unit", init=0.5, size="d_v"),
        }

    def __call__(self, memory, params, item) -> jax.Array:
        u = jnp.sqrt(item[self.erase]) * item["k"]
        return 0.5 * jnp.sum((memory.apply(params, u) - item[self.write] * item["v"]) ** 2)


@dataclasses.dataclass(frozen=True)
class Omega:
    """ATLAS's Omega rule: ``sum_{i=t-c+1..t} g_i * base(f; k_i, v_i)`` over the last ``window``
    items (Behrouz et al. 2025, "ATLAS"). ``g_i`` (gate ``gate``, in (0,1)) weighs sample ``i``
    in every window containing it. The inner loop gives this objective windowed items:
    ``k (c, d_k)``, ``v (c, d_v)``, ``gate (c,)``, with zero gates before the sequence start
    (the window holds only the available samples). ``window=1`` with ``g = 1`` is ``base``.
    """

    window: int = 2
    gate: str = "omega"
    base: Any = L2()

    def __post_init__(self):
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"Omega.window={self.window!r} must be a positive int")

    @property
    def gates(self) -> Mapping[str, Gate]:
        return {self.gate: Gate("unit", init=0.9), **self.base.gates}

    def __call__(self, memory, params, item) -> jax.Array:
        def one(k, v, g):
            return g * self.base(memory, params, {**item, "k": k, "v": v})

        return jnp.sum(jax.vmap(one)(item["k"], item["v"], item[self.gate]))


l2 = L2()
dot = Dot()


def token_cross_entropy(logits: jax.Array, batch: Mapping[str, Any]) -> jax.Array:
    """Per-position next-token cross-entropy ``(B, T)``, zero where ``batch["mask"]`` is 0.

    Exactly zero there whatever the logits are: a masked position (padding) may hold
    non-finite logits, e.g. a memory diverging on a long run of EOS padding, and
    ``nan * 0`` is NaN, which would poison every sum over positions."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch.get("mask")
    if mask is None:
        return losses
    mask = mask.astype(losses.dtype)
    return jnp.where(mask != 0, losses * mask, jnp.zeros_like(losses))


def next_token(logits: jax.Array, batch: Mapping[str, Any]) -> tuple[jax.Array, dict]:
    """Masked next-token cross-entropy, the outer objective of a sequence model.

    ``logits (B, T, V)``; ``batch["targets"] (B, T)`` int; optional ``batch["mask"] (B, T)``
    weights the positions (default: all). Returns the mean loss over weighted positions and
    metrics ``loss`` and ``accuracy`` (argmax == target, over the same positions).
    """
    targets = batch["targets"]
    mask = batch.get("mask")
    mask = jnp.ones(targets.shape, logits.dtype) if mask is None else mask.astype(logits.dtype)
    denom = jnp.maximum(jnp.sum(mask), 1.0)
    loss = jnp.sum(token_cross_entropy(logits, batch)) / denom
    accuracy = jnp.sum((jnp.argmax(logits, -1) == targets) * mask) / denom
    return loss, {"loss": loss, "accuracy": accuracy}


@dataclasses.dataclass(frozen=True)
class OuterLoss:
    """The outer objective restricted to the tokens of a level's period (dynamic evaluation).

    A fast level with this objective learns from the outer loss: its memory is part of the
    model (e.g. a CMS block), the model runs period by period, and the level accumulates the
    gradient of each span's summed token losses ``sum_t token_loss_t`` with respect to its
    parameters (see :mod:`nested.core.outer_loss`). ``token_loss(logits, batch) -> (B, T)``.
    """

    token_loss: Any = token_cross_entropy
    gates: ClassVar[Mapping[str, Gate]] = MappingProxyType({})

    def __call__(self, logits: jax.Array, batch: Mapping[str, Any]) -> jax.Array:
        return self.token_loss(logits, batch)


outer_loss = OuterLoss()
