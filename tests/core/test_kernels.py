"""Kernels equal the generic path of the declarations they claim, and only those.

Every registered kernel is run on each of its example levels (``Kernel.examples``) against
the generic inner loop, values and gradients, float64, lengths not a multiple of any chunk:
the cases come from the registry, so a newly registered kernel is checked here unedited.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.kernel_checks import compare, context, start_state

import nested as nl
from nested.core import inner, kernels

# With -m slow: the neural examples but the first and the clipped Titans (9), which share
# the machinery of the others; ATLAS's but one.
SLOW = {("neural_gradient_descent", i) for i in (*range(1, 9), 10)} | {("atlas", 0), ("atlas", 2)}
EXAMPLES = [
    pytest.param(
        kernel, i, id=f"{kernel.name}-{i}", marks=[pytest.mark.slow] * ((kernel.name, i) in SLOW)
    )
    for kernel in kernels.KERNELS
    for i in range(len(kernel.examples()))
]


@pytest.mark.parametrize(("kernel", "index"), EXAMPLES)
def test_every_kernel_equals_the_generic_path_on_its_examples(kernel, index):
    level = kernel.examples()[index]
    assert kernels.find(level)[0] is kernel, kernels.find(level)[1]
    compare(level, 11)


@pytest.mark.parametrize("rule", sorted(nl.recipes.RULES))
def test_every_named_rule_runs_a_kernel_that_equals_the_generic_path_on_one_token(rule):
    """Its gradients, and sequences of many chunks, are the examples' test above."""
    level = nl.recipes.RULES[rule](d_k=3, d_v=3)
    assert inner.kernel_for(level) is not None
    compare(level, 1, gradients=False)


def ttt_mlp_with(update):
    return dataclasses.replace(nl.recipes.ttt_mlp(d_k=3, d_v=3, every=2, hidden=4), update=update)


@pytest.mark.slow
def test_a_replaced_rule_runs_the_kernel_of_the_new_rule():
    """Issue 15: TTT-MLP with a momentum rule put in by hand ran the TTT kernel, which ignores
    momentum (outputs off by 0.49, no error); the kernel now follows the declaration."""
    lr = nl.recipes.bounded_lr(0.1)
    level = ttt_mlp_with(nl.rules.gradient_descent("lr", momentum="momentum", gate_kinds=lr))
    assert inner.kernel_for(level).name == "neural_gradient_descent"
    compare(level, 11, path="auto")


def test_decay_without_momentum_runs():
    """Issue 15: decay and no momentum raised AttributeError ('EmptyState' has no 'trace')."""
    lr = nl.recipes.bounded_lr(0.1)
    compare(ttt_mlp_with(nl.rules.gradient_descent("lr", decay="decay", gate_kinds=lr)), 11)


def test_a_declaration_no_kernel_implements_runs_the_generic_path_or_says_why():
    level = nl.recipes.gated_delta(d_k=3, d_v=3, read="chunk_start")
    assert inner.kernel_for(level) is None
    ctx = context(level, 6)
    _, state = start_state(level)
    np.testing.assert_array_equal(
        inner.run(level, state, ctx)[0], inner.run(level, state, ctx, path="generic")[0]
    )
    with pytest.raises(
        ValueError,
        match=r"level 'memory': no kernel implements.*gated_delta_rule: "
        r"read='chunk_start', not 'after_write'",
    ):
        inner.run(level, state, ctx, path="kernel")
    with pytest.raises(ValueError, match=r"path='fast' is unknown"):
        inner.run(level, state, ctx, path="fast")


@pytest.mark.parametrize(
    "update",
    [
        nl.rules.gradient_descent("lr", momentum="momentum", decay="decay"),
        nl.rules.sgd("lr", retain="retain"),
        nl.rules.muon("lr", ns_steps=1),
    ],
    ids=["momentum_decay", "retain", "muon"],
)
@pytest.mark.parametrize("rule", ["delta", "falcon", "gdn2", "titans"])
def test_any_rule_swapped_into_a_recipe_gives_the_generic_values(rule, update):
    """Whatever kernel (or none) the new declaration selects, it computes that declaration."""
    level = dataclasses.replace(nl.recipes.RULES[rule](d_k=3, d_v=3), update=update)
    ctx = context(level, 7)
    _, state = start_state(level)
    # one program for both paths (eagerly, every op compiles on its own: slower)
    chosen, generic = jax.jit(
        lambda state, ctx: [inner.run(level, state, ctx, path=p) for p in ("auto", "generic")]
    )(state, ctx)
    chex.assert_trees_all_close(chosen, generic, rtol=1e-8)


STREAMED = [
    ("titans", {"depth": 2, "hidden": 5, "every": 2}),
    ("atlas", {"window": 3, "degree": 2, "depth": 2, "hidden": 5, "ns_steps": 0, "every": 2}),
    ("atlas", {"window": 4, "degree": 1, "depth": 1, "ns_steps": 2, "every": 1}),
]


@pytest.mark.parametrize("path", ["auto", "generic"])
@pytest.mark.parametrize(("rule", "kwargs"), STREAMED)
def test_a_stream_split_across_calls_equals_one_call(rule, kwargs, path):
    """The carried state (momentum, and the Omega window's last samples) continues the stream:
    ATLAS's first windows of the second call reach back into the first."""
    level = nl.recipes.RULES[rule](d_k=3, d_v=3, **kwargs)
    ctx = context(level, 10)
    _, state = start_state(level)

    @jax.jit  # one program (eagerly, every op compiles on its own: slower)
    def whole_and_split(state, ctx):
        whole, final = inner.run(level, state, ctx, path=path)
        part = lambda a, b: jax.tree.map(lambda x: x[:, a:b], ctx)
        first, middle = inner.run(level, state, part(0, 4), path=path)
        second, end = inner.run(level, middle, part(4, 10), path=path)
        return whole, final, first, second, end

    whole, final, first, second, end = whole_and_split(state, ctx)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), whole, rtol=1e-9)
    chex.assert_trees_all_close(end, final, rtol=1e-9, atol=1e-12)
    if state.cache is not None:  # the stream's last c - 1 samples
        c = inner.window_size(level)
        np.testing.assert_array_equal(
            end.cache["window"]["k"], jnp.moveaxis(ctx.k, 1, 2)[..., 11 - c :, :]
        )


def test_a_kernel_is_registered_with_its_examples_and_a_new_name():
    delta = kernels.KERNELS[1]
    with pytest.raises(ValueError, match="'delta_rule' is already registered"):
        kernels.register(delta)
    with pytest.raises(ValueError, match="give at least one example"):
        kernels.register(dataclasses.replace(delta, name="other", examples=lambda: []))
