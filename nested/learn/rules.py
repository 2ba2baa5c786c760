"""Update rules of fast levels: typed specs that build optax transformations driven by gates.

A fast level's update rule maps the gradient of the level's objective to an additive update
and receives the gates that the owner level emits for the current token (a learning rate, a
momentum, a decay) as keyword arguments. A rule is a value with three attributes (the
:class:`Rule` protocol): ``transform`` (an :class:`optax.GradientTransformationExtraArgs`),
``gates`` (the gates it reads, name -> :class:`Gate`) and ``retain`` (a retention gate or
None). Any plain optax transformation (``optax.sgd(0.1)``) is a rule with no gates.

A rule may name a **retention** gate ``a`` that multiplies the state *before* the gradient is
taken (Gated DeltaNet forgets, then corrects at the forgotten state): ``theta' = a theta``,
``theta_new = theta' + update(grad L(theta'))``. A retention gate of kind ``"log_decay"``
multiplies by ``exp(a)``; one of size ``"d_k"`` scales the key axis (the last axis of
``W (d_v, d_k)``: ``W diag(a)``, MemT's diagonal forget gate).

The rules of the seeds are frozen dataclasses, so equal declarations compare (and hash)
equal and a rebuilt level hits jit's cache; kernels (:mod:`nested.core.kernels`) read their
fields to decide whether they implement a level:

* :class:`GradientDescent` (also ``gradient_descent``, and ``sgd`` without momentum)::

      theta'  = a_t theta_{t-1}                      (retain, optional)
      g_t     = grad L_t(theta') min(1, c / |grad L_t(theta')|)   (clip c, optional)
      S_t     = m_t S_{t-1} - h_t g_t                (momentum optional: S_t = -h_t g_t)
      theta_t = (1 - d_t) theta' + S_t               (decay optional)

  delta rule = ``sgd(lr="beta")`` on ``1/2 |W k - v|^2``; Gated DeltaNet adds
  ``retain="log_alpha"``; Titans is ``gradient_descent(lr, momentum=..., decay=...)``. The
  clip bounds each token's step whatever the weights (``|grad|`` the norm over the whole
  memory): without it a chunked rule with momentum diverges on a long run of one repeated
  input, where every gradient of a chunk is the same and grows with the weights.
* :class:`Muon` (ATLAS's inner optimizer)::

      S_t     = m_t S_{t-1} - grad L_t(theta_{t-1})
      theta_t = (1 - d_t) theta_{t-1} + h_t NS(S_t)

Their state is a :class:`MomentumState` (``momentum``: ``S``, or None without momentum).
The gated building blocks they are made of are public optax transformations
(:func:`scale_by_gate`, :func:`trace_by_gate`, :func:`decay_by_gate`, :func:`orthogonalize`):
``UpdateRule(optax.chain(...), gates={...})`` composes a new gated rule from them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax
from flax.core import FrozenDict

from nested.ops.functions import MUON_COEFFS, newton_schulz  # noqa: F401 - this module's API

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
"""A rule's coefficient: the name of a gate the owner emits per token, or a constant."""


def gate_value(spec: GateSpec, gates: Mapping[str, jax.Array]) -> jax.Array | float:
    """A gate given by name is read from ``gates``; a number is a constant."""
    return gates[spec] if isinstance(spec, str) else spec


class Rule(Protocol):
    """What a level needs of its update rule."""

    @property
    def transform(self) -> optax.GradientTransformationExtraArgs:
        """``update(grads, state, params, **gates) -> (updates, state)``."""

    @property
    def gates(self) -> Mapping[str, Gate]:
        """Every gate the transform (or the retention) reads, by name."""

    @property
    def retain(self) -> str | None:
        """The gate multiplying the state before the gradient is taken, or None."""


