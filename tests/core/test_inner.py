"""The generic inner loop equals plain per-token loops written from the equations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.reference_inner import DK, DV, delta_step, initial, make_context, reference

import nested as nl
from nested.core import inner


def gated_delta_step(W, S, k, v, W_start, g):
    a = g["alpha"]
    return a * W - g["beta"] * jnp.outer(a * W_start @ k - v, k), S


def titans_step(W, S, k, v, W_start, g):
    S = g["momentum"] * S - g["lr"] * jnp.outer(W_start @ k - v, k)
    return (1 - g["decay"]) * W + S, S


def clipped_titans_step(W, S, k, v, W_start, g, clip=1.5):
    grad = jnp.outer(W_start @ k - v, k)
    grad = grad * jnp.minimum(1.0, clip / jnp.linalg.norm(grad))
    S = g["momentum"] * S - g["lr"] * grad
    return (1 - g["decay"]) * W + S, S


CASES = {
    "delta": (nl.rules.sgd(lr="beta"), ("beta",), delta_step),
    "gated_delta": (nl.rules.sgd(lr="beta", retain="alpha"), ("beta", "alpha"), gated_delta_step),
    "titans": (
        nl.rules.gradient_descent("lr", momentum="momentum", decay="decay"),
        ("lr", "momentum", "decay"),
        titans_step,
    ),
    # Each token's gradient cut to norm 1.5 (|W k - v| is about 2 here: some are cut, some not).
    "titans_clipped": (
        nl.rules.gradient_descent("lr", momentum="momentum", decay="decay", clip=1.5),
        ("lr", "momentum", "decay"),
        clipped_titans_step,
    ),
    # The same rule composed by hand from the public gated blocks.
    "titans_from_blocks": (
        nl.rules.UpdateRule(
            optax.chain(
                nl.rules.scale_by_gate("lr", -1.0),
                nl.rules.trace_by_gate("momentum"),
                nl.rules.decay_by_gate("decay"),
            ),
            gates={name: nl.rules.Gate() for name in ("lr", "momentum", "decay")},
        ),
        ("lr", "momentum", "decay"),
        titans_step,
    ),
}


def functional_weights(o, W):
    """The weights (wo, wW) of a random linear functional sum(wo * o) + sum(wW * W) of the
    outputs and the final state, for gradient checks: its gradient w.r.t. (o, W), so the
    functional's gradient w.r.t. the inputs is the VJP of (wo, wW)."""
    wo = jax.random.normal(jax.random.key(7), o.shape)
    wW = jax.random.normal(jax.random.key(8), W.shape)
    return wo, wW


SHAPES = [(10, 1, 4), (10, 4, 8), (7, 3, 3)]  # (T, every, chunk): T never a multiple
PARAMS = [(case, *shape, "after_write") for case in sorted(CASES) for shape in SHAPES] + [
    ("delta", 1, 1, None, "after_write"),
    ("titans", 10, 1, None, "chunk_start"),
    ("titans", 10, 4, None, "chunk_start"),
]


@pytest.mark.parametrize(("case", "T", "every", "chunk", "read"), PARAMS)
def test_generic_level_equals_per_token_loop(case, T, every, chunk, read):
    rule, gate_names, step = CASES[case]
    level = nl.Level(
        "memory",
        memory=nl.memories.Linear(DK, DV),
        objective=nl.objectives.l2,
        update=rule,
        every=every,
        chunk=chunk,
        read=read,
    )
    ctx = make_context(T, gates=gate_names)
    state = initial(level)

    def ours(ctx, W0):
        o, final = inner.run(level, state.replace(params=({"w": W0},)), ctx, path="generic")
        return o, final.params[0]["w"]

    def theirs(ctx, W0):
        return reference(ctx, W0, every, step, read)

    W0 = state.params[0]["w"]
    weights = functional_weights(*jax.eval_shape(theirs, ctx, W0))

    @jax.jit  # one program for both sides, values and gradients: compiling dominates here
    def values_and_gradients(ctx, W0):
        results = []
        for f in (ours, theirs):
            out, pullback = jax.vjp(f, ctx, W0)
            results.append((out, pullback(weights)))
        return results

    (values, grads), (ref_values, ref_grads) = values_and_gradients(ctx, W0)
    for a, b in zip(values, ref_values, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-9, atol=1e-11)


def test_hebbian_is_one_step_of_lr_one_on_the_dot_objective():
    level = nl.Level(
        "memory",
        memory=nl.memories.Linear(DK, DV),
        objective=nl.objectives.dot,
        update=nl.rules.sgd(lr=1.0),
    )
    ctx = make_context(9, gates=())
    state = initial(level)
    o, final = inner.run(level, state, ctx, path="generic")
    W = state.params[0]["w"][:, :, None] + jnp.cumsum(
        jnp.einsum("bthv,bthk->bthvk", ctx.v, ctx.k), axis=1
    ).transpose(0, 2, 1, 3, 4)
    np.testing.assert_allclose(final.params[0]["w"], W[:, :, -1], rtol=1e-12)
    np.testing.assert_allclose(o, jnp.einsum("bhtvk,bthk->bthv", W, ctx.q), rtol=1e-12)


