"""Update rules of fast levels: optax transformations driven by data-dependent gates.

A fast level's update rule is an :class:`optax.GradientTransformationExtraArgs`: it maps the
gradient of the level's objective to an additive update, and receives the gates that the owner
level emits for the current token (a learning rate, a momentum, a decay) as keyword arguments.
Any plain optax transformation (``optax.sgd(0.1)``) is a rule with no gates.

A rule may also name a **retention** gate ``a`` that multiplies the state *before* the
gradient is taken (Gated DeltaNet forgets, then corrects at the forgotten state):
``theta' = a theta``, ``theta_new = theta' + update(grad L(theta'))``. A retention gate of
kind ``"log_decay"`` multiplies by ``exp(a)``; one of size ``"d_k"`` scales the key axis (the
last axis of ``W (d_v, d_k)``: ``W diag(a)``, MemT's diagonal forget gate).

:func:`gradient_descent` covers the first-order rules of the seeds:

    theta'  = a_t theta_{t-1}                      (retain, optional)
    S_t     = m_t S_{t-1} - h_t grad L_t(theta')   (momentum optional: S_t = -h_t grad)
    theta_t = (1 - d_t) theta' + S_t               (decay optional)

delta rule = ``gradient_descent(lr="beta")`` on ``1/2 |W k - v|^2``; Gated DeltaNet adds
``retain="alpha"``; Titans is ``gradient_descent(lr, momentum=..., decay=...)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

GateKind = Literal["unit", "positive", "log_decay"]
_GATE_KINDS = ("unit", "positive", "log_decay")


@dataclasses.dataclass(frozen=True)
class Gate:
    """A data-dependent value the owner level emits per token and head.

    ``kind`` fixes the range by construction: ``"unit"`` is a sigmoid in (0, 1), ``"positive"``
    a softplus in (0, inf), ``"log_decay"`` is ``-softplus`` in (-inf, 0). ``init`` is the value
    the gate takes at initialisation when its projection's input is zero (it sets the bias).
    ``size`` is None for a scalar per head, or ``"d_k"`` / ``"d_v"`` for one value per key /
    value channel of the memory (MemT's erase, write and decay vectors). ``scale`` multiplies
    the gate (a ``"unit"`` gate with ``scale=0.1`` is in (0, 0.1): a bounded learning rate).
    """

    kind: GateKind = "unit"
    init: float | None = None
    size: Literal["d_k", "d_v"] | None = None
    scale: float = 1.0

    def __post_init__(self):
        if self.kind not in _GATE_KINDS:
            raise ValueError(f"Gate.kind={self.kind!r} is unknown; use one of {_GATE_KINDS}")
        if self.size not in (None, "d_k", "d_v"):
            raise ValueError(f"Gate.size={self.size!r}; use None, 'd_k' or 'd_v'")
        if not self.scale > 0:
            raise ValueError(f"Gate.scale={self.scale} must be positive")
        if self.init is not None:
            bad = {
                "unit": not 0.0 < self.init < self.scale,
                "positive": self.init <= 0.0,
                "log_decay": self.init >= 0.0,
            }[self.kind]
            if bad:
                raise ValueError(
                    f"Gate.init={self.init} is outside the range of kind {self.kind!r}"
                )

    def activate(self, pre: jax.Array) -> jax.Array:
        """Map a pre-activation to the gate's range."""
        if self.kind == "unit":
            value = jax.nn.sigmoid(pre)
        elif self.kind == "positive":
            value = jax.nn.softplus(pre)
        else:
            value = -jax.nn.softplus(pre)
        return value if self.scale == 1.0 else self.scale * value

    def bias(self) -> float:
        """The pre-activation that gives ``init`` (0 when ``init`` is None)."""
        if self.init is None:
            return 0.0
        x = self.init / self.scale
        x = x if self.kind != "log_decay" else -x
        if self.kind == "unit":
            return math.log(x) - math.log1p(-x)
        return math.log(math.expm1(x))  # inverse softplus


GateSpec = str | float


@dataclasses.dataclass(frozen=True, eq=False)
class UpdateRule:
    """An update rule of a fast level: ``transform`` plus the gates it reads.

    ``gates`` maps every gate name the transform (or ``retain``) reads to its :class:`Gate`;
    ``retain`` names the gate multiplying the state before the gradient step, or is None.
    """

    transform: optax.GradientTransformationExtraArgs
    gates: Mapping[str, Gate] = dataclasses.field(default_factory=dict)
    retain: str | None = None


def as_rule(update: UpdateRule | optax.GradientTransformation) -> UpdateRule:
    """Accept a plain optax transformation as a rule with no gates."""
    if isinstance(update, UpdateRule):
        return update
    if isinstance(update, optax.GradientTransformation):
        return UpdateRule(optax.with_extra_args_support(update))
    raise ValueError(
        f"update must be a nested.rules.UpdateRule or an optax.GradientTransformation, "
        f"got {type(update).__name__}"
    )


def gate_value(spec: GateSpec, gates: Mapping[str, jax.Array]) -> jax.Array | float:
    """A gate given by name is read from ``gates``; a number is a constant."""
    return gates[spec] if isinstance(spec, str) else spec


def _scale_by(spec: GateSpec, sign: float) -> optax.GradientTransformationExtraArgs:
    def update(updates, state, params=None, **gates):
        del params
        scale = sign * gate_value(spec, gates)
        return jax.tree.map(lambda u: scale * u, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


class TraceState(NamedTuple):
    """Momentum ``S`` of a gated trace, shaped like the parameters."""

    trace: optax.Updates


def _gated_trace(spec: GateSpec) -> optax.GradientTransformationExtraArgs:
    """``S_t = m_t S_{t-1} + u_t``: heavy-ball momentum with a data-dependent retention."""

    def init(params):
        return TraceState(jax.tree.map(jnp.zeros_like, params))

    def update(updates, state, params=None, **gates):
        del params
        m = gate_value(spec, gates)
        trace = jax.tree.map(lambda s, u: m * s + u, state.trace, updates)
        return trace, TraceState(trace)

    return optax.GradientTransformationExtraArgs(init, update)


def _gated_decay(spec: GateSpec) -> optax.GradientTransformationExtraArgs:
    """``u_t - d_t theta``: decay of the state towards zero (Titans' forgetting)."""

    def update(updates, state, params=None, **gates):
        d = gate_value(spec, gates)
        return jax.tree.map(lambda u, p: u - d * p, updates, params), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


MUON_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    x: jax.Array, steps: int = 5, coeffs: tuple[float, float, float] = MUON_COEFFS, eps=1e-7
) -> jax.Array:
    """Approximate orthogonalisation ``U V^T`` of ``x = U S V^T`` (Muon, Jordan et al. 2024).

    ``x (..., m, n)`` is scaled to unit Frobenius norm, smoothly (``x / sqrt(|x|^2 + eps^2)``,
    differentiable at 0), then ``steps`` quintic iterations ``X <- a X + (b A + c A^2) X`` with
    ``A = X X^T`` on the short side push its singular values towards 1 (Muon's coefficients
    leave them in about [0.7, 1.2]).
    """
    a, b, c = coeffs
    wide = x.shape[-2] <= x.shape[-1]
    x = x if wide else jnp.swapaxes(x, -1, -2)
    x = x * jax.lax.rsqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True) + eps**2)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else jnp.swapaxes(x, -1, -2)