@dataclasses.dataclass(frozen=True, eq=False)
class UpdateRule:
    """Any optax transformation as a rule, with the gates it reads (compared by identity).

    ``gates`` maps every gate name the transform (or ``retain``) reads to its :class:`Gate`;
    ``retain`` names the gate multiplying the state before the gradient step, or is None.
    """

    transform: optax.GradientTransformationExtraArgs
    gates: Mapping[str, Gate] = dataclasses.field(default_factory=dict)
    retain: str | None = None


# -- gated building blocks: one pure step each, and the optax transformation of each -------


def _scaled(c, tree):
    return jax.tree.map(lambda u: c * u, tree)


def _traced(m, trace, updates):
    """``S_t = m_t S_{t-1} + u_t``."""
    return jax.tree.map(lambda s, u: m * s + u, trace, updates)


def _clipped(max_norm: float, tree):
    """``u min(1, c / |u|)``, ``|u|`` the norm of the whole pytree, as ``c / sqrt(max(|u|^2,
    c^2))``: differentiable everywhere, ``u = 0`` included (the square root of ``|u|^2`` is not
    there, and optax's ``clip_by_global_norm`` gives NaN meta-gradients at zero)."""
    squares = sum(jnp.sum(u * u) for u in jax.tree.leaves(tree))
    return _scaled(max_norm * jax.lax.rsqrt(jnp.maximum(squares, max_norm**2)), tree)


def _decayed(d, updates, params):
    """``u_t - d_t theta``."""
    return jax.tree.map(lambda u, p: u - d * p, updates, params)


def _orthogonalized(tree, steps: int):
    """``NS(u)`` on matrix-shaped leaves, the identity on the others."""
    return jax.tree.map(lambda u: newton_schulz(u, steps) if u.ndim == 2 else u, tree)


