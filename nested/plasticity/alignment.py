"""Update alignment: does a fast level's online update help what comes after it?

The first-order analysis of functional plasticity: a fast level with
state ``theta`` makes an update at the end of each update period (every ``every`` tokens),
with ``g`` the gradient of its own objective on the period's context (summed over the
period's tokens, each taken at the period-start state, as the rule takes it) and ``delta``
the change the rule actually applied over the period (gates, momentum, retention and decay
included). With ``J`` the outer objective of what comes after,

    J(theta - eta g) ~ J(theta) - eta <grad J, g>,

so ``local = <grad J, g>`` > 0 says a step on the local objective lowers the future loss
(alignment) and < 0 that it raises it (interference); likewise ``update = -<grad J, delta>``
is the first-order decrease of ``J`` the applied update buys. Their cosines divide by
``|grad J| |g|`` and ``|grad J| |delta|``.

How it is measured, every update of every probed level from one backward pass: the probed
levels run the generic inner loop (the definition every kernel is proven against), and at the
end of update ``u`` of each memory the period's end state becomes

    theta_u <- theta_u + s_u delta_u + d_u g_u,        (s_u = d_u = 0: values unchanged)

followed by an identity whose backward returns ``|dJ/dtheta_u|^2`` as the gradient of an input
``n_u``. Then ``dJ/ds_u = <grad J, delta_u>``, ``dJ/dd_u = <grad J, g_u>`` and ``dJ/dn_u =
|grad J|^2``, with ``grad J`` the gradient with respect to the state the next period starts
from: ``J`` counts the tokens after the update's period (a later token's loss depends on the
update only if it comes after it). No per-token copy of the state is formed.

Two forms (``form=``):

* ``"through_scan"``: the perturbation runs through everything that follows, so an update is
  credited with its later consequences: every later update of the probed levels (this level's,
  its other layers', the later batch's) is recomputed at the perturbed states and inputs, the
  meta-gradient of ``J`` along the update.
* ``"one_step"``: the seed's form, the effect of one update with every later update held at its
  value: every later update of every probed level, of every layer (every call), in the batch
  and in the later batch of ``future=``, is taken from its unperturbed inputs: its gradient at
  the unperturbed state, its context ``k``, ``v`` and gates (``stop_gradient`` of each), so its
  increment ``rule(g_t)`` (momentum included) keeps its value. The perturbation ``P`` of
  ``theta_u`` then reaches ``J`` only through the reads ``f_{theta_t + P_t}(q_t)`` of the
  tokens after the update (their queries ``q_t`` live: an earlier layer's perturbed reads
  reach a later layer's queries), with ``P_t = P``; a rule with terms linear in the state
  (retention ``a_t theta``, a decay ``-d_t theta``, their gates held) carries it as ``P_t =
  c_t ... c_{u+1} P``, ``c_t = a_t (1 - d_t)``, so only for a rule without them does every
  later change ``delta_t`` keep its value. Levels that are not probed (``levels=``) run as
  declared in both forms.

``J`` (``future=``): by default the outer objective of the same batch (its tokens after each
update); or the outer objective of a later batch (held out, or of a later task) run from the
fast state the batch leaves, which needs probed levels that carry their state across
sequences (``persist="stream"``). ``J`` is the objective as the outer level minimises it (a mean
over scored tokens), so inner products are in units of that mean; cosines are free of it.
Outer-loss levels (CMS blocks) and levels run inside a scan of the model (MemT turns, Hope's
chunks, memory-as-context segments) cannot be probed: a one-line error says so.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from nested.core import inner, probes

FORMS = ("through_scan", "one_step")
# The scalar figures of a level's summary (:func:`summarize`), as the training log keeps them.
SCALARS = (
    "local",
    "update",
    "cos_local",
    "cos_update",
    "conflict_local",
    "conflict_update",
    "total_update",
)
STATS = ("future_dot_update", "future_dot_local", "future_sq", "local_sq", "update_sq")


@jax.custom_vjp
def _norm_tap(tree, probe):
    """Identity in ``tree``; the gradient it returns for the scalar ``probe`` is the squared
    norm of ``tree``'s cotangent (forward value and every other gradient unchanged)."""
    return tree


def _norm_tap_fwd(tree, probe):
    return tree, probe


def _norm_tap_bwd(probe, cotangent):
    squared = sum(jnp.sum(jnp.square(c)) for c in jax.tree.leaves(cotangent))
    return cotangent, squared.astype(probe.dtype)


