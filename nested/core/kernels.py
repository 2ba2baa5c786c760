"""Kernels: the ops of :mod:`nested.ops` matched to the level declarations they implement.

A kernel computes a fast level's inner loop over a sequence, ``run(level, state, ctx) -> (o,
state)``, the same function as the generic path (:func:`nested.core.inner.run_generic`: the
level's objective differentiated and its rule stepped token by token), in closed or
chunkwise-parallel form. A kernel is never attached to a level. :func:`find` matches what the
level declares (memory, objective, update rule with its constants and gates, read, period,
truncation) against each registered kernel's ``mismatch``, which names the first field the
kernel does not implement (or returns None), so a level whose rule is replaced
(``dataclasses.replace(level, update=...)``) gets the kernel of its new declaration or none.

Every kernel carries ``examples``: levels it implements. ``tests/test_kernels.py`` runs each
registered kernel on each of its examples against the generic path (values and gradients,
float64, lengths that are not a multiple of the chunk), so registering a kernel registers its
proof. Kernels are tried in registration order; the first that matches runs.

The kernels here (state layout: every memory is a tuple of layers ``({"w": W}, ...)``, the
rule state a :class:`nested.rules.MomentumState`):

* ``linear_attention``: ``W += h_t v_t k_t^T`` (Dot objective, any period);
* ``delta_rule``: ``W += h_t (v_t - W k_t) k_t^T`` online, ``ttt_linear`` in mini-batches;
* ``gated_delta_rule``: the delta step after a log-space retention ``exp(a_t)``;
* ``falcon``: the delta step on the normalised ridge loss;
* ``gdn2``: MemT's decayed, erased write with a key-channel decay;
* ``neural_gradient_descent``: any MLP memory (``Linear`` as depth 1, polynomial features
  too) on the L2 loss under :class:`~nested.rules.GradientDescent` with optional momentum and
  decay (TTT-Linear, TTT-MLP, Titans), either read, any period;
* ``atlas``: the Omega rule (or L2) under :class:`~nested.rules.Muon`.

Document starts (packed language-model rows, flash-linear-attention's ``cu_seqlens``): a
context may carry ``starts`` (B, T), True where a new document starts, and ``initial``, the
state every such document starts from. A kernel with ``documents=True`` runs each document as
if alone (the first from the given state, every later one from ``initial``, update periods
counted from each document's start; outputs concatenated, the final state the last
document's), values and gradients, by splitting its chunks at the starts
(:mod:`nested.ops.documents`); ``tests/test_kernel_documents.py`` proves it on every example.
Every kernel here does (``atlas`` too: its Omega window holds none of an earlier document's
samples); for a context with starts the generic path runs in place of a kernel registered
without ``documents``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from nested.core.level import Level, LevelState
from nested.learn import memories, objectives, rules
from nested.ops.atlas import AtlasState, atlas
from nested.ops.delta import delta_rule, gated_delta_rule, linear_attention
from nested.ops.falcon import falcon
from nested.ops.gdn2 import gdn2
from nested.ops.titans import titans, titans_state
from nested.ops.ttt_linear import ttt_linear
from nested.ops.ttt_mlp import ttt_mlp

Run = Callable[[Level, LevelState, Any], tuple[jax.Array, LevelState]]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel: ``mismatch(level)`` is None when ``run`` implements the level exactly, else
    the reason it does not (one line, naming the field); ``examples()`` builds levels it
    implements, the cases of its equivalence test. ``documents``: ``run`` honours the
    context's document starts (``ctx.starts``, ``ctx.initial``) exactly, each document as if
    run alone; without, the generic path runs a context with starts."""

    name: str
    mismatch: Callable[[Level], str | None]
    run: Run
    examples: Callable[[], Sequence[Level]]
    documents: bool = False