def test_optax_transformation_as_a_rule():
    """A plain optax optimizer (here sgd with momentum) is a fast level's rule, no gates."""
    level = nl.Level(
        "memory",
        memory=nl.memories.Linear(DK, DV),
        objective=nl.objectives.l2,
        update=optax.sgd(0.3, momentum=0.5),
    )
    ctx = make_context(6, gates=())

    def step(W, S, k, v, W_start, g):
        S = 0.5 * S + jnp.outer(W_start @ k - v, k)
        return W - 0.3 * S, S

    state = initial(level)
    o, final = inner.run(level, state, ctx, path="generic")
    o_ref, W_ref = reference(ctx, state.params[0]["w"], 1, step)
    np.testing.assert_allclose(o, o_ref, rtol=1e-10)
    np.testing.assert_allclose(final.params[0]["w"], W_ref, rtol=1e-10)


@pytest.mark.parametrize("every", [1, 4])
def test_streaming_two_calls_equal_one(every):
    rule, gate_names, _ = CASES["titans"]
    level = nl.Level(
        "memory",
        memory=nl.memories.Linear(DK, DV),
        objective=nl.objectives.l2,
        update=rule,
        every=every,
    )
    ctx = make_context(16, gates=gate_names)
    state = initial(level)

    @jax.jit  # one program (eagerly, every op compiles on its own: slower)
    def whole_and_split(state, ctx):
        o, final = inner.run(level, state, ctx, path="generic")
        first = jax.tree.map(lambda x: x[:, :8], ctx)
        second = jax.tree.map(lambda x: x[:, 8:], ctx)
        o1, mid = inner.run(level, state, first, path="generic")
        o2, end = inner.run(level, mid, second, path="generic")
        return o, final, o1, o2, end

    o, final, o1, o2, end = whole_and_split(state, ctx)
    np.testing.assert_allclose(jnp.concatenate([o1, o2], 1), o, rtol=1e-12)
    chex.assert_trees_all_close(end, final, rtol=1e-12)


def test_truncation_keeps_values_and_cuts_gradients():
    base = dict(
        memory=nl.memories.Linear(DK, DV),
        objective=nl.objectives.l2,
        update=nl.rules.sgd(lr="beta"),
    )
    full = nl.Level("memory", **base)
    cut = nl.Level("memory", **base, truncate=4)
    ctx = make_context(12)
    state = initial(full)

    def loss(level, k):
        o, _ = inner.run(level, state, ctx._replace(k=k), path="generic")
        return jnp.sum(o[:, -1] ** 2)  # the last token only

    @jax.jit  # one program (eagerly, every op compiles on its own: slower)
    def outputs_and_gradients(ctx):
        outputs = [inner.run(level, state, ctx, path="generic")[0] for level in (cut, full)]
        return outputs, [
            jax.grad(lambda k, level=level: loss(level, k))(ctx.k) for level in (full, cut)
        ]

    (o_cut, o_full), (g_full, g_cut) = outputs_and_gradients(ctx)
    np.testing.assert_allclose(o_cut, o_full)
    # The last window (tokens 8..11) keeps its gradient, earlier keys lose it.
    np.testing.assert_allclose(g_cut[:, 8:], g_full[:, 8:], rtol=1e-10)
    assert jnp.all(g_cut[:, :8] == 0) and jnp.any(g_full[:, :8] != 0)


def test_masked_tail_leaves_the_state_unchanged():
    """T not a multiple of the block: the padded tokens must not write."""
    level = nl.recipes.delta(d_k=DK, d_v=DV, chunk=8)
    ctx = make_context(9)
    state = initial(level)
    _, final9 = inner.run(level, state, ctx, path="generic")
    _, final_ref = reference(ctx, state.params[0]["w"], 1, delta_step)
    np.testing.assert_allclose(final9.params[0]["w"], final_ref, rtol=1e-12)


@pytest.mark.parametrize(
    "memory",
    [
        nl.memories.Linear(3, 4, init_scale=1.0),
        nl.memories.MLP(3, 4, hidden=5),
        nl.memories.MLP(4, 4, hidden=5, depth=3, residual=True),
        nl.memories.Featurized(nl.memories.MLP(6, 4, hidden=5), degree=2),
    ],
    ids=["linear", "mlp", "mlp_residual", "featurized"],
)
def test_a_memory_reads_rows_of_keys_as_it_reads_each_key(memory):
    params = memory.init(jax.random.key(0))
    keys = jax.random.normal(jax.random.key(1), (2, 5, memory.d_k))
    rows = memory.apply(params, keys)
    one_by_one = jnp.stack([jnp.stack([memory.apply(params, k) for k in row]) for row in keys])
    assert rows.shape == (2, 5, memory.d_v)
    np.testing.assert_allclose(rows, one_by_one, rtol=1e-12, atol=1e-12)
