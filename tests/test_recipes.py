"""Every rule: its generic level path (objective + update rule stepped by the scheduler)
equals its fast form (the chunked op), values and gradients, float64, odd lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_configs

import nested as nl
from nested.core import inner
from nested.run import config as nc

B, H, DK, DV = 2, 2, 4, 3


def context(level, T, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3 + len(level.gates))
    k = jax.random.normal(keys[0], (B, T, H, level.memory.d_k))
    gates = {}
    for key, (name, gate) in zip(keys[3:], sorted(level.gates.items()), strict=True):
        size = () if gate.size is None else (getattr(level.memory, gate.size),)
        gates[name] = gate.activate(jax.random.normal(key, (B, T, H, *size)))
    return inner.Context(
        k=k / jnp.linalg.norm(k, axis=-1, keepdims=True),
        v=jax.random.normal(keys[1], (B, T, H, level.memory.d_v)),
        q=jax.random.normal(keys[2], (B, T, H, level.memory.d_k)),
        gates=gates,
    )


def start_state(level):
    """Random initial memories, a non-zero momentum (or other optimizer state) where the rule
    has one, and a full window of earlier samples where the objective reads a window."""
    keys = jax.random.split(jax.random.key(9), B * H)
    W0 = jax.tree.map(
        lambda p: 0.5 * p.reshape(B, H, *p.shape[1:]), jax.vmap(level.memory.init)(keys)
    )
    state = inner.initial_state(level, W0)
    state = state.replace(opt_state=jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), state.opt_state))
    if state.cache is not None:
        earlier = context(level, inner.window_size(level) - 1, seed=5)
        window = {
            "k": jnp.moveaxis(earlier.k, 1, 2),
            "v": jnp.moveaxis(earlier.v, 1, 2),
            "gate": jnp.moveaxis(earlier.gates[level.objective.gate], 1, 2),
        }
        state = state.replace(cache={"window": window})
    return W0, state


def compare(level, T, rtol=1e-9):
    ctx = context(level, T)
    W0, state = start_state(level)

    def path(generic):
        def f(ctx, W0):
            o, final = inner.run(level, state.replace(params=W0), ctx, generic=generic)
            return o, (final.params, final.opt_state, final.cache)

        return f

    fast, generic = path(False), path(True)
    for a, b in zip(jax.tree.leaves(fast(ctx, W0)), jax.tree.leaves(generic(ctx, W0)), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-11)

    def functional(f):
        def loss(ctx, W0):
            o, final = f(ctx, W0)
            return jnp.sum(jnp.sin(o)) + sum(jnp.sum(x**2) for x in jax.tree.leaves(final))

        return jax.grad(loss, argnums=(0, 1))(ctx, W0)

    grads = [functional(fast), functional(generic)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol * 10, atol=1e-10)


LINEAR = ["hebbian", "delta", "gated_delta", "falcon", "gdn2"]


@pytest.mark.parametrize("rule", LINEAR)
@pytest.mark.parametrize(("T", "chunk"), [(13, None), (13, 4), (1, None)])
def test_linear_rule_generic_path_equals_its_op(rule, T, chunk):
    compare(nl.recipes.RULES[rule](d_k=DK, d_v=DV, chunk=chunk), T)


@pytest.mark.parametrize("every", [4, 5])
def test_minibatch_delta_is_ttt_linear(every):
    compare(nl.recipes.delta(d_k=DK, d_v=DV, every=every), 13)


NEURAL = [
    ("ttt_linear", {"every": 4}),
    ("ttt_mlp", {"every": 4, "hidden": 5}),
    ("titans", {"depth": 1, "every": 1}),
    ("titans", {"depth": 2, "hidden": 5, "every": 4}),
    ("titans", {"depth": 2, "hidden": 5, "every": 4, "read": "chunk_start"}),
    ("atlas", {"window": 3, "degree": 2, "depth": 2, "hidden": 5, "ns_steps": 0, "every": 4}),
    ("atlas", {"window": 2, "degree": 1, "depth": 1, "ns_steps": 2, "every": 1}),
]


@pytest.mark.parametrize(("rule", "kwargs"), NEURAL)
def test_neural_rule_generic_path_equals_its_op(rule, kwargs):
    d = kwargs.pop("d", 3)
    compare(nl.recipes.RULES[rule](d_k=d, d_v=d, **kwargs), 11, rtol=1e-8)


STREAMED = [
    ("titans", {"depth": 2, "hidden": 5, "every": 2}),
    ("atlas", {"window": 3, "degree": 2, "depth": 2, "hidden": 5, "ns_steps": 0, "every": 2}),
    ("atlas", {"window": 4, "degree": 1, "depth": 1, "ns_steps": 2, "every": 1}),
]


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize(("rule", "kwargs"), STREAMED)
def test_a_stream_split_across_calls_equals_one_call(rule, kwargs, generic):
    """The carried state (momentum, and the Omega window's last samples) continues the stream:
    ATLAS's first windows of the second call reach back into the first."""
    level = nl.recipes.RULES[rule](d_k=3, d_v=3, **kwargs)
    ctx = context(level, 10)
    _, state = start_state(level)
    whole, final = inner.run(level, state, ctx, generic=generic)
    part = lambda a, b: jax.tree.map(lambda x: x[:, a:b], ctx)
    first, middle = inner.run(level, state, part(0, 4), generic=generic)
    second, end = inner.run(level, middle, part(4, 10), generic=generic)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), whole, rtol=1e-9)
    for a, b in zip(jax.tree.leaves(end), jax.tree.leaves(final), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    if state.cache is not None:  # the stream's last c - 1 samples
        c = inner.window_size(level)
        np.testing.assert_array_equal(
            end.cache["window"]["k"], jnp.moveaxis(ctx.k, 1, 2)[..., 11 - c :, :]
        )


def test_fast_forms_fall_back_where_the_op_does_not_apply():
    level = nl.recipes.gated_delta(d_k=DK, d_v=DV, read="chunk_start")
    ctx = context(level, 6)
    state = inner.initial_state(level, {"W": jnp.zeros((B, H, DV, DK))})
    a = inner.run(level, state, ctx)[0]
    b = inner.run(level, state, ctx, generic=True)[0]
    np.testing.assert_array_equal(a, b)


def test_titans_step_range_shrinks_with_the_chunk_and_is_configurable():
    gate = nl.recipes.titans(d_k=4, d_v=4, every=16).gates["lr"]  # default 0.1 / every
    assert (gate.scale, gate.init) == (0.00625, 0.003125)
    assert float(gate.activate(jnp.asarray(30.0))) == pytest.approx(0.00625)
    assert nl.recipes.titans(d_k=4, d_v=4).gates["lr"].scale == 0.1
    assert nl.recipes.titans(d_k=4, d_v=4, every=16, lr_scale=0.5).gates["lr"].scale == 0.5
    config = nc.load(f"{tiny_configs.path('char_lm')}:titans")
    config.levels.memory.lr_scale = 0.01  # --config.levels.memory.lr_scale=0.01
    assert nc.build(config).system["memory"].gates["lr"].scale == 0.01