def _orthogonalized(steps: int) -> optax.GradientTransformationExtraArgs:
    """``NS(u)`` for matrix-shaped updates (Newton-Schulz), the identity for the others."""

    def update(updates, state, params=None, **gates):
        del params, gates
        ortho = lambda u: newton_schulz(u, steps) if u.ndim == 2 else u
        return jax.tree.map(ortho, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def _gates_of(kinds: Mapping[str, Gate], **specs: GateSpec | None) -> dict[str, Gate]:
    return {spec: kinds[role] for role, spec in specs.items() if isinstance(spec, str)}


DEFAULT_GATES = MappingProxyType(
    {
        "lr": Gate("unit", init=0.5),
        "momentum": Gate("unit", init=0.5),
        "decay": Gate("unit", init=0.01),
        "retain": Gate("unit", init=0.95),
    }
)


def gradient_descent(
    lr: GateSpec = "lr",
    *,
    momentum: GateSpec | None = None,
    decay: GateSpec | None = None,
    retain: str | None = None,
    gate_kinds: Mapping[str, Gate] = DEFAULT_GATES,
) -> UpdateRule:
    """First-order rule with optional momentum, decay and retention (see the module docstring).

    Each of ``lr``, ``momentum``, ``decay`` is a constant or the name of a gate the owner emits;
    ``retain`` is a gate name. ``gate_kinds`` gives the :class:`Gate` of each role (defaults:
    all in (0, 1)).
    """
    parts = [_scale_by(lr, -1.0)]
    if momentum is not None:
        parts.append(_gated_trace(momentum))
    if decay is not None:
        parts.append(_gated_decay(decay))
    gates = _gates_of(gate_kinds, lr=lr, momentum=momentum, decay=decay, retain=retain)
    return UpdateRule(optax.chain(*parts), MappingProxyType(gates), retain)


def sgd(lr: GateSpec = "lr", *, retain: str | None = None) -> UpdateRule:
    """``theta_t = a_t theta_{t-1} - lr_t grad L_t``: the delta / Hebbian / Gated DeltaNet step."""
    return gradient_descent(lr, retain=retain)


def muon(
    lr: GateSpec = "lr",
    *,
    momentum: GateSpec = "momentum",
    decay: GateSpec | None = "decay",
    ns_steps: int = 5,
    gate_kinds: Mapping[str, Gate] = DEFAULT_GATES,
) -> UpdateRule:
    """ATLAS's inner optimizer: momentum orthogonalised by Newton-Schulz, then step and decay.

    ``S_t = m_t S_{t-1} - grad L_t``, ``theta_t = (1 - d_t) theta_{t-1} + h_t NS(S_t)`` with
    ``NS`` applied to matrix-shaped parameters (``ns_steps`` iterations; 0 is plain momentum).
    """
    parts = [_scale_by(1.0, -1.0), _gated_trace(momentum)]
    if ns_steps:
        parts.append(_orthogonalized(ns_steps))
    parts.append(_scale_by(lr, 1.0))
    if decay is not None:
        parts.append(_gated_decay(decay))
    gates = _gates_of(gate_kinds, lr=lr, momentum=momentum, decay=decay)
    return UpdateRule(optax.chain(*parts), MappingProxyType(gates))
