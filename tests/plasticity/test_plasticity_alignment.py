"""Update alignment equals the future loss's derivatives computed from a stream cut in two.

The reference cuts the stream at the end of update ``u``'s period: the first piece gives the
state ``theta_u`` (and the period-start state, from which ``g_u`` is summed token by token),
the second piece is run from a perturbed ``theta_u`` and scored. Finite differences and
``jax.grad`` of that second piece must give the probe's one-pass figures, in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.reference_inner import DK, DV, B, H, make_context

import nested as nl
from nested.core import inner, probes
from nested.nn.models import MemoryLM
from nested.plasticity import alignment

T = 7  # not a multiple of every=3: the last update period is partial


def delta(every=1):
    return nl.Level(
        "memory", nl.memories.Linear(DK, DV), nl.objectives.l2, nl.rules.sgd("beta"), every
    )


def mlp(every=1):
    memory = nl.memories.MLP(DK, DV, hidden=5)
    return nl.Level("memory", memory, nl.objectives.l2, nl.rules.sgd("beta"), every)


def start(level, seed=1):
    keys = jax.random.split(jax.random.key(seed), B * H)
    params = jax.vmap(level.memory.init)(keys)
    params = jax.tree.map(lambda p: 0.3 * p.reshape(B, H, *p.shape[1:]) + 0.1, params)
    return inner.initial_state(level, params)


def weights(seed=2):
    return jax.random.normal(jax.random.key(seed), (B, T, H, DV))


def score(o, w):
    """A loss of the reads, nonlinear so that first-order residuals are not zero."""
    return jnp.sum(w * o + 0.5 * o**2)


def piece(ctx, lo, hi):
    return jax.tree.map(lambda x: x[:, lo:hi], ctx)


def cut_reference(level, state, ctx, w, u, b, h):
    """``(theta_u, g_u, delta_u, J_after)`` of memory ``(b, h)`` and update ``u``: the state
    after the period, the period's summed local gradient, its change, and the loss of what
    follows as a function of memory ``(b, h)``'s ``theta_u``."""
    lo, hi = u * level.every, min((u + 1) * level.every, T)
    before = inner.run_generic(level, state, piece(ctx, 0, lo))[1] if lo else state
    after = inner.run_generic(level, state, piece(ctx, 0, hi))[1]
    one = lambda tree: jax.tree.map(lambda x: x[b, h], tree)
    items = {"k": ctx.k, "v": ctx.v, "q": ctx.q, **ctx.gates}
    g = None
    for t in range(lo, hi):
        item = jax.tree.map(lambda x: x[b, t, h], items)
        gt = inner.objective_grad(level, one(before.params), item)
        g = gt if g is None else jax.tree.map(jnp.add, g, gt)
    delta_u = jax.tree.map(jnp.subtract, one(after.params), one(before.params))

    def J_after(theta):
        params = jax.tree.map(lambda p, x: p.at[b, h].set(x), after.params, theta)
        o, _ = inner.run_generic(level, after.replace(params=params), piece(ctx, hi, T))
        return score(o, w[:, hi:])

    return one(after.params), g, delta_u, jax.jit(J_after)