def _stateless(step) -> optax.GradientTransformationExtraArgs:
    def update(updates, state, params=None, **gates):
        return step(updates, params, gates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def scale_by_gate(spec: GateSpec, sign: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """``u -> sign * g_t u``, ``g_t`` the gate ``spec`` (or the constant)."""
    return _stateless(lambda u, params, gates: _scaled(sign * gate_value(spec, gates), u))


class TraceState(NamedTuple):
    """Momentum ``S`` of :func:`trace_by_gate`, shaped like the parameters."""

    trace: optax.Updates


def trace_by_gate(spec: GateSpec) -> optax.GradientTransformationExtraArgs:
    """``S_t = m_t S_{t-1} + u_t``, emitted as the update: heavy-ball momentum with a
    data-dependent retention ``m_t``."""

    def update(updates, state, params=None, **gates):
        trace = _traced(gate_value(spec, gates), state.trace, updates)
        return trace, TraceState(trace)

    return optax.GradientTransformationExtraArgs(
        lambda params: TraceState(jax.tree.map(jnp.zeros_like, params)), update
    )


def decay_by_gate(spec: GateSpec) -> optax.GradientTransformationExtraArgs:
    """``u_t -> u_t - d_t theta``: decay of the state towards zero (Titans' forgetting)."""
    return _stateless(lambda u, params, gates: _decayed(gate_value(spec, gates), u, params))


def orthogonalize(steps: int = 5) -> optax.GradientTransformationExtraArgs:
    """``u -> NS(u)`` (:func:`newton_schulz`) for matrix-shaped updates, identity otherwise."""
    return _stateless(lambda u, params, gates: _orthogonalized(u, steps))


# -- the typed rules --------------------------------------------------------------------------

DEFAULT_GATES = FrozenDict(
    {
        "lr": Gate("unit", init=0.5),
        "momentum": Gate("unit", init=0.5),
        "decay": Gate("unit", init=0.01),
        "retain": Gate("unit", init=0.95),
    }
)
"""The :class:`Gate` of each role of a rule (``gate_kinds``) unless the rule says otherwise."""


class MomentumState(NamedTuple):
    """The state of :class:`GradientDescent` and :class:`Muon`: the momentum ``S`` (shaped
    like the parameters), or None for a rule without momentum."""

    momentum: optax.Updates | None


def _check_spec(where: str, role: str, spec: Any, *, optional: bool) -> None:
    ok = isinstance(spec, str) or (
        isinstance(spec, int | float) and not isinstance(spec, bool) and math.isfinite(spec)
    )
    if not (ok or (optional and spec is None)):
        raise ValueError(
            f"{where}: {role}={spec!r} must be a gate name (str) or a finite number"
            + (", or None" if optional else "")
        )


class _GatedRule:
    """What :class:`GradientDescent` and :class:`Muon` share: coefficients given by role
    (``lr``, ``momentum``, ``decay``, ``retain``), each a constant or a gate name whose
    :class:`Gate` is ``gate_kinds[role]`` (default :data:`DEFAULT_GATES`); equal fields give
    equal (and equally hashed) rules."""

    ROLES = ("lr", "momentum", "decay", "retain")

    def _validate(self) -> None:
        where = type(self).__name__
        _check_spec(where, "lr", self.lr, optional=False)
        _check_spec(where, "momentum", self.momentum, optional=True)
        _check_spec(where, "decay", self.decay, optional=True)
        if self.retain is not None and not isinstance(self.retain, str):
            raise ValueError(f"{where}: retain={self.retain!r} must be a gate name or None")
        if not isinstance(self.gate_kinds, Mapping):
            raise ValueError(f"{where}: gate_kinds must map roles to Gates")
        unknown = set(self.gate_kinds) - set(self.ROLES)
        if unknown:
            raise ValueError(
                f"{where}: gate_kinds has unknown roles {sorted(unknown)}; "
                f"allowed: {list(self.ROLES)}"
            )
        used = {role: s for role in self.ROLES if isinstance(s := getattr(self, role), str)}
        kinds = {role: self.gate_kinds.get(role, DEFAULT_GATES[role]) for role in used}
        # Only the kinds of the roles in use are kept, so equal rules compare equal.
        object.__setattr__(self, "gate_kinds", FrozenDict(kinds))
        names = list(used.values())
        if len(set(names)) < len(names):
            raise ValueError(f"{where}: one gate name serves two roles: {used}")

    @property
    def gates(self) -> Mapping[str, Gate]:
        return {getattr(self, role): gate for role, gate in self.gate_kinds.items()}

    @property
    def transform(self) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(self.init, self.update)

    def init(self, params) -> MomentumState:
        if self.momentum is None:
            return MomentumState(None)
        return MomentumState(jax.tree.map(jnp.zeros_like, params))


@dataclasses.dataclass(frozen=True)
class GradientDescent(_GatedRule):
    """First-order rule with optional momentum, decay and retention (module docstring).

    ``lr``, ``momentum``, ``decay``: a constant or the name of a gate the owner emits;
    ``retain``: a gate name or None; ``clip``: the largest norm of one token's gradient (None:
    no clip); ``gate_kinds``: the :class:`Gate` of each role named by a gate (defaults
    :data:`DEFAULT_GATES`, all in (0, 1)).
    """

    lr: GateSpec = "lr"
    _: dataclasses.KW_ONLY
    momentum: GateSpec | None = None
    decay: GateSpec | None = None
    retain: str | None = None
    clip: float | None = None
    gate_kinds: Mapping[str, Gate] = DEFAULT_GATES

    def __post_init__(self):
        self._validate()
        clip = self.clip
        if clip is not None and not (
            isinstance(clip, int | float)
            and not isinstance(clip, bool)
            and math.isfinite(clip)
            and clip > 0
        ):
            raise ValueError(
                f"GradientDescent: clip={self.clip!r} must be a positive number (the largest "
                "norm of a token's gradient) or None"
            )

    def update(self, grads, state: MomentumState, params=None, **gates):
        if self.clip is not None:
            grads = _clipped(self.clip, grads)
        updates = _scaled(-gate_value(self.lr, gates), grads)
        momentum = state.momentum
        if self.momentum is not None:
            momentum = updates = _traced(gate_value(self.momentum, gates), momentum, updates)
        if self.decay is not None:
            updates = _decayed(gate_value(self.decay, gates), updates, params)
        return updates, MomentumState(momentum)


@dataclasses.dataclass(frozen=True)
class Muon(_GatedRule):
    """ATLAS's inner optimizer: momentum orthogonalised by Newton-Schulz, then step and decay
    (module docstring). ``ns_steps`` iterations on matrix-shaped parameters (0: plain
    momentum, the step ``h_t`` applied after it). No retention gate."""

    lr: GateSpec = "lr"
    _: dataclasses.KW_ONLY
    momentum: GateSpec = "momentum"
    decay: GateSpec | None = "decay"
    ns_steps: int = 5
    gate_kinds: Mapping[str, Gate] = DEFAULT_GATES
    retain: None = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        self._validate()
        if self.momentum is None:
            raise ValueError("Muon: momentum=None; Muon orthogonalises the momentum, give one")
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, int):
            raise ValueError(f"Muon: ns_steps={self.ns_steps!r} must be an int >= 0")
        if self.ns_steps < 0:
            raise ValueError(f"Muon: ns_steps={self.ns_steps!r} must be an int >= 0")

    def update(self, grads, state: MomentumState, params=None, **gates):
        momentum = _traced(gate_value(self.momentum, gates), state.momentum, _scaled(-1.0, grads))
        updates = momentum if not self.ns_steps else _orthogonalized(momentum, self.ns_steps)
        updates = _scaled(gate_value(self.lr, gates), updates)
        if self.decay is not None:
            updates = _decayed(gate_value(self.decay, gates), updates, params)
        return updates, MomentumState(momentum)


gradient_descent = GradientDescent
muon = Muon


def sgd(
    lr: GateSpec = "lr",
    *,
    retain: str | None = None,
    gate_kinds: Mapping[str, Gate] = DEFAULT_GATES,
) -> GradientDescent:
    """``theta_t = a_t theta_{t-1} - lr_t grad L_t``: the delta / Hebbian / Gated DeltaNet step."""
    return GradientDescent(lr, retain=retain, gate_kinds=gate_kinds)


def accumulated(rule: Rule, every: int) -> UpdateRule:
    """``rule`` whose updates are summed and applied every ``every`` tokens::

        u_t     = rule(grad L_t(theta_s), gates_t)     (theta_s: the last applied state)
        theta_t = theta_s + sum of the period's u      (at the period's last token)
        theta_t = theta_s                              (at every other token)

    The sum and the token count are rule state (``optax.MultiSteps`` with summed updates), so
    they travel with the fast state: a period may span calls and sequences of a carried stream,
    where a level's ``every`` (mini-batches of one call) cannot. Reads of a level with
    ``read="chunk_start"`` then see ``theta_s`` until the period ends. A rule with a retention
    gate is refused: its retention would still act every token."""
    if rule.retain is not None:
        raise ValueError(
            f"accumulated: the rule retains by gate {rule.retain!r} every token; accumulate a "
            "rule without retention"
        )
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"accumulated: every={every!r} must be an int >= 1")
    summed = optax.MultiSteps(optax.identity(), every, use_grad_mean=False)
    return UpdateRule(
        optax.chain(rule.transform, summed.gradient_transformation()), gates=rule.gates
    )


def as_rule(update: Any) -> Rule:
    """A level's ``update`` as a rule: a plain optax transformation becomes a rule with no
    gates; a value with ``transform`` and ``gates`` (:class:`Rule`) is used as it is."""
    if isinstance(update, optax.GradientTransformation):
        return UpdateRule(optax.with_extra_args_support(update))
    if all(hasattr(update, a) for a in ("transform", "gates", "retain")):
        return update
    raise ValueError(
        "update must be a nested.rules.UpdateRule, GradientDescent or Muon (a rule with "
        f"transform, gates and retain) or an optax.GradientTransformation, got "
        f"{type(update).__name__}"
    )
