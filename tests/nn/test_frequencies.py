"""Memories of several frequencies on one layer's heads, and accumulated (period) rules."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_configs
from helpers.reference_inner import DK, DV, delta_step, initial, make_context, reference

import nested as nl
from nested.core import inner
from nested.nn.frequencies import MultiFrequencyMemory
from nested.nn.layers import MemoryLayer
from nested.nn.models import make_mixer
from nested.plasticity.budget import budget
from nested.plasticity.deployment import Deployment, task_batches
from nested.run import config as nc

DIM, HEADS, T = 8, 2, 11


def pieces(ctx, *cuts):
    """``ctx`` cut along time at ``cuts``."""
    edges = (0, *cuts, ctx.k.shape[1])
    spans = zip(edges, edges[1:], strict=False)
    return [jax.tree.map(lambda x, a=a, b=b: x[:, a:b], ctx) for a, b in spans]


def test_an_accumulated_delta_rule_equals_its_per_token_definition_across_calls():
    """Updates summed and applied every 4 tokens, reads at the last applied state: the
    mini-batch loop of ``test_inner.reference`` (gradients at the period's start), here with
    the stream cut into calls of 7 and 5 tokens, which the period spans."""
    level = nl.recipes.delta(d_k=DK, d_v=DV, accumulate=4, read="chunk_start")
    ctx = make_context(12)
    state = initial(level)
    reads, carried = [], state
    for piece in pieces(ctx, 7):
        o, carried = inner.run(level, carried, piece)
        reads.append(o)
    W0 = state.params[0]["w"]
    ref_o, ref_W = reference(ctx, W0, 4, delta_step, read="chunk_start")
    np.testing.assert_allclose(jnp.concatenate(reads, 1), ref_o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(carried.params[0]["w"], ref_W, rtol=1e-6, atol=1e-6)
    # after 6 tokens the memory holds the first period's sum; tokens 4-5 wait in the rule state
    _, mid = inner.run(level, state, pieces(ctx, 6)[0])
    first_period = reference(pieces(ctx, 4)[0], W0, 4, delta_step)[1]
    np.testing.assert_allclose(mid.params[0]["w"], first_period, rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(mid.params[0]["w"] - W0).max()) > 1e-3
    assert float(jnp.abs(jax.tree.leaves(mid.opt_state[1].acc_grads)[0]).max()) > 1e-3


def test_accumulating_a_rule_that_retains_is_refused():
    with pytest.raises(ValueError, match="retains by gate"):
        nl.rules.accumulated(nl.rules.sgd("beta", retain="alpha"), 4)
    with pytest.raises(ValueError, match="every=0"):
        nl.rules.accumulated(nl.rules.sgd("beta"), 0)
    with pytest.raises(ValueError, match="Level 'memory': accumulated: the rule retains"):
        nl.recipes.gated_delta(d_k=2, d_v=2, accumulate=4)
    with pytest.raises(ValueError, match="it takes every=1"):
        nl.recipes.delta(d_k=2, d_v=2, accumulate=4, every=2)


def layers(head_levels, consolidate=False, level=None):
    level = level or nl.recipes.delta("fast", d_k=DIM // HEADS, d_v=DIM // HEADS)
    one = MemoryLayer(level, dim=DIM, heads=HEADS, rngs=nnx.Rngs(0))
    many = MultiFrequencyMemory(
        level,
        head_levels=head_levels,
        consolidate=consolidate,
        dim=DIM,
        heads=HEADS,
        rngs=nnx.Rngs(0),
    )
    return one, many


def inputs(seed=0):
    return jax.random.normal(jax.random.key(seed), (2, T, DIM))


@pytest.mark.slow  # 13 s: the default suite keeps under 6 minutes
def test_heads_at_one_level_split_into_groups_equal_the_one_level_layer():
    """A second group whose level is declared like the first (another name): the outputs,
    their gradients and the final memories are the one-level layer's."""
    twin = nl.recipes.delta("twin", d_k=DIM // HEADS, d_v=DIM // HEADS)
    one, many = layers((twin,))
    x = inputs()

    def run(layer, x):
        y, state = layer(x, layer.initial_state(2))
        return jnp.sum(jnp.sin(y)), (y, state)

    (_, (y, state)), gx = jax.value_and_grad(run, argnums=1, has_aux=True)(one, x)
    (_, (y2, states)), gx2 = jax.value_and_grad(run, argnums=1, has_aux=True)(many, x)
    np.testing.assert_allclose(y2, y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gx2, gx, rtol=1e-10, atol=1e-12)
    w = jnp.concatenate([s.params[0]["w"] for s in states], axis=1)
    np.testing.assert_allclose(w, state.params[0]["w"], rtol=1e-12, atol=1e-12)
    assert [s.level for s in states] == ["fast", "twin"]


@pytest.mark.slow
@pytest.mark.parametrize("lr", [None, 0.3])
def test_a_slow_head_runs_its_own_level_on_its_heads(lr):
    """Head 0 per token, head 1 accumulated over 4 tokens, with the gate beta_t or a fixed
    step size: each head's reads are the plain per-token loops of ``test_inner.reference`` on
    that head's context (per token; chunks of 4 read at their start; beta_t = lr where it is
    fixed), and the slow head's differ from a per-token head's."""
    slow = nl.recipes.delta("slow", d_k=4, d_v=4, lr=lr, accumulate=4, read="chunk_start")
    one, many = layers((slow,))
    x = inputs(1)
    states = many.initial_state(2)
    ctx, _ = many.context(x, states[0].cache)
    expected = []
    for (every, read), (_, a, n), state in zip(
        ((1, "after_write"), (4, "chunk_start")), many.groups, states, strict=True
    ):
        part = jax.tree.map(lambda t, a=a, n=n: t[:, :, a : a + n], ctx)
        if every == 4 and lr is not None:
            part = part._replace(gates={"beta": jnp.full_like(part.gates["beta"], lr)})
        W0 = state.params[0]["w"]
        expected.append(reference(part, W0, every, delta_step, read=read)[0])
    y, _ = many(x, states)
    np.testing.assert_allclose(
        y, many.readout(jnp.concatenate(expected, 2), x), rtol=1e-6, atol=1e-6
    )
    y_one, _ = one(x, one.initial_state(2))
    assert float(jnp.abs(y - y_one).max()) > 1e-4


def test_a_consolidating_head_writes_the_fast_heads_keys_and_reads():
    """With consolidate=True the slow head's pairs are the fast head's keys and the fast
    memory's reads of them after each write, ``W_t k_t``, written out per token here."""
    slow = nl.recipes.delta("slow", d_k=4, d_v=4, read="chunk_start", accumulate=3)
    _, many = layers((slow,), consolidate=True)
    x = inputs(2)
    states = many.initial_state(2)
    ctx, _ = many.context(x, states[0].cache)
    W = states[0].params[0]["w"][:, 0]  # (B, d_v, d_k), the fast head's
    k, v, beta = ctx.k[:, :, 0], ctx.v[:, :, 0], ctx.gates["beta"][:, :, 0]
    recalled = []
    for t in range(T):
        error = jnp.einsum("bvk,bk->bv", W, k[:, t]) - v[:, t]
        W = W - beta[:, t, None, None] * jnp.einsum("bv,bk->bvk", error, k[:, t])
        recalled.append(jnp.einsum("bvk,bk->bv", W, k[:, t]))
    slow_ctx = inner.Context(
        k=k[:, :, None],
        v=jnp.stack(recalled, 1)[:, :, None],
        q=ctx.q[:, :, 1:],
        gates={"beta": ctx.gates["beta"][:, :, 1:]},
    )
    slow_o, slow_state = inner.run(slow, states[1], slow_ctx)
    fast_o, _ = inner.run(many.groups[0][0], states[0], jax.tree.map(lambda t: t[:, :, :1], ctx))
    y, new = many(x, states)
    np.testing.assert_allclose(y, many.readout(jnp.concatenate([fast_o, slow_o], 2), x), rtol=1e-10)
    np.testing.assert_allclose(new[1].params[0]["w"], slow_state.params[0]["w"], rtol=1e-10)
    np.testing.assert_allclose(new[0].params[0]["w"][:, 0], W, rtol=1e-6)  # float32 state


def test_bad_head_levels_are_one_error_each():
    gated = nl.recipes.gated_delta("other", d_k=4, d_v=4)
    with pytest.raises(ValueError, match="memory and gates of 'fast'"):
        layers((gated,))
    with pytest.raises(ValueError, match=r"lr=-1.0: a fixed step size is a number in \(0, 2\]"):
        nl.recipes.delta("slow", d_k=4, d_v=4, lr=-1.0)
    slow = nl.recipes.delta("slow", d_k=4, d_v=4)
    with pytest.raises(ValueError, match="name the levels of the other heads"):
        layers((), consolidate=True)
    with pytest.raises(ValueError, match="leave no head of heads=2 to level 'fast'"):
        layers((slow, slow))
    with pytest.raises(ValueError, match="mixer='gate' takes one level"):
        make_mixer(
            "gate", slow, dim=DIM, heads=HEADS, window=4, rngs=nnx.Rngs(0), head_levels=(slow,)
        )
    three = nl.recipes.delta("fast", d_k=2, d_v=2)
    with pytest.raises(ValueError, match="equal head counts"):
        MultiFrequencyMemory(
            three,
            head_levels=(nl.recipes.delta("slow", d_k=2, d_v=2),),
            consolidate=True,
            dim=DIM,
            heads=4,
            rngs=nnx.Rngs(0),
        )


@pytest.mark.slow  # 12 s
def test_the_layer_restarts_every_group_at_document_starts():
    """Packed documents equal the documents run alone (the accumulated head's period counted
    from each document's start)."""
    slow = nl.recipes.delta("slow", d_k=4, d_v=4, accumulate=3, read="chunk_start")
    _, many = layers((slow,))
    x = inputs(3)[:1]
    documents = jnp.array([[0] * 5 + [1] * 6])
    starts = inner.document_starts(documents)
    y, _ = many(x, many.initial_state(1), starts)
    alone = [many(x[:, a:b], many.initial_state(1))[0] for a, b in ((0, 5), (5, T))]
    np.testing.assert_allclose(y, jnp.concatenate(alone, 1), rtol=1e-10, atol=1e-12)
    chex.assert_tree_all_finite(y)


def test_the_multi_frequency_variants_spend_the_budget_of_one_level_at_equal_bytes():
    """configs/continual.py: every two-level variant has the slow-parameter count of
    ``one_level_wide`` within 2% and its carried bytes within 5% (the issue's tolerances),
    and the same parameter count as ``one_level`` exactly (same layer, other rules)."""
    path = tiny_configs.path("continual")
    spend = lambda variant: budget(nc.build(nc.load(f"{path}:{variant}")).program)
    wide, one = spend("one_level_wide"), spend("one_level")
    for variant in ("periods_1_8", "periods_1_128", "consolidate_1_32"):
        two = spend(variant)
        assert abs(two.slow_parameters / wide.slow_parameters - 1) < 0.02, variant
        assert abs(two.carried_bytes / wide.carried_bytes - 1) < 0.05, variant
        assert two.slow_parameters == one.slow_parameters
        # the memories (2 heads of 32 x 32 float32), the slow head's pending sum, two counters
        # and the convolution's last 3 inputs of 192 features
        assert two.carried_bytes == 2 * 4096 + 4096 + 8 + 3 * 192 * 4
    three, wider = spend("three_level"), spend("one_level_wider")
    assert abs(three.slow_parameters / wider.slow_parameters - 1) < 0.02
    assert abs(three.carried_bytes / wider.carried_bytes - 1) < 0.05


def test_a_level_reset_after_each_phase_restarts_only_that_level():
    """The ablation of ``transfer_matrix(reset=...)``: after a session, resetting the slow
    head leaves it fresh and the fast head as the session left it."""
    config = tiny_configs.override(
        nc.load(f"{tiny_configs.path('continual')}:periods_1_8"), tiny_configs.TINY["continual"]
    )
    experiment = nc.build(config)
    program = experiment.program
    deployment = Deployment(program, program.init(jax.random.key(0)).params, 2)
    batch = task_batches(experiment.task, 2)(0, 0)
    learned, _ = deployment.session(deployment.fresh(), [batch])
    reset = deployment.reset(learned, ("slow",))
    fresh = deployment.fresh()
    states = lambda fast: {
        s.level: s for s in jax.tree.leaves(fast, is_leaf=lambda x: hasattr(x, "level"))
    }
    chex.assert_trees_all_equal(states(reset)["slow"], states(fresh)["slow"])
    chex.assert_trees_all_equal(states(reset)["memory"], states(learned)["memory"])
    moved = states(learned)["memory"].params[0]["w"] - states(fresh)["memory"].params[0]["w"]
    assert float(jnp.abs(moved).max()) > 1e-4