def vdot(a, b):
    return sum(jnp.sum(x * y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def axpy(alpha, x, y):
    return jax.tree.map(lambda a, b: alpha * a + b, x, y)


@pytest.mark.parametrize(
    "level",
    [delta(), *(pytest.param(level, marks=pytest.mark.slow) for level in (mlp(), mlp(every=3)))],
    ids=["linear", "mlp", "mlp3"],
)
def test_alignment_equals_the_cut_streams_derivatives(level):
    ctx, state, w = make_context(T), start(level), weights()
    loss = lambda s: score(inner.run(level, s, ctx)[0], w)
    J, (result,) = jax.jit(lambda s: alignment.measure(loss, s))(state)
    assert result.future_dot_local.shape == (B, H, -(-T // level.every))
    np.testing.assert_allclose(J, loss(state), rtol=1e-12)  # values unchanged by the probe
    for u, b, h in [(0, 0, 0), (1, 1, 1)]:
        theta, g, d, J_after = cut_reference(level, state, ctx, w, u, b, h)
        grad = jax.jit(jax.grad(J_after))(theta)
        # The explicit inner products ...
        np.testing.assert_allclose(result.future_dot_local[b, h, u], vdot(grad, g), rtol=1e-9)
        np.testing.assert_allclose(result.future_dot_update[b, h, u], vdot(grad, d), rtol=1e-9)
        np.testing.assert_allclose(result.future_sq[b, h, u], vdot(grad, grad), rtol=1e-9)
        np.testing.assert_allclose(result.local_sq[b, h, u], vdot(g, g), rtol=1e-9)
        np.testing.assert_allclose(result.update_sq[b, h, u], vdot(d, d), rtol=1e-9)
        # ... and finite differences of the future loss along g and along delta.
        eps = 1e-6
        for direction, figure in [(g, result.future_dot_local), (d, result.future_dot_update)]:
            fd = (J_after(axpy(eps, direction, theta)) - J_after(axpy(-eps, direction, theta))) / (
                2 * eps
            )
            np.testing.assert_allclose(figure[b, h, u], fd, rtol=1e-6, atol=1e-9)
        # The first-order residual J(theta - eta g) - J(theta) + eta <grad J, g> shrinks as eta^2.
        residual = [
            J_after(axpy(-eta, g, theta)) - J_after(theta) + eta * result.local[b, h, u]
            for eta in (0.04, 0.02, 0.01)
        ]
        ratios = np.array(residual[:-1]) / np.array(residual[1:])
        np.testing.assert_allclose(ratios, 4.0, rtol=0.15)


@pytest.mark.slow
def test_one_step_holds_the_later_updates():
    """With the later updates held, the delta rule carries a perturbation v of theta_u to every
    later state unchanged: dJ/de = sum_{t > u} w_t . (v q_t) for J = sum_t w_t . o_t."""
    level, ctx, w = delta(), make_context(T), weights()
    state = start(level)
    loss = lambda s: jnp.sum(w * inner.run(level, s, ctx)[0])
    _, (result,) = jax.jit(lambda s: alignment.measure(loss, s, form="one_step"))(state)
    for u, b, h in [(0, 0, 0), (4, 1, 1)]:
        _, g, d, _ = cut_reference(level, state, ctx, w, u, b, h)
        reads = lambda v: sum(w[b, t, h] @ (v @ ctx.q[b, t, h]) for t in range(u + 1, T))
        np.testing.assert_allclose(result.future_dot_local[b, h, u], reads(g[0]["w"]), rtol=1e-9)
        np.testing.assert_allclose(result.future_dot_update[b, h, u], reads(d[0]["w"]), rtol=1e-9)
    _, (through,) = jax.jit(lambda s: alignment.measure(loss, s))(state)
    assert not np.allclose(through.future_dot_local[:, :, :-2], result.future_dot_local[:, :, :-2])


def two_tokens(query, target, beta=0.5):
    """One memory (B = H = 1), W_0 = 0: token 0 writes (k_0 -> v_0) with step beta, token 1 does
    not write (beta 0) and reads ``query``; J = 1/2 |o_1 - target|^2."""
    k0 = jnp.array([1.0, 0.0, 0.0])
    v0 = jnp.array([1.0, 2.0, 0.0, -1.0])
    level = nl.Level("memory", nl.memories.Linear(3, 4), nl.objectives.l2, nl.rules.sgd("beta"))
    state = inner.initial_state(level, ({"w": jnp.zeros((1, 1, 4, 3))},))
    ctx = inner.Context(
        k=jnp.stack([k0, k0])[None, :, None],
        v=jnp.stack([v0, v0])[None, :, None],
        q=jnp.stack([k0, query])[None, :, None],
        gates={"beta": jnp.array([[[beta], [0.0]]])},
    )
    target = target(v0)
    loss = lambda s: 0.5 * jnp.sum((inner.run(level, s, ctx)[0][0, 1, 0] - target) ** 2)
    _, (result,) = jax.jit(lambda s: alignment.measure(loss, s))(state)
    return result


def test_known_signs():
    same = two_tokens(jnp.array([1.0, 0.0, 0.0]), lambda v0: v0)  # the local objective again
    np.testing.assert_allclose(same.cos_local[0, 0, 0], 1.0, rtol=1e-12)
    np.testing.assert_allclose(same.cos_update[0, 0, 0], 1.0, rtol=1e-12)
    orthogonal = two_tokens(jnp.array([0.0, 1.0, 0.0]), lambda v0: v0)  # another key
    np.testing.assert_allclose(orthogonal.cos_local[0, 0, 0], 0.0, atol=1e-12)
    conflict = two_tokens(jnp.array([1.0, 0.0, 0.0]), lambda v0: -v0)  # the opposite value
    np.testing.assert_allclose(conflict.cos_local[0, 0, 0], -1.0, rtol=1e-12)
    assert conflict.local[0, 0, 0] < 0 and conflict.update[0, 0, 0] < 0
    summary = alignment.summarize([conflict])["memory"]
    assert summary["updates"] == 1 and summary["conflict_local"] == 1.0  # update 1: no future


def test_the_linearisation_error_is_second_order_in_the_update():
    """Removing an update of size ~eps: the first-order prediction misses by O(eps^2), so its
    relative error shrinks like eps (steps scaled by 1e-2, then 1e-3)."""
    level, ctx, w = delta(), make_context(T), weights()
    state = start(level)
    removals = [(0, 0, 0, 2), (0, 1, 1, 5)]
    errors = []
    for scale in (1e-2, 1e-3):
        scaled = ctx._replace(gates={"beta": scale * ctx.gates["beta"]})
        loss = lambda s, c=scaled: score(inner.run(level, s, c)[0], w)
        result = alignment.linearization(loss, state, removals=removals)
        errors.append(np.abs(result["predicted"] / result["actual"] - 1))
    assert np.all(errors[1] < errors[0] / 5), errors
    full = alignment.linearization(
        lambda s: score(inner.run(level, s, ctx)[0], w), state, removals=removals
    )
    assert np.all(np.abs(full["predicted"] / full["actual"] - 1) > errors[0])  # it shows


def tiny_program(persist="sequence", layers=2):
    memory = nl.recipes.delta("memory", d_k=8, d_v=8, persist=persist)
    backbone = nl.Level(
        "model",
        memory=lambda rngs: MemoryLM(memory, vocab=16, dim=16, heads=2, layers=layers, rngs=rngs),
        objective=nl.objectives.next_token,
        update=optax.sgd(0.1),
        every="step",
    )
    return nl.compile(nl.NestedSystem([backbone, memory], owners={"memory": "model"}))


def batch(seed, rows=2, length=9):
    tokens = jax.random.randint(jax.random.key(seed), (rows, length + 1), 0, 16)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((rows, length))}


@pytest.mark.slow
def test_a_program_measures_every_layer_and_a_later_batch():
    program = tiny_program(persist="stream")
    state = program.init(jax.random.key(0), batch_size=2)
    first, later = batch(1), batch(2)
    measure = jax.jit(
        lambda p, b, f, fu: alignment.measure_program(program, p, b, fast=f, future=fu)
    )
    J, results = measure(state.params, first, state.fast, None)
    assert [r.call.name for r in results] == ["memory/0", "memory/1"]
    # The model computes in float32: the probed generic loop and the kernel agree to rounding.
    np.testing.assert_allclose(J, program.loss(state.params, first, state.fast)[0], rtol=1e-6)
    summary = alignment.summarize(results)["memory"]
    assert 0 < summary["updates"] <= 2 * 2 * 2 * 9 and -1 <= summary["cos_local"] <= 1
    # J on the later batch: the last update's |grad J|^2 is that of the later batch's loss
    # with respect to the fast state the first batch leaves.
    _, results = measure(state.params, first, state.fast, later)
    fast = program.loss(state.params, first, state.fast)[1][1]

    def later_loss(fast):
        carried = program.start_fast(state.params, 2, fast)
        return program.loss(state.params, later, carried)[0]

    grads = jax.jit(jax.grad(later_loss))(fast)
    for layer, result in enumerate(results):
        w = grads[layer]["mixer"].params[0]["w"]  # (B, H, d_v, d_k)
        np.testing.assert_allclose(result.future_sq[..., -1], jnp.sum(w**2, (-2, -1)), rtol=1e-4)


def test_bad_requests_are_one_line_errors():
    program = tiny_program(layers=1)
    state = program.init(jax.random.key(0))
    with pytest.raises(ValueError, match=r"levels: no fast level 'memroy'.*\['memory'\]"):
        alignment.measure_program(program, state.params, batch(1), levels=["memroy"])
    with pytest.raises(ValueError, match=r"future: level\(s\) \['memory'\] restart.*persist"):
        alignment.measure_program(program, state.params, batch(1), future=batch(2))
    with pytest.raises(ValueError, match="form='two_step' is unknown"):
        alignment.measure_program(program, state.params, batch(1), form="two_step")


def f64(tree):
    return jax.tree.map(
        lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


class Recording:
    """Runs every call token by token (``every=1``) and records, per token ``t``, the change
    ``D_t`` the update made and the local gradient ``g_t``, leaves ``(B, H, T, ...)``."""

    def __init__(self):
        self.deltas, self.grads = [], []

    def selects(self, level):
        return True

    def run(self, level, state, ctx):
        items = {"k": ctx.k, "v": ctx.v, "q": ctx.q, **ctx.gates}
        grad = jax.vmap(jax.vmap(lambda p, item: inner.objective_grad(level, p, item)))
        deltas, grads, o = [], [], []
        for t in range(ctx.k.shape[1]):
            grads.append(grad(state.params, jax.tree.map(lambda x: x[:, t], items)))
            o_t, new = inner.run_generic(level, state, piece(ctx, t, t + 1))
            deltas.append(jax.tree.map(jnp.subtract, new.params, state.params))
            o.append(o_t)
            state = new
        stack = lambda trees: jax.tree.map(lambda *x: jnp.stack(x, 2), *trees)
        self.deltas.append(stack(deltas))
        self.grads.append(stack(grads))
        return jnp.concatenate(o, 1), state


class Replay:
    """Every call replays its recorded changes as constants, ``theta_t = theta_{t-1} + D_t``,
    reads ``o_t = f_{theta_t}(q_t)``, then adds ``s_t D_t + d_t g_t`` (``inputs``: the
    measured calls' ``scale`` and ``direction``, ``(B, H, T)``): every later update held."""

    def __init__(self, recording, inputs):
        self.recording, self.inputs, self.n = recording, inputs, 0

    def selects(self, level):
        return True

    def run(self, level, state, ctx):
        n, self.n = self.n, self.n + 1
        D, G = self.recording.deltas[n], self.recording.grads[n]
        params, o = state.params, []
        for t in range(ctx.k.shape[1]):
            params = jax.tree.map(lambda p, d: p + d[:, :, t], params, D)
            o.append(inner.read(level, params, ctx.q[:, t : t + 1]))
            if n < len(self.inputs):
                s, e = (self.inputs[n][k][:, :, t, None, None] for k in ("scale", "direction"))
                params = jax.tree.map(
                    lambda p, d, g: p + s * d[:, :, t] + e * g[:, :, t], params, D, G
                )
        return jnp.concatenate(o, 1), state.replace(params=params)


@pytest.mark.parametrize(
    "later", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["batch", "later_batch"]
)
def test_one_step_holds_every_later_update_of_every_layer(later):
    """Two layers, float64, J on the batch or on a later one: ``one_step`` equals the
    derivatives of J with every later update (this layer's, the other layer's, the later
    batch's) replayed as its recorded constant ``D_t``, by jax.grad of that replay for every
    update and by finite differences of it for some."""
    program = tiny_program(persist="stream", layers=2)
    state = program.init(jax.random.key(0), batch_size=2)
    params, fast = f64(state.params), f64(state.fast)
    first, future = batch(1, length=6), batch(2, length=6) if later else None

    def J(probe):
        with probes.probing(probe):
            loss, (_, end) = program.loss(params, first, fast)
            if future is None:
                return loss
            return program.loss(params, future, program.start_fast(params, 2, end))[0]

    def recorded():
        recording = Recording()
        return J(recording), (recording.deltas, recording.grads)

    recording = Recording()
    J0, (recording.deltas, recording.grads) = jax.jit(recorded)()
    zeros = [{k: jnp.zeros((2, 2, 6)) for k in ("scale", "direction")} for _ in range(2)]
    replay = jax.jit(lambda inputs: J(Replay(recording, inputs)))
    np.testing.assert_allclose(replay(zeros), J0, rtol=1e-12)
    reference = jax.jit(jax.grad(replay))(zeros)
    measure = jax.jit(
        lambda form: alignment.measure_program(
            program, params, first, fast=fast, future=future, form=form
        ),
        static_argnums=0,
    )
    J1, results = measure("one_step")
    np.testing.assert_allclose(J1, J0, rtol=1e-12)
    for result, ref in zip(results, reference, strict=True):
        np.testing.assert_allclose(result.future_dot_update, ref["scale"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(result.future_dot_local, ref["direction"], rtol=1e-9, atol=1e-12)
    # Finite differences of the replay along the scale of single updates, layer 1 and layer 2,
    # the last update among them (0 on the batch; with a later batch, its only future).
    eps = 1e-5
    for call, b, h, u in [(0, 0, 0, 1), (0, 1, 1, 4), (0, 1, 1, 5), (1, 1, 0, 2)]:
        bumped = lambda e: [  # noqa: B023
            {**x, "scale": x["scale"].at[b, h, u].set(e)} if i == call else x  # noqa: B023
            for i, x in enumerate(zeros)
        ]
        fd = (replay(bumped(eps)) - replay(bumped(-eps))) / (2 * eps)
        figure = results[call].future_dot_update[b, h, u]
        np.testing.assert_allclose(figure, fd, rtol=1e-7, atol=1e-12)
    # Holding them matters here: through the scan, layer 1's figures differ by a sizeable part.
    _, through = measure("through_scan")
    ref = np.asarray(reference[0]["scale"])
    assert np.abs(through[0].future_dot_update - ref).max() > 0.1 * np.abs(ref).max()
