"""Plasticity capacity of a fast memory: how much, and in how many directions, its state changes.

Pure functions over parameter pytrees in the layout of :mod:`nested.learn.memories` (a tuple of
layers ``({"w": W_1}, ...)``, ``W (d_out, d_in)``). Fast states carry leading batch/head dims,
e.g. a Linear state ``({"w": (B, H, d_v, d_k)},)``; the matrix measures batch over every leading
dim, the per-memory norms take the number of leading dims as ``lead_dims``.

* :func:`relative_change`, :func:`change_norm`: size of an update;
* :func:`singular_values`, :func:`effective_rank`, :func:`stable_rank`: its directions;
* :func:`hidden_activations`, :func:`dormant_fraction`: dead hidden units of an MLP memory;
* :func:`early_late_gap`: loss of plasticity over a long stream of tasks;
* :func:`state_change`, :func:`dormant_units`: the above per level of a program's fast state;
  :func:`long_stream`: all of it over a long deployment (:mod:`nested.plasticity.deployment`)
  that returns to its tasks again and again.

The array measures are jitted: one compiled program per shape instead of one per primitive
(eager dispatch compiles every op). :func:`early_late_gap` is a host-side summary of a few numbers
and returns Python floats for reports, so it runs in NumPy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nested.core import inner, probes
from nested.core.scheduler import level_states
from nested.learn import memories


def _squared_norm(tree: Any, lead_dims: int) -> jax.Array:
    """Sum of squares of every leaf over its trailing dims, all leaves together: shape ``lead``."""
    leaves = jax.tree.leaves(tree)
    return sum(jnp.sum(jnp.square(x), axis=tuple(range(lead_dims, x.ndim))) for x in leaves)


@functools.partial(jax.jit, static_argnames="lead_dims")
def change_norm(before: Any, after: Any, lead_dims: int = 2) -> jax.Array:
    """Absolute size of an update per memory: ``||theta_after - theta_before||_F``.

    ``before`` and ``after`` are pytrees of one structure whose leaves share leading dims
    ``lead`` (``lead_dims`` of them, default 2 for ``(B, H)``); the Frobenius norm runs over the
    trailing dims of all leaves together. Returns shape ``lead``.
    """

    def delta(a: jax.Array, b: jax.Array) -> jax.Array:
        if a.shape != b.shape:
            raise ValueError(f"change_norm: leaf shapes differ, {a.shape} before, {b.shape} after")
        return b - a

    return jnp.sqrt(_squared_norm(jax.tree.map(delta, before, after), lead_dims))


@functools.partial(jax.jit, static_argnames="lead_dims")
def relative_change(before: Any, after: Any, lead_dims: int = 2, eps: float = 1e-12) -> jax.Array:
    """Size of an update relative to the state it changed, per memory (shape ``lead``):

    ``||theta_after - theta_before||_F / (||theta_before||_F + eps)``, norms as in
    :func:`change_norm`. ``eps`` (1e-12) only keeps the ratio finite: a memory that starts at 0
    (Linear's default ``init_scale=0``) gives a huge ratio ``~ ||theta_after|| / eps``, so report
    :func:`change_norm` alongside it.
    """
    before_norm = jnp.sqrt(_squared_norm(before, lead_dims))
    return change_norm(before, after, lead_dims) / (before_norm + eps)


@jax.jit
def singular_values(matrix: jax.Array) -> jax.Array:
    """Singular values of ``matrix (..., m, n)`` over its last two dims, descending:
    ``(..., min(m, n))``."""
    return jnp.linalg.svd(matrix, compute_uv=False)


@jax.jit
def effective_rank(matrix: jax.Array, eps: float = 1e-12) -> jax.Array:
    """Effective rank (Roy & Vetterli 2007, "The effective rank: a measure of effective
    dimensionality") of ``matrix (..., m, n)``, shape ``(...)``:

    ``p_i = s_i / sum_j s_j``, ``erank = exp(-sum_i p_i log p_i)`` with ``0 log 0 = 0``, over the
    singular values ``s``. It lies in ``[1, min(m, n)]`` for a nonzero matrix (1 for rank one,
    ``n`` for ``n`` equal singular values). A matrix with ``sum_j s_j <= eps`` is taken as zero
    and gives 0, not the formula's limit 1: a memory with no state has no directions.
    """
    s = singular_values(matrix)
    total = jnp.sum(s, axis=-1, keepdims=True)
    nonzero = total > eps
    p = s / jnp.where(nonzero, total, 1.0)
    entropy = -jnp.sum(jax.scipy.special.xlogy(p, p), axis=-1)
    return jnp.where(nonzero[..., 0], jnp.exp(entropy), 0.0)


@jax.jit
def stable_rank(matrix: jax.Array, eps: float = 1e-12) -> jax.Array:
    """Stable rank (Rudelson & Vershynin 2007, "Sampling from large matrices: an approach through
    geometric functional analysis") of ``matrix (..., m, n)``, shape ``(...)``:

    ``||A||_F^2 / ||A||_2^2 = sum_i s_i^2 / max_i s_i^2``, in ``[1, min(m, n)]`` for a nonzero
    matrix. A matrix with ``max_i s_i <= eps`` is taken as zero and gives 0.
    """
    s = singular_values(matrix)
    top = jnp.max(s, axis=-1)
    nonzero = top > eps
    return jnp.where(nonzero, jnp.sum(s * s, axis=-1) / jnp.where(nonzero, top * top, 1.0), 0.0)


def hidden_activations(memory: Any, params: Any, keys: jax.Array) -> list[jax.Array]:
    """Post-activation hidden units of an MLP memory (or ``Featurized`` wrapping one) for keys.

    For ONE memory (``params`` without lead dims) and ``keys (N, d_k)``: ``h_0 = k`` (or
    ``phi(k)``, :func:`memories.polynomial_features`, for ``Featurized``) and
    ``h_l = act(W_l h_{l-1})`` for each of the ``depth - 1`` hidden layers, the products the
    memory computes. Returns that many ``(N, hidden)`` arrays; the read is
    ``mlp_output(k, W_depth h_{depth-1}, residual)``. Raises ValueError for a memory with no
    hidden layer (Linear, MLP of depth 1).
    """
    mlp = memory.memory if isinstance(memory, memories.Featurized) else memory
    if not isinstance(mlp, memories.MLP) or mlp.depth < 2:
        name = type(mlp).__name__
        name = f"{name}(depth={mlp.depth})" if isinstance(mlp, memories.MLP) else name
        name = f"Featurized({name})" if mlp is not memory else name
        raise ValueError(
            f"memory {name} has no hidden units; dormant units are measured on MLP memories"
        )
    if mlp is not memory:
        keys = memories.polynomial_features(keys, memory.degree)
    act = memories.ACTIVATIONS[mlp.activation]
    hidden, u = [], keys
    for layer in range(mlp.depth - 1):
        u = act(jnp.einsum("...i,oi->...o", u, params[layer]["w"]))
        hidden.append(u)
    return hidden


@jax.jit
def dormant_fraction(activations: jax.Array, tau: float = 0.0) -> jax.Array:
    """Fraction of tau-dormant units of one layer (Sokar et al. 2023, "The Dormant Neuron
    Phenomenon in Deep Reinforcement Learning"), a scalar.

    For activations ``h (N, units)``: ``score_i = mean_n |h_ni| / ((1/units) sum_j mean_n |h_nj|)``
    and unit ``i`` is dormant if ``score_i <= tau``. ``tau = 0`` counts only units exactly zero on
    every input, the usual threshold for ReLU; smooth activations (GELU, SiLU, tanh) are almost
    never exactly zero, so use a small positive threshold there, e.g. 0.025 or 0.1. An all-zero
    layer has every unit dormant (1.0). One layer; vmap over a batch of layers.
    """
    mean_abs = jnp.mean(jnp.abs(activations), axis=0)
    layer_mean = jnp.mean(mean_abs)
    alive = layer_mean > 0
    # The 0/0 of an all-zero layer gives score 0, so every unit counts as dormant, without NaN.
    score = jnp.where(alive, mean_abs / jnp.where(alive, layer_mean, 1.0), 0.0)
    return jnp.mean(score <= tau)


def early_late_gap(first_session_losses: Any, early: int | None = None) -> dict[str, Any]:
    """Loss of plasticity over a long stream (Dohare et al. 2024, "Loss of plasticity in deep
    continual learning"; Lyle et al. 2023, "Understanding plasticity in neural networks").

    ``first_session_losses (P,)`` or ``(P, S)``: the online loss of the first session(s) of each
    new task phase, phases in stream order, ``P >= 2``. The first ``early`` phases (default
    ``P // 2``) are early, the rest late. Returns Python floats, for reports:
    ``{"early": mean of the early phases, "late": mean of the late ones, "gap": late - early,
    "per_phase": [P per-phase means]}``; a positive gap means learning a new task got harder
    later in the stream.
    """
    losses = np.asarray(first_session_losses)
    if losses.ndim not in (1, 2) or losses.shape[0] < 2:
        raise ValueError(
            f"early_late_gap needs losses (P,) or (P, S) with P >= 2, got {losses.shape}"
        )
    phases = losses.shape[0]
    early = phases // 2 if early is None else early
    if not 1 <= early <= phases - 1:
        raise ValueError(
            f"early_late_gap: early={early} must be in [1, {phases - 1}] for P={phases}"
        )
    per_phase = losses if losses.ndim == 1 else np.mean(losses, axis=1)
    early_mean = float(np.mean(per_phase[:early]))
    late_mean = float(np.mean(per_phase[early:]))
    return {
        "early": early_mean,
        "late": late_mean,
        "gap": late_mean - early_mean,
        "per_phase": [float(x) for x in per_phase],
    }


def _lead_dims(level, params) -> int:
    """Leading (batch, head) dims of a level's state ``params`` over one memory's."""
    one = jax.eval_shape(level.memory.init, jax.random.key(0))
    return jax.tree.leaves(params)[0].ndim - jax.tree.leaves(one)[0].ndim


def state_change(program, before, after) -> dict[str, dict[str, Any]]:
    """Per level of ``program``, how its fast state changed from ``before`` to ``after`` (two
    fast states of the model): ``relative_change`` and ``change_norm`` (means over memories),
    and per layer of the memory the ``effective_rank`` and ``stable_rank`` of the change of its
    weight matrix (means over memories)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for a, b in zip(level_states(before), level_states(after), strict=True):
        lead = _lead_dims(program.system[a.level], a.params)
        deltas = [y["w"] - x["w"] for x, y in zip(a.params, b.params, strict=True)]
        mean = lambda x: float(jnp.mean(x))
        rows.setdefault(a.level, []).append(
            {
                "relative_change": mean(relative_change(a.params, b.params, lead)),
                "change_norm": mean(change_norm(a.params, b.params, lead)),
                "effective_rank": [mean(effective_rank(d)) for d in deltas],
                "stable_rank": [mean(stable_rank(d)) for d in deltas],
            }
        )
    return {
        name: {k: np.mean([r[k] for r in calls], axis=0).tolist() for k in calls[0]}
        for name, calls in rows.items()
    }


class _Keys:
    """Probe: runs the selected levels as declared and keeps each call's keys and end state."""

    def __init__(self, names: set[str]):
        self.names = names
        self.calls: list[tuple[str, jax.Array, Any]] = []

    def selects(self, level) -> bool:
        return level.name in self.names

    def run(self, level, state, ctx):
        with probes.probing(None):
            o, state = inner.run(level, state, ctx)
        self.calls.append((level.name, ctx.k, state.params))
        return o, state


def dormant_units_fn(program, *, tau: float = 0.0):
    """``(params, fast, batch) -> {level: (layers,) array}``, jitted: per MLP-memory level with
    a local objective, the fraction of tau-dormant hidden units (:func:`dormant_fraction`,
    each hidden layer) of the state it reaches on ``batch`` from ``fast``, on that batch's
    keys; means over memories and calls. None when no level has hidden units."""
    names = set()
    for level in program.system.fast_levels:
        mlp = getattr(level.memory, "memory", level.memory)
        if isinstance(mlp, memories.MLP) and mlp.depth > 1 and not level.learns_outer_loss:
            names.add(level.name)
    if not names:
        return None

    @jax.jit
    def run(params, fast, batch):
        recorder = _Keys(names)
        fast = program.start_fast(params, batch["inputs"].shape[0], fast)
        with probes.probing(recorder):
            program.apply(params, batch["inputs"], fast)
        out: dict[str, list] = {}
        for name, keys, end in recorder.calls:
            memory = program.system[name].memory

            def one(p, k, memory=memory):  # one memory: p without lead dims, k (T, d_k)
                layers = hidden_activations(memory, p, k)
                return jnp.stack([dormant_fraction(h, tau) for h in layers])

            per_memory = jax.vmap(jax.vmap(one, in_axes=(0, 1)))(end, keys)  # (B, H, layers)
            out.setdefault(name, []).append(jnp.mean(per_memory, axis=(0, 1)))
        return {name: jnp.mean(jnp.stack(v), axis=0) for name, v in out.items()}

    return run


def dormant_units(program, params, fast, batch, *, tau: float = 0.0) -> dict[str, list[float]]:
    """:func:`dormant_units_fn` once: ``{level: fraction per hidden layer}``; levels without
    hidden units or that cannot be probed (run inside a scan of the model) are left out."""
    return _dormant(dormant_units_fn(program, tau=tau), params, fast, batch)


def _dormant(fn, params, fast, batch) -> dict[str, list[float]]:
    if fn is None:
        return {}
    try:
        out = fn(params, fast, {k: batch[k] for k in ("inputs", "targets", "mask")})
    except ValueError:  # a level the model runs inside a scan: nothing to measure call by call
        return {}
    return {name: np.asarray(v).tolist() for name, v in out.items()}


def long_stream(
    deployment,
    batch_of: Callable[[int, int], dict],
    tasks: Sequence[int],
    *,
    cycles: int,
    sessions: int,
    session_length: int,
    tau: float = 0.0,
    progress: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Plasticity over a long deployment: the task sequence ``tasks`` repeated ``cycles`` times,
    each phase ``sessions`` sessions of ``session_length`` new batches, the fast state carried
    throughout. Per phase: the online loss of its first session (per row: the first-session
    losses :func:`early_late_gap` compares early and late), the :func:`state_change` over that
    session and the :func:`dormant_units` at its end. Returns ``{"phases": task per phase,
    "first_session_loss", "early_late", "state_change", "dormant"}``."""
    program, params = deployment.program, deployment.params
    fast, index = deployment.fresh(), 0
    dormant_fn = dormant_units_fn(program, tau=tau)  # compiled once for every phase
    phases, first, changes, dormant = [], [], [], []
    for _ in range(cycles):
        for task in tasks:
            for session in range(sessions):
                batches = [batch_of(task, index + n) for n in range(session_length)]
                index += session_length
                before = fast
                fast, parts = deployment.session(fast, batches)
                progress()
                if session == 0:
                    phases.append(int(task))
                    losses = sum(p["loss"] for p in parts) / sum(p["count"] for p in parts)
                    first.append(losses)
                    changes.append(state_change(program, before, fast))
                    dormant.append(_dormant(dormant_fn, params, before, batches[-1]))
    first = np.stack(first)  # (P, rows)
    return {
        "phases": phases,
        "first_session_loss": first.mean(axis=1).tolist(),
        "early_late": early_late_gap(first),
        "state_change": changes,
        "dormant": dormant,
    }