_norm_tap.defvjp(_norm_tap_fwd, _norm_tap_bwd)


def _vdot(a, b) -> jax.Array:
    return sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _perturb(start, end, local, x):
    """The update hook: ``end + s delta + d g`` then the norm tap (see the module docstring);
    the statistics of the forward pass: ``|g|^2``, ``|delta|^2``."""
    delta = jax.tree.map(jnp.subtract, end, start)
    out = jax.tree.map(
        lambda e, dl, g: e + x["scale"].astype(e.dtype) * dl + x["direction"].astype(e.dtype) * g,
        end,
        delta,
        local,
    )
    return _norm_tap(out, x["norm"]), {
        "local_sq": _vdot(local, local),
        "update_sq": _vdot(delta, delta),
    }


@dataclasses.dataclass(frozen=True)
class Call:
    """One inner-loop call of a probed level while the model ran: ``level``, its period
    ``every`` and shape ``(B, T, H)``; ``index``: the call's rank among the level's calls (a
    model of two layers calls its level twice)."""

    level: str
    index: int
    every: int
    shape: tuple[int, int, int]

    @property
    def updates(self) -> int:
        """U = ceil(T / every)."""
        return -(-self.shape[1] // self.every)

    @property
    def name(self) -> str:
        return f"{self.level}/{self.index}"


@functools.partial(jax.tree_util.register_dataclass, data_fields=STATS, meta_fields=("call",))
@dataclasses.dataclass(frozen=True)
class UpdateAlignment:
    """The figures of every update of one call, arrays ``(B, H, U)`` (see the module
    docstring), a pytree (``call`` static): ``future_dot_update = <grad J, delta>``,
    ``future_dot_local = <grad J, g>``, ``future_sq = |grad J|^2``, ``local_sq = |g|^2``,
    ``update_sq = |delta|^2``. Derived: :attr:`local`, :attr:`update`, :attr:`cos_local`,
    :attr:`cos_update`, :attr:`position`."""

    call: Call
    future_dot_update: np.ndarray
    future_dot_local: np.ndarray
    future_sq: np.ndarray
    local_sq: np.ndarray
    update_sq: np.ndarray

    @property
    def local(self) -> np.ndarray:
        """``<grad J, g>``: > 0 a step on the local objective lowers J (first order)."""
        return self.future_dot_local

    @property
    def update(self) -> np.ndarray:
        """``-<grad J, delta>``: the first-order decrease of J the applied update buys."""
        return -self.future_dot_update

    @property
    def cos_local(self) -> np.ndarray:
        return _cosine(self.local, self.future_sq, self.local_sq)

    @property
    def cos_update(self) -> np.ndarray:
        return _cosine(self.update, self.future_sq, self.update_sq)

    @property
    def position(self) -> np.ndarray:
        """``(U,)``: the last token of each update period."""
        T = self.call.shape[1]
        return np.minimum((np.arange(self.call.updates) + 1) * self.call.every, T) - 1

    @property
    def measured(self) -> np.ndarray:
        """``(B, H, U)`` bool: updates with a future (``grad J != 0``: a later token reads
        them) and a non-zero local gradient and change, the ones summaries count."""
        return (self.future_sq > 0) & (self.local_sq > 0) & (self.update_sq > 0)


def _cosine(dot, a_sq, b_sq):
    denominator = np.sqrt(a_sq * b_sq)
    return np.where(denominator > 0, dot / np.where(denominator > 0, denominator, 1.0), 0.0)


class _Discover:
    """Probe of the first (shape-only) pass: records each selected call, runs it as usual."""

    def __init__(self, selects: Callable[[Any], bool]):
        self.selects = selects
        self.calls: list[Call] = []
        self.contexts: list[Any] = []

    def run(self, level, state, ctx):
        index = sum(call.level == level.name for call in self.calls)
        self.calls.append(Call(level.name, index, level.every, ctx.k.shape[:3]))
        self.contexts.append(ctx.k)  # returned by the pass: a tracer from inside a scan raises
        return inner.run_generic(level, state, ctx)


class _Perturb:
    """Probe of the measuring pass: the generic loop with the perturbation hook, call by call
    in the order the first pass saw."""

    def __init__(self, selects, calls: list[Call], inputs: list[dict], fixed: bool):
        self.selects = selects
        self.calls, self.inputs, self.fixed = calls, inputs, fixed
        self.stats: list[dict] = []

    def run(self, level, state, ctx):
        n = len(self.stats)
        if n >= len(self.calls) or self.calls[n].level != level.name:
            raise RuntimeError(f"probed calls changed between passes at call {n} ({level.name})")
        hook = inner.UpdateHook(_perturb, self.inputs[n], fixed_gradients=self.fixed)
        o, state, stats = inner.run_hooked(level, state, _held(ctx) if self.fixed else ctx, hook)
        self.stats.append(stats)
        return o, state


def _held(ctx: inner.Context) -> inner.Context:
    """``ctx`` with the updates' inputs held: ``stop_gradient`` of ``k``, ``v`` and every gate
    (``(B, T, H, ...)``); the queries ``q`` stay live (the reads)."""
    stop = jax.lax.stop_gradient
    return ctx._replace(k=stop(ctx.k), v=stop(ctx.v), gates=jax.tree.map(stop, ctx.gates))


def _keep(start, end, local, x):
    return end, {}


class Holding:
    """Probe that runs the selected levels (names ``levels``, None: every level with a local
    objective) with every update held at its value and nothing measured: the generic loop with
    each gradient taken at the unperturbed state and the updates' inputs held (:func:`_held`).
    The ``one_step`` form runs a later batch (``future=``) under it."""

    def __init__(self, levels: Iterable[str] | None = None):
        self.selects = _selector(levels)

    def run(self, level, state, ctx):
        B, T, H = ctx.k.shape[:3]
        zeros = jnp.zeros((B, H, -(-T // level.every)), ctx.k.dtype)
        hook = inner.UpdateHook(_keep, zeros, fixed_gradients=True)
        o, state, _ = inner.run_hooked(level, state, _held(ctx), hook)
        return o, state


def _selector(levels: Iterable[str] | None) -> Callable[[Any], bool]:
    names = None if levels is None else frozenset(levels)

    def selects(level) -> bool:
        if level.learns_outer_loss:
            return False
        return names is None or level.name in names

    return selects


def discover(loss_fn: Callable[..., jax.Array], *args, levels: Iterable[str] | None = None):
    """The probed calls ``loss_fn(*args)`` makes (shapes only, nothing computed): a list of
    :class:`Call`. Raises ``ValueError`` when a selected level runs inside a scan of the model,
    or when ``levels`` names a level the model never runs."""
    probe = _Discover(_selector(levels))

    def traced(*args):
        with probes.probing(probe):
            loss = loss_fn(*args)
        return loss, probe.contexts

    try:
        jax.eval_shape(traced, *args)
    except jax.errors.UnexpectedTracerError as error:
        raise ValueError(
            f"a probed level of {sorted({c.level for c in probe.calls})} runs inside a scan "
            f"of the model; measure a level the model runs once per sequence"
        ) from error
    if levels is not None:
        missing = sorted(set(levels) - {call.level for call in probe.calls})
        if missing:
            raise ValueError(
                f"levels={sorted(levels)}: the model runs no inner loop of {missing} (a level "
                f"with a local objective that a memory layer runs); drop it or fix the name"
            )
    return probe.calls


def _zeros(calls: list[Call]) -> list[dict[str, jax.Array]]:
    """The probe inputs at zero (values unchanged): ``scale``, ``direction``, ``norm`` per call,
    ``(B, H, U)`` in the default float dtype."""
    dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
    return [
        {k: jnp.zeros((c.shape[0], c.shape[2], c.updates), dtype) for k in _INPUTS} for c in calls
    ]


_INPUTS = ("scale", "direction", "norm")


def _probed(loss_fn, args, levels, calls: list[Call], fixed: bool):
    """``inputs -> (J, per-call statistics)``: ``loss_fn(*args)`` with the probed calls
    perturbed by ``inputs``."""

    def probed(inputs):
        probe = _Perturb(_selector(levels), calls, inputs, fixed)
        with probes.probing(probe):
            loss = loss_fn(*args)
        return loss, probe.stats

    return probed


def measure(
    loss_fn: Callable[..., jax.Array],
    *args,
    levels: Iterable[str] | None = None,
    form: Literal["through_scan", "one_step"] = "through_scan",
) -> tuple[jax.Array, list[UpdateAlignment]]:
    """Alignment of every update of the probed levels with the loss ``loss_fn(*args)``.

    ``loss_fn`` runs the model (any function whose fast levels go through
    :func:`nested.core.inner.run`); ``levels``: the level names to probe (None: every level
    with a local objective it runs). Returns ``(J, one UpdateAlignment per call)``. Traces
    ``loss_fn`` twice (shapes, then the measurement); call it under ``jax.jit`` with static
    ``levels`` and ``form`` to compile it once. With ``form="one_step"`` every probed call
    ``loss_fn`` makes is held; a later batch it runs outside the probe (under
    ``probes.probing(...)``) is held only if it runs under :class:`Holding` (as
    :func:`program_loss` does with ``hold``).
    """
    if form not in FORMS:
        raise ValueError(f"form={form!r} is unknown; use one of {FORMS}")
    calls = discover(loss_fn, *args, levels=levels)
    if not calls:
        raise ValueError("the model runs no probed level (no fast level with a local objective)")
    probed = _probed(loss_fn, args, levels, calls, fixed=form == "one_step")
    (loss, stats), grads = jax.value_and_grad(probed, has_aux=True)(_zeros(calls))
    results = [
        UpdateAlignment(
            call,
            future_dot_update=g["scale"],
            future_dot_local=g["direction"],
            future_sq=g["norm"],
            local_sq=s["local_sq"],
            update_sq=s["update_sq"],
        )
        for call, g, s in zip(calls, grads, stats, strict=True)
    ]
    return loss, results


def to_numpy(results: list[UpdateAlignment]) -> list[UpdateAlignment]:
    """The results with host NumPy arrays (after a jitted :func:`measure`)."""
    return [
        dataclasses.replace(r, **{k: np.asarray(jax.device_get(getattr(r, k))) for k in STATS})
        for r in results
    ]


def summarize(results: list[UpdateAlignment], *, bins: int = 20) -> dict[str, dict]:
    """Per level (its calls together): over the measured updates (:attr:`UpdateAlignment.
    measured`), the mean of ``local`` and ``update``, of their cosines, the conflict rates
    (fraction of updates with ``local < 0``, with ``update < 0``), ``total_update``, the sum of
    ``update`` over all of them (``-dJ/de`` with every update of the level scaled by
    ``1 + e``: does more of this level's learning help, to first order?), histograms of the
    cosines over ``[-1, 1]`` and the means by update position (over rows, heads and calls)."""
    by_level: dict[str, list[UpdateAlignment]] = {}
    for r in to_numpy(results):
        by_level.setdefault(r.call.level, []).append(r)
    edges = np.linspace(-1.0, 1.0, bins + 1)
    out = {}
    for level, rs in by_level.items():
        pick = lambda f: np.concatenate([f(r)[r.measured] for r in rs])  # noqa: B023
        local, update = pick(lambda r: r.local), pick(lambda r: r.update)
        cos_local, cos_update = pick(lambda r: r.cos_local), pick(lambda r: r.cos_update)
        out[level] = {
            "updates": int(local.size),
            "local": _mean(local),
            "update": _mean(update),
            "cos_local": _mean(cos_local),
            "cos_update": _mean(cos_update),
            "conflict_local": _mean((local < 0).astype(float)),
            "conflict_update": _mean((update < 0).astype(float)),
            "total_update": float(np.sum(update)),
            "histogram": {
                "edges": edges.tolist(),
                "cos_local": np.histogram(cos_local, edges)[0].tolist(),
                "cos_update": np.histogram(cos_update, edges)[0].tolist(),
            },
            "by_position": _by_position(rs),
        }
    return out


def _by_position(rs: list[UpdateAlignment]) -> dict[str, list]:
    """Means over rows, heads and calls of each position's measured updates."""
    positions = sorted({int(p) for r in rs for p in r.position})
    table = {p: {"cos_local": [], "cos_update": [], "local": []} for p in positions}
    for r in rs:  # the properties compute over every update: once per result
        values = {name: getattr(r, name) for name in ("cos_local", "cos_update", "local")}
        measured = r.measured
        for u, p in enumerate(r.position):
            for name, value in values.items():
                table[int(p)][name].append(value[..., u][measured[..., u]])
    means = {
        name: [_mean(np.concatenate(table[p][name])) for p in positions]
        for name in ("cos_local", "cos_update", "local")
    }
    return {"position": positions, **means}


def _mean(a: np.ndarray) -> float:
    return float(np.mean(a)) if a.size else float("nan")


# -- programs ---------------------------------------------------------------------------------


def program_loss(program, params, batch: Mapping[str, Any], fast=None, future=None, *, hold=None):
    """``J`` of a compiled program: its outer objective on ``batch`` (``fast``: the carried
    fast state it starts from, None: fresh), or with ``future`` on that later batch, run from
    the fast state ``batch`` leaves (levels with ``persist="stream"`` carry it). The later batch
    runs as declared, or with ``hold`` (a :class:`Holding`) its levels' updates held."""
    loss, (_, fast) = program.loss(params, batch, fast)
    if future is None:
        return loss
    carried = program.start_fast(params, future["inputs"].shape[0], fast)
    with probes.probing(hold):  # not the measuring probe: the later batch is not measured
        return program.loss(params, future, carried)[0]


def check_levels(program, levels: Iterable[str] | None, *, future: bool) -> None:
    """One-line errors before anything is traced: unknown level names, outer-loss levels, and
    with a later batch as ``J`` levels that restart at every sequence."""
    fast = {level.name: level for level in program.system.fast_levels}
    names = sorted(fast) if levels is None else list(levels)
    for name in names:
        if name not in fast:
            raise ValueError(
                f"levels: no fast level {name!r}; the program's fast levels are {sorted(fast)}"
            )
        if levels is not None and fast[name].learns_outer_loss:
            raise ValueError(
                f"levels: {name!r} learns from the outer loss over its period (a CMS block): "
                f"alignment measures levels with a local objective; drop it"
            )
    if future:
        local = [n for n in names if not fast[n].learns_outer_loss]
        restart = [n for n in local if fast[n].persist != "stream"]
        if restart:
            raise ValueError(
                f"future: level(s) {restart} restart at every sequence (persist='sequence'), "
                f"so their updates never reach a later batch; use the batch itself as J "
                f"(future=None) or set persist='stream'"
            )


def measure_program(
    program,
    params,
    batch,
    *,
    fast=None,
    future=None,
    levels: Iterable[str] | None = None,
    form: Literal["through_scan", "one_step"] = "through_scan",
):
    """:func:`measure` with ``J = program_loss(program, params, batch, fast, future)``, the
    later batch's updates held with ``form="one_step"``; checks ``levels`` and ``future``
    first (:func:`check_levels`). Returns ``(J, results)``."""
    check_levels(program, levels, future=future is not None)
    batch = program.check_batch(batch)
    if future is not None:
        future = program.check_batch(future)
        if future["inputs"].shape[0] != batch["inputs"].shape[0]:
            raise ValueError(
                f"future: {future['inputs'].shape[0]} rows, the batch has "
                f"{batch['inputs'].shape[0]}; a later batch continues each row's stream"
            )
    hold = Holding(levels) if form == "one_step" else None
    return measure(
        lambda p, b, f, fu: program_loss(program, p, b, f, fu, hold=hold),
        params,
        batch,
        fast,
        future,
        levels=levels,
        form=form,
    )


def linearization(
    loss_fn: Callable[..., jax.Array],
    *args,
    removals: list[tuple[int, int, int, int]],
    levels: Iterable[str] | None = None,
) -> dict[str, np.ndarray]:
    """The first-order prediction next to the actual change, for chosen updates.

    ``removals``: ``(call, row, head, update)`` indices. For each, the actual change
    ``J(with the update) - J(without it)`` (its change ``delta`` removed: ``s_u = -1``, the rest
    of the model rerun, through the scan) and the prediction ``<grad J, delta>`` at ``s = 0``.
    Where they differ, the update is too large for the first-order picture. Returns
    ``{"predicted": (K,), "actual": (K,)}``.
    """
    calls = discover(loss_fn, *args, levels=levels)
    probed = _probed(loss_fn, args, levels, calls, fixed=False)
    zeros = _zeros(calls)
    (base, _), grads = jax.jit(jax.value_and_grad(probed, has_aux=True))(zeros)
    loss_of = jax.jit(lambda inputs: probed(inputs)[0])
    predicted, actual = [], []
    for call, b, h, u in removals:
        removed = [dict(x) for x in zeros]
        removed[call]["scale"] = removed[call]["scale"].at[b, h, u].set(-1.0)
        actual.append(float(base - loss_of(removed)))
        predicted.append(float(grads[call]["scale"][b, h, u]))
    return {"predicted": np.array(predicted), "actual": np.array(actual)}