KERNELS: list[Kernel] = []


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to the registry (tried after the ones before it)."""
    if any(k.name == kernel.name for k in KERNELS):
        raise ValueError(f"a kernel named {kernel.name!r} is already registered")
    if not kernel.examples():
        raise ValueError(f"kernel {kernel.name!r}: give at least one example level it implements")
    KERNELS.append(kernel)
    return kernel


def find(level: Level) -> tuple[Kernel | None, dict[str, str]]:
    """The first registered kernel implementing ``level``, and why each one before it does
    not (``{kernel name: reason}``; every kernel's reason when none matches)."""
    reasons = {}
    for kernel in KERNELS:
        reason = kernel.mismatch(level)
        if reason is None:
            return kernel, reasons
        reasons[kernel.name] = reason
    return None, reasons


# -- checks on a declaration (public: a kernel of your own states its conditions with them) --

Check = Callable[[Level], str | None]
"""A condition on a declaration: None if it holds, else the reason (one line)."""


def requires(*checks: Check) -> Check:
    """A kernel's ``mismatch``: the reason of the first check that fails, else None (a check
    may assume that the ones before it hold)."""

    def mismatch(level: Level) -> str | None:
        for check in checks:
            reason = check(level)
            if reason is not None:
                return reason
        return None

    return mismatch


def memory_is(*kinds: type) -> Check:
    """The memory is exactly one of ``kinds`` (``Featurized`` among them: with an inner
    memory of the others)."""

    def check(level: Level) -> str | None:
        memory, allowed = level.memory, kinds
        if isinstance(memory, memories.Featurized) and memories.Featurized in kinds:
            memory, allowed = memory.memory, tuple(k for k in kinds if k is not memories.Featurized)
        if type(memory) not in allowed:
            names = " or ".join(k.__name__ for k in allowed)
            return f"memory is {type(memory).__name__}, not {names}"
        return None

    return check


def objective_is(*kinds: type) -> Check:
    """The objective is exactly one of ``kinds`` (an Omega rule: over the L2 loss)."""

    def check(level: Level) -> str | None:
        objective = level.objective
        if type(objective) not in kinds:
            names = " or ".join(k.__name__ for k in kinds)
            return f"objective is {type(objective).__name__}, not {names}"
        if isinstance(objective, objectives.Omega) and type(objective.base) is not objectives.L2:
            return f"the Omega objective's base is {type(objective.base).__name__}, not L2"
        return None

    return check


def rule_is(kind: type, *, without: Sequence[str] = (), clips: bool = False) -> Check:
    """The rule is exactly ``kind``, has none of the parts ``without``, no gradient clip
    unless ``clips`` (the kernel clips), and every coefficient it has is one number per token
    and head (a constant or a scalar gate)."""

    def check(level: Level) -> str | None:
        rule = level.rule
        if type(rule) is not kind:
            return f"rule is {type(rule).__name__}, not {kind.__name__}"
        for part in without:
            if getattr(rule, part) is not None:
                return f"rule has {part}={getattr(rule, part)!r}; this kernel has no {part}"
        if getattr(rule, "clip", None) is not None and not clips:
            return f"rule clips its gradients (clip={rule.clip!r}); this kernel does not"
        for role in ("lr", "momentum", "decay"):
            spec = getattr(rule, role)
            if isinstance(spec, str) and level.gates[spec].size is not None:
                size = level.gates[spec].size
                return f"rule's {role} gate {spec!r} has size {size!r}, not scalar"
        return None

    return check


def lr_is(value: float) -> Check:
    def check(level: Level) -> str | None:
        lr = level.rule.lr
        return None if lr == value else f"rule has lr={lr!r}; this kernel steps with lr={value}"

    return check


def retains(size: str | None) -> Check:
    """The rule retains by a ``log_decay`` gate of ``size`` (None: scalar)."""

    def check(level: Level) -> str | None:
        name = level.rule.retain
        if name is None:
            return "rule has no retain gate"
        gate = level.gates[name]
        if (gate.kind, gate.size) != ("log_decay", size):
            return (
                f"retain gate {name!r} is ({gate.kind!r}, size {gate.size!r}); this kernel "
                f"takes ('log_decay', size {size!r})"
            )
        return None

    return check


def online(level: Level) -> str | None:
    return None if level.every == 1 else f"every={level.every}; this kernel updates every token"


def after_write(level: Level) -> str | None:
    return None if level.read == "after_write" else f"read={level.read!r}, not 'after_write'"


def clips_in_chunks(level: Level) -> str | None:
    """A gradient clip only with mini-batches: the online path (``every=1``) does not clip."""
    if getattr(level.rule, "clip", None) is not None and level.every == 1:
        return f"rule clips (clip={level.rule.clip!r}) at every=1; the online path does not clip"
    return None


def untruncated(level: Level) -> str | None:
    return None if level.truncate is None else f"truncate={level.truncate}; kernels do not cut"


# -- running a declaration through an op -------------------------------------------------------


def _per_token(spec: rules.GateSpec | None, ctx, default: float = 0.0) -> jax.Array:
    """A rule coefficient as ``(B, T, H)``: the gate's values, or the constant broadcast."""
    if isinstance(spec, str):
        return ctx.gates[spec]
    value = default if spec is None else spec
    return jnp.full(ctx.k.shape[:3], value, jnp.result_type(ctx.k, ctx.v))


def _documents(ctx) -> dict[str, Any]:
    """The document keywords of a linear op: ``starts`` (B, T) and ``start_state``, the
    memory of ``ctx.initial`` (B, H, d_v, d_k); none without starts."""
    if ctx.starts is None:
        return {}
    return {"starts": ctx.starts, "start_state": ctx.initial.params[0]["w"]}


def _on_matrix(op: Callable) -> Run:
    """Run ``op(level, W (B, H, d_v, d_k), ctx, **documents) -> (o, W)`` on a linear memory's
    state (its rule state is empty and there is no cache: the matrix is all a document
    restarts)."""

    def run(level: Level, state: LevelState, ctx):
        o, W = op(level, state.params[0]["w"], ctx, **_documents(ctx))
        return o, state.replace(params=({"w": W},))

    return run


def _hebbian_op(level, W, ctx, **documents):
    lr = level.rule.lr
    v = ctx.v if lr == 1.0 else _per_token(lr, ctx)[..., None] * ctx.v
    return linear_attention(ctx.q, ctx.k, v, initial_state=W, chunk_size=level.chunk, **documents)


def _delta_op(level, W, ctx, **documents):
    beta = _per_token(level.rule.lr, ctx)
    if level.every == 1:
        return delta_rule(
            ctx.q, ctx.k, ctx.v, beta, initial_state=W, chunk_size=level.chunk, **documents
        )
    return ttt_linear(
        ctx.q, ctx.k, ctx.v, beta, initial_state=W, chunk_size=level.every, **documents
    )


def _gated_delta_op(level, W, ctx, **documents):
    rule = level.rule
    beta = _per_token(rule.lr, ctx)
    log_alpha = ctx.gates[rule.retain]
    return gated_delta_rule(
        ctx.q,
        ctx.k,
        ctx.v,
        beta,
        log_alpha=log_alpha,
        initial_state=W,
        chunk_size=level.chunk,
        **documents,
    )


def _falcon_op(level, W, ctx, **documents):
    objective = level.objective
    return falcon(
        ctx.q,
        ctx.k,
        ctx.v,
        _per_token(level.rule.lr, ctx),
        ctx.gates[objective.lam],
        eps=objective.eps,
        initial_state=W,
        chunk_size=level.chunk,
        **documents,
    )


def _gdn2_op(level, W, ctx, **documents):
    objective, g = level.objective, ctx.gates
    return gdn2(
        ctx.q,
        ctx.k,
        ctx.v,
        g[objective.erase],
        g[objective.write],
        g[level.rule.retain],
        initial_state=W,
        chunk_size=level.chunk,
        scale=1.0,
        **documents,
    )


def _network(memory) -> tuple[Callable | None, dict[str, Any]]:
    """A neural memory as the ops take it: the key feature map (None: identity) and the
    network's form (``Linear`` is the one-layer network)."""
    phi = None
    if isinstance(memory, memories.Featurized):
        phi = partial(memories.polynomial_features, degree=memory.degree)
        memory = memory.memory
    if isinstance(memory, memories.MLP):
        return phi, {"activation": memory.activation, "residual_norm": memory.residual}
    return phi, {}


def _neural_gradient_descent(level: Level, state: LevelState, ctx):
    """TTT (no momentum, no decay, after-write reads) or the Titans op (momentum ``m = 0`` and
    decay ``a = 0`` where the rule has none: ``S_t = -h_t g_t`` is plain gradient descent).
    Documents restart the memory and the momentum (no cache)."""
    rule = level.rule
    phi, network = _network(level.memory)
    q, k = (ctx.q, ctx.k) if phi is None else (phi(ctx.q), phi(ctx.k))
    lr = _per_token(rule.lr, ctx)
    start, documents = ctx.initial, {} if ctx.starts is None else {"starts": ctx.starts}
    if rule.momentum is None and rule.decay is None and level.read == "after_write":
        if documents:
            documents["start_params"] = start.params
        o, params = ttt_mlp(
            q,
            k,
            ctx.v,
            lr,
            params=state.params,
            chunk_size=level.every,
            clip=rule.clip,
            **network,
            **documents,
        )
        return o, state.replace(params=params)
    if documents:
        documents["start_state"] = titans_state(start.params, start.opt_state.momentum)
    o, new = titans(
        q,
        k,
        ctx.v,
        lr,
        _per_token(rule.momentum, ctx),
        _per_token(rule.decay, ctx),
        state=titans_state(state.params, state.opt_state.momentum),
        chunk_size=level.every,
        read=level.read,
        clip=rule.clip,
        **network,
        **documents,
    )
    opt_state = state.opt_state if rule.momentum is None else rules.MomentumState(new.momentum)
    return o, state.replace(params=new.params, opt_state=opt_state)


def _atlas(level: Level, state: LevelState, ctx):
    rule, objective = level.rule, level.objective
    phi, network = _network(level.memory)
    omega = isinstance(objective, objectives.Omega)
    window = objective.window if omega else 1
    sample_gates = ctx.gates[objective.gate] if omega else jnp.ones_like(ctx.k[..., 0])

    def atlas_state_of(state: LevelState):
        if window == 1:
            return (state.params, state.opt_state.momentum)
        buffer = state.cache["window"]  # the last window - 1 samples (inner.initial_state)
        return AtlasState(
            state.params, state.opt_state.momentum, buffer["k"], buffer["v"], buffer["gate"]
        )

    documents = {}
    if ctx.starts is not None:
        documents = {"starts": ctx.starts, "start_state": atlas_state_of(ctx.initial)}
    start = atlas_state_of(state)
    o, new = atlas(
        ctx.q,
        ctx.k,
        ctx.v,
        _per_token(rule.lr, ctx),
        _per_token(rule.momentum, ctx),
        _per_token(rule.decay, ctx),
        sample_gates,
        state=start,
        window=window,
        chunk_size=level.every,
        feature_map=phi,
        muon_steps=rule.ns_steps,
        read=level.read,
        **network,
        **documents,
    )
    cache = state.cache
    if window > 1:
        cache = {**cache, "window": {"k": new.keys, "v": new.values, "gate": new.gates}}
    opt_state = rules.MomentumState(new.momentum)
    return o, state.replace(params=new.params, opt_state=opt_state, cache=cache)


# -- the registry -----------------------------------------------------------------------------


def _level(objective, update, memory=None, **fields) -> Level:
    return Level("memory", memory or memories.Linear(4, 3), objective, update, **fields)


def _linear_examples(objective, update, **fields) -> Callable[[], list[Level]]:
    return lambda: [
        _level(objective, update, **fields),
        _level(objective, update, chunk=4, **fields),
    ]


register(
    Kernel(
        "linear_attention",
        requires(
            memory_is(memories.Linear),
            objective_is(objectives.Dot),
            rule_is(rules.GradientDescent, without=("momentum", "decay", "retain")),
            after_write,
            untruncated,
        ),  # dot-product gradients do not depend on W: any period is the same rule
        _on_matrix(_hebbian_op),
        lambda: [
            *_linear_examples(objectives.dot, rules.sgd(1.0))(),
            _level(objectives.dot, rules.sgd("beta"), every=3),
        ],
        documents=True,
    )
)
register(
    Kernel(
        "delta_rule",
        requires(
            memory_is(memories.Linear),
            objective_is(objectives.L2),
            rule_is(rules.GradientDescent, without=("momentum", "decay", "retain")),
            after_write,
            untruncated,
        ),
        _on_matrix(_delta_op),
        lambda: [
            *_linear_examples(objectives.l2, rules.sgd("beta"))(),
            _level(objectives.l2, rules.sgd("beta"), every=4),
            _level(objectives.l2, rules.sgd(0.5), every=5),
        ],
        documents=True,
    )
)
_LOG_ALPHA = {"retain": rules.Gate("log_decay", init=math.log(0.95))}
register(
    Kernel(
        "gated_delta_rule",
        requires(
            memory_is(memories.Linear),
            objective_is(objectives.L2),
            rule_is(rules.GradientDescent, without=("momentum", "decay")),
            retains(None),
            online,
            after_write,
            untruncated,
        ),
        _on_matrix(_gated_delta_op),
        _linear_examples(
            objectives.l2, rules.sgd("beta", retain="log_alpha", gate_kinds=_LOG_ALPHA)
        ),
        documents=True,
    )
)
register(
    Kernel(
        "falcon",
        requires(
            memory_is(memories.Linear),
            objective_is(objectives.NormalizedRidge),
            rule_is(rules.GradientDescent, without=("momentum", "decay", "retain")),
            online,
            after_write,
            untruncated,
        ),
        _on_matrix(_falcon_op),
        _linear_examples(objectives.NormalizedRidge(), rules.sgd("beta")),
        documents=True,
    )
)
_KEY_DECAY = {"retain": rules.Gate("log_decay", init=-0.05, size="d_k")}
register(
    Kernel(
        "gdn2",
        requires(
            memory_is(memories.Linear),
            objective_is(objectives.ErasedL2),
            rule_is(rules.GradientDescent, without=("momentum", "decay")),
            lr_is(1.0),
            retains("d_k"),
            online,
            after_write,
            untruncated,
        ),
        _on_matrix(_gdn2_op),
        _linear_examples(
            objectives.ErasedL2(), rules.sgd(1.0, retain="log_decay", gate_kinds=_KEY_DECAY)
        ),
        documents=True,
    )
)


def _neural_examples() -> list[Level]:
    small = rules.Gate("unit", init=0.05, scale=0.1)
    gd = partial(rules.gradient_descent, "lr", gate_kinds={"lr": small})
    mlp = memories.MLP(3, 3, hidden=5)
    ttt = memories.MLP(3, 3, hidden=5, residual=True)
    return [
        _level(objectives.l2, gd(), memories.MLP(3, 3, hidden=3, depth=1, residual=True), every=4),
        _level(objectives.l2, gd(), ttt, every=4),
        _level(objectives.l2, gd(momentum="momentum"), ttt, every=2),  # issue 15's case
        _level(objectives.l2, gd(momentum="momentum", decay="decay"), memories.Linear(3, 3)),
        _level(objectives.l2, gd(momentum="momentum", decay="decay"), mlp, every=4),
        _level(objectives.l2, gd(momentum=0.9, decay="decay"), mlp, every=4, read="chunk_start"),
        _level(objectives.l2, gd(decay=0.01), mlp, every=3),
        _level(objectives.l2, gd(), mlp, every=4, read="chunk_start"),
        _level(
            objectives.l2,
            gd(momentum="momentum"),
            memories.Featurized(memories.MLP(6, 3, hidden=5), degree=2),
            every=2,
        ),
        # A clip small enough that most tokens' gradients are cut (and some not).
        _level(objectives.l2, gd(momentum="momentum", decay="decay", clip=0.3), mlp, every=4),
        _level(objectives.l2, gd(clip=0.3), ttt, every=3),
    ]


register(
    Kernel(
        "neural_gradient_descent",
        requires(
            memory_is(memories.Linear, memories.MLP, memories.Featurized),
            objective_is(objectives.L2),
            rule_is(rules.GradientDescent, without=("retain",), clips=True),
            clips_in_chunks,
            untruncated,
        ),
        _neural_gradient_descent,
        _neural_examples,
        documents=True,
    )
)


def _atlas_examples() -> list[Level]:
    small = {"lr": rules.Gate("unit", init=0.05, scale=0.1)}
    featurized = memories.Featurized(memories.MLP(6, 3, hidden=5), degree=2)
    return [
        _level(
            objectives.Omega(window=3),
            rules.muon(ns_steps=0, gate_kinds=small),
            featurized,
            every=4,
        ),
        _level(
            objectives.Omega(window=2),
            rules.muon(ns_steps=2, gate_kinds=small),
            memories.Linear(3, 3),
        ),
        # the online rule (every=1) over a window: its per-token window rows
        _level(objectives.Omega(window=3), rules.muon(ns_steps=0, gate_kinds=small), featurized),
        _level(
            objectives.l2,
            rules.muon(ns_steps=1, decay=None, gate_kinds=small),
            memories.MLP(3, 3, hidden=5),
            every=2,
            read="chunk_start",
        ),
    ]


register(
    Kernel(
        "atlas",
        requires(
            memory_is(memories.Linear, memories.MLP, memories.Featurized),
            objective_is(objectives.Omega, objectives.L2),
            rule_is(rules.Muon),
            untruncated,
        ),
        _atlas,
        _atlas_examples,
        documents=True,
    )
)
