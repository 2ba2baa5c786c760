"""The built-in kernels: each op of :mod:`nested.ops` registered
(:func:`nested.core.kernels.register`) with the declarations it implements and the examples
that prove it. Imported by
:mod:`nested.core.kernels`, so :func:`~nested.core.kernels.find` always sees them; a new kernel
of the library goes here (WORKSPACE.md, "Adding a rule").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from nested.core.kernels import (
    Kernel,
    Run,
    after_write,
    clips_in_chunks,
    lr_is,
    memory_is,
    objective_is,
    online,
    register,
    requires,
    retains,
    rule_is,
    untruncated,
)
from nested.core.level import Level, LevelState
from nested.learn import memories, objectives, rules
from nested.ops.atlas import AtlasState, atlas
from nested.ops.delta import delta_rule, gated_delta_rule, linear_attention
from nested.ops.falcon import falcon
from nested.ops.gdn2 import gdn2
from nested.ops.titans import titans, titans_state
from nested.ops.ttt_linear import ttt_linear
from nested.ops.ttt_mlp import ttt_mlp

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
