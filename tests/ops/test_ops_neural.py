"""Type II ops (TTT-MLP, Titans, ATLAS) against per-token references: values and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import reference_neural as ref

from nested import ops
from nested.ops import chunk_coefficients, chunk_scan

B, H, DK, DV, HIDDEN = 2, 2, 3, 3, 5
FORM = {"activation": "gelu", "residual_norm": False, "norm_eps": 1e-6}


# Test data from numpy's generator: jax.random would compile a sampler for every new shape.
def normal(seed, shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape))


def uniform(seed, shape, lo, hi):
    return jnp.asarray(np.random.default_rng(seed).uniform(lo, hi, shape))


def make_inputs(t, seed=0, d_k=DK, d_v=DV):
    k = normal(seed + 1, (B, t, H, d_k))
    return {
        "q": normal(seed, (B, t, H, d_k)),
        "k": k / jnp.linalg.norm(k, axis=-1, keepdims=True),
        "v": normal(seed + 2, (B, t, H, d_v)),
        "lr": uniform(seed + 3, (B, t, H), 0.05, 0.4),
        "momentum": uniform(seed + 4, (B, t, H), 0.1, 0.95),
        "decay": uniform(seed + 5, (B, t, H), 0.0, 0.2),
        "gates": uniform(seed + 6, (B, t, H), 0.1, 1.0),
    }


def make_params(seed=1, d_in=DK, d_out=DV, hidden=HIDDEN, bias=True):
    """A memory with a different draw per (batch, head) and non-zero biases."""
    widths = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    dims = (d_in, *widths, d_out)
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        layer = {"w": normal(seed + 10 * i, (B, H, fan_out, fan_in), fan_in**-0.5)}
        if bias:
            layer["b"] = normal(seed + 10 * i + 1, (B, H, fan_out), 0.1)
        layers.append(layer)
    return tuple(layers)


def small(tree, seed):
    leaves, tree_def = jax.tree.flatten(tree)
    return jax.tree.unflatten(
        tree_def, [normal(seed + i, x.shape, 0.1) for i, x in enumerate(leaves)]
    )


def assert_tree_close(a, b, rtol=1e-9, atol=1e-11):
    """Leaf by leaf; atol is relative to the leaf's largest entry (at least 1): rounding in a
    different summation order (the dual forms') scales with the largest terms, not each entry."""

    def close(x, y):
        scale = max(1.0, float(np.max(np.abs(y), initial=0.0)))
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol * scale)

    jax.tree.map(close, a, b)


TTT = jax.jit(ops.ttt_mlp, static_argnames=("chunk_size",))
TITANS = jax.jit(ops.titans, static_argnames=("chunk_size", "read"))
ATLAS = jax.jit(ops.atlas, static_argnames=("chunk_size", "read", "window", "muon_steps"))


def value_and_vjp(fn, args, cot):
    """fn(*args) and its VJP for cotangent ``cot``, compiled (with less optimisation: tests check
    numbers, not speed)."""

    def both(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(cot)

    return jax.jit(both)(*args)


def assert_same_vjp(fn, ref_fn, args, seed=7):
    """fn(*args) == ref_fn(*args), and their VJPs for one random cotangent."""
    ref_out, ref_vjp = jax.vjp(ref_fn, *args)
    cot = small(ref_out, seed)
    out, grads = value_and_vjp(fn, args, cot)
    assert_tree_close(out, ref_out)
    assert_tree_close(grads, ref_vjp(cot))


TTT_CASES = [
    # t, chunk, hidden, bias, activation, residual_norm
    (5, 4, HIDDEN, True, "gelu", False),
    pytest.param(19, 8, HIDDEN, True, "gelu", False, marks=pytest.mark.slow),
    (19, 1, (4, 6), False, "silu", True),
    (21, 1, HIDDEN, True, "gelu", False),  # online: a full block of 16, then a partial one
]


@pytest.mark.parametrize("t, chunk, hidden, bias, activation, residual_norm", TTT_CASES)
def test_ttt_mlp_matches_reference(t, chunk, hidden, bias, activation, residual_norm):
    x = make_inputs(t)
    args = (x["q"], x["k"], x["v"], x["lr"], make_params(hidden=hidden, bias=bias))
    fn = lambda q, k, v, lr, p: ops.ttt_mlp(
        q, k, v, lr, params=p, chunk_size=chunk, activation=activation, residual_norm=residual_norm
    )
    form = {"activation": activation, "residual_norm": residual_norm, "norm_eps": 1e-6}
    assert_same_vjp(fn, functools.partial(ref.ttt_mlp_ref, chunk_size=chunk, form=form), args)


TITANS_CASES = [
    (5, 8, "after_write"),
    (19, 1, "after_write"),
    pytest.param(19, 1, "chunk_start", marks=pytest.mark.slow),
    pytest.param(19, 8, "after_write", marks=pytest.mark.slow),
    (19, 4, "chunk_start"),
]


@pytest.mark.parametrize("t, chunk, read", TITANS_CASES)
def test_titans_matches_reference(t, chunk, read, monkeypatch):
    if chunk == 1:  # online blocks of 4 (the last partial), and the two-level remat of long
        # sequences: 5 blocks -> segments of 3
        monkeypatch.setattr(chunk_scan, "ONLINE_BLOCK", 4)
        monkeypatch.setattr(chunk_scan, "FLAT_CHUNKS", 3)
        assert chunk_scan.segment_size(5) == 3
    x = make_inputs(t)
    params = make_params()
    args = (x["q"], x["k"], x["v"], x["lr"], x["momentum"], x["decay"], params, small(params, 3))

    def fn(q, k, v, lr, m, a, p, s):
        o, st = ops.titans(
            q, k, v, lr, m, a, state=ops.TitansState(p, s), chunk_size=chunk, read=read
        )
        return o, tuple(st)

    ref_fn = functools.partial(ref.titans_ref, chunk_size=chunk, read=read, form=FORM)
    assert_same_vjp(fn, ref_fn, args)


def _online_case(name):
    """(fn, args) of an online (chunk size 1) op on 9 tokens."""
    x = make_inputs(9)
    if name == "titans":  # momentum, decay, biases
        params = make_params()
        args = (x["q"], x["k"], x["v"], x["lr"], x["momentum"], x["decay"], params)

        def fn(q, k, v, lr, m, a, p, s):
            state = ops.TitansState(p, s)
            o, st = ops.titans(q, k, v, lr, m, a, state=state, chunk_size=1)
            return o, tuple(st)

        return fn, args + (small(params, 3),)
    # TTT-MLP, depth 3 with the residual LayerNorm head
    args = (x["q"], x["k"], x["v"], x["lr"], make_params(hidden=(4, 6), bias=False))
    fn = lambda q, k, v, lr, p: ops.ttt_mlp(
        q, k, v, lr, params=p, chunk_size=1, activation="silu", residual_norm=True
    )
    return fn, args


def _minibatch_scan_rule(carry, seq, *, chunk_size, form, read, window, clip=None):
    """``chunk_scan.scan_rule`` through the mini-batch step even at chunk size 1 (every
    gradient at the state before its token; plain autodiff, differentiable to any order)."""
    step = functools.partial(
        chunk_scan.minibatch_step, form=form, read=read, window=window, clip=clip
    )
    return chunk_scan.scan_chunks(step, carry, seq, chunk_size=chunk_size)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["titans", "ttt_mlp"])
def test_online_backward_is_differentiable(name, monkeypatch):
    """The online form's hand-written backward (``nested.ops.online``) differentiated again:
    the gradient of <VJP(cot), direction> w.r.t. every input equals autodiff's through the
    mini-batch path at chunk size 1, the same rule (what a meta-gradient through a level that
    itself takes gradients of the op computes)."""
    monkeypatch.setattr(chunk_scan, "ONLINE_BLOCK", 4)  # blocks of 4: 3 blocks, last partial
    fn, args = _online_case(name)
    cot = small(jax.eval_shape(fn, *args), 7)
    direction = small(args, 8)

    def second_order_grad():
        """A new function each call: jit caches traces by function, and each path is traced."""

        def second_order(*args):
            out, vjp = jax.vjp(fn, *args)
            pairs = zip(jax.tree.leaves(vjp(cot)), jax.tree.leaves(direction), strict=True)
            return sum(jnp.vdot(g, d) for g, d in pairs), out

        grad = jax.grad(second_order, argnums=tuple(range(len(args))), has_aux=True)
        return jax.jit(grad)

    got = second_order_grad()(*args)
    with monkeypatch.context() as patch:
        patch.setattr(chunk_scan, "scan_rule", _minibatch_scan_rule)
        expected = second_order_grad()(*args)
    assert_tree_close(got, expected)


def poly2(x):
    return jnp.concatenate([x, x * x / 2], axis=-1)


ATLAS_CASES = [
    # t, chunk, window, muon_steps, feature map, read
    (19, 1, 3, 0, "poly", "after_write"),  # online
    (19, 4, 3, 2, None, "after_write"),  # Muon, windows across chunk boundaries
    (5, 4, 6, 0, None, "chunk_start"),  # window longer than a chunk and than the sequence
]


def atlas_args(t, window, phi, seed=0):
    x = make_inputs(t, seed)
    d_in = DK * 2 if phi is not None else DK
    params = make_params(d_in=d_in)
    buf = ops.atlas_state(params, window=window, d_k=DK)
    return (
        x["q"], x["k"], x["v"], x["lr"], x["momentum"], x["decay"], x["gates"],
        params,
        small(params, 3),
        normal(seed + 50, buf.keys.shape),
        normal(seed + 51, buf.values.shape),
        uniform(seed + 52, buf.gates.shape, 0.0, 1.0),
    )  # fmt: skip


@pytest.mark.parametrize("t, chunk, window, muon, phi, read", ATLAS_CASES)
def test_atlas_matches_reference(t, chunk, window, muon, phi, read):
    phi = poly2 if phi == "poly" else None
    args = atlas_args(t, window, phi)

    def fn(q, k, v, lr, m, a, g, *state):
        o, st = ops.atlas(
            q,
            k,
            v,
            lr,
            m,
            a,
            g,
            state=ops.AtlasState(*state),
            window=window,
            chunk_size=chunk,
            feature_map=phi,
            muon_steps=muon,
            read=read,
        )
        return o, tuple(st)

    def ref_fn(q, k, v, lr, m, a, g, *state):
        return ref.atlas_ref(
            q,
            k,
            v,
            lr,
            m,
            a,
            g,
            state,
            window=window,
            chunk_size=chunk,
            phi=phi,
            muon_steps=muon,
            read=read,
            form=FORM,
        )

    assert_same_vjp(fn, ref_fn, args)


def test_init_mlp_memory():
    init = functools.partial(
        ops.init_mlp_memory, batch=2, heads=3, d_in=4, d_out=5, hidden=6, bias=True
    )
    params = jax.jit(init)(jax.random.key(0))
    shapes = [(2, 3, 6, 4), (2, 3, 5, 6)]
    assert [p["w"].shape for p in params] == shapes
    assert [p["b"].shape for p in params] == [s[:3] for s in shapes]
    assert params[0]["w"].dtype == jnp.float32 and not jnp.any(params[0]["b"])
    np.testing.assert_array_equal(params[1]["w"][0], params[1]["w"][1])  # shared over batch
    assert float(jnp.std(params[0]["w"])) == pytest.approx(4**-0.5, rel=0.3)
    x = normal(0, (2, 3, 8, 4)).astype(jnp.float32)
    h = jax.nn.gelu(jnp.einsum("bhoi,bhni->bhno", params[0]["w"], x))
    np.testing.assert_allclose(
        ops.mlp_apply(params, x), jnp.einsum("bhoi,bhni->bhno", params[1]["w"], h), rtol=1e-5
    )


def test_polynomial_features():
    x = jnp.array([[0.5, -2.0]])
    np.testing.assert_allclose(
        ops.polynomial_features(x, degree=3), [[0.5, -2.0, 0.125, 2.0, 0.5 / 24, -8.0 / 6]]
    )


@pytest.mark.parametrize("op", ["titans", "atlas"])
def test_streaming_equals_one_call(op):
    """Two calls with carried state (split on a chunk boundary) equal one call."""
    x = make_inputs(19)
    params = make_params()
    window = 3

    def call(sl, state):
        a = {n: y[:, sl] for n, y in x.items()}
        if op == "ttt_mlp":
            return TTT(a["q"], a["k"], a["v"], a["lr"], params=state, chunk_size=4)
        if op == "titans":
            return TITANS(
                a["q"],
                a["k"],
                a["v"],
                a["lr"],
                a["momentum"],
                a["decay"],
                state=state,
                chunk_size=4,
            )
        return ATLAS(
            a["q"],
            a["k"],
            a["v"],
            a["lr"],
            a["momentum"],
            a["decay"],
            a["gates"],
            state=state,
            window=window,
            chunk_size=4,
            muon_steps=2,
        )

    if op == "ttt_mlp":
        state = params
    elif op == "titans":
        state = ops.titans_state(params, small(params, 3))
    else:
        state = ops.atlas_state(params, window=window, d_k=DK, momentum=small(params, 3))
    o, final = call(slice(None), state)
    o1, mid = call(slice(0, 8), state)
    o2, final2 = call(slice(8, None), mid)
    assert_tree_close(jnp.concatenate([o1, o2], axis=1), o)
    assert_tree_close(final2, final)


def delta_setup(t=19):
    x = make_inputs(t)
    w0 = make_params(hidden=(), bias=False)
    return x, w0


def test_titans_depth1_is_delta_rule():
    """No momentum (m=0), no decay (a=0), h = beta: W += beta (v - W k) k^T."""
    x, w0 = delta_setup()
    zeros = jnp.zeros_like(x["lr"])
    state = ops.titans_state(w0, small(w0, 3))  # initial momentum is forgotten with m = 0
    o, st = TITANS(x["q"], x["k"], x["v"], x["lr"], zeros, zeros, state=state, chunk_size=1)
    ro, rw = ref.delta_rule_ref(x["q"], x["k"], x["v"], x["lr"], w0[0]["w"])
    assert_tree_close(o, ro)
    assert_tree_close(st.params[0]["w"], rw)


def test_ttt_mlp_depth1_is_delta_rule():
    x, w0 = delta_setup()
    o, p = TTT(x["q"], x["k"], x["v"], x["lr"], params=w0, chunk_size=1)
    ro, rw = ref.delta_rule_ref(x["q"], x["k"], x["v"], x["lr"], w0[0]["w"])
    assert_tree_close(o, ro)
    assert_tree_close(p[0]["w"], rw)


def test_matches_linear_ops_delta_rule():
    """Against the linear ops' chunked delta rule (same 1/2 loss constant)."""
    if not hasattr(ops, "delta_rule"):
        pytest.skip("nested.ops.delta_rule is not available")
    x, w0 = delta_setup()
    o_lin, w_lin = ops.delta_rule(
        x["q"], x["k"], x["v"], x["lr"], initial_state=w0[0]["w"], chunk_size=4
    )
    o, p = TTT(x["q"], x["k"], x["v"], x["lr"], params=w0, chunk_size=1)
    assert_tree_close(o, o_lin, rtol=1e-8, atol=1e-10)
    assert_tree_close(p[0]["w"], w_lin, rtol=1e-8, atol=1e-10)
    o, st = TITANS(
        x["q"], x["k"], x["v"], x["lr"], 0 * x["lr"], 0 * x["lr"], state=ops.titans_state(w0),
        chunk_size=1,
    )  # fmt: skip
    assert_tree_close(o, o_lin, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("read", ["after_write", "chunk_start"])
def test_atlas_window1_is_titans(read):
    """c=1, no phi, no Muon: Titans with the step outside the momentum. Equal when h is constant
    in time (S_titans = h S_atlas), and for any h when m = 0."""
    x = make_inputs(19)
    params = make_params()
    s0 = small(params, 3)
    h = jnp.broadcast_to(x["lr"][:, :1], x["lr"].shape)  # constant in time, per (batch, head)
    ones = jnp.ones_like(x["gates"])
    common = dict(chunk_size=4, read=read)
    o_t, st_t = TITANS(
        x["q"],
        x["k"],
        x["v"],
        h,
        x["momentum"],
        x["decay"],
        state=ops.titans_state(params, s0),
        **common,
    )
    h_bh = h[:, 0]  # (B, H)
    s0_atlas = jax.tree.map(lambda s: s / h_bh.reshape(h_bh.shape + (1,) * (s.ndim - 2)), s0)
    o_a, st_a = ATLAS(
        x["q"],
        x["k"],
        x["v"],
        h,
        x["momentum"],
        x["decay"],
        ones,
        state=(params, s0_atlas),
        **common,
    )
    assert_tree_close(o_a, o_t)
    assert_tree_close(st_a.params, st_t.params)
    scaled = jax.tree.map(
        lambda s: s * h_bh.reshape(h_bh.shape + (1,) * (s.ndim - 2)), st_a.momentum
    )
    assert_tree_close(scaled, st_t.momentum)

    zeros = jnp.zeros_like(x["lr"])
    o_t, st_t = TITANS(
        x["q"], x["k"], x["v"], x["lr"], zeros, x["decay"], state=ops.titans_state(params), **common
    )
    o_a, st_a = ATLAS(
        x["q"], x["k"], x["v"], x["lr"], zeros, x["decay"], ones, state=(params, s0), **common
    )
    assert_tree_close(o_a, o_t)
    assert_tree_close(st_a.params, st_t.params)


def test_decay_products_and_their_derivatives_equal_the_plain_products():
    """The chunk's decay matrix (written-out derivative) against prod(x[r+1 : t+1]) entry by
    entry, with zero and negative gates: values, reverse and forward derivatives, second order."""
    x = uniform(0, (2, 6), 0.2, 0.95).at[0, 2].set(0.0).at[1, 4].set(0.0).at[1, 0].set(-0.5)
    weights = normal(1, (2, 6, 6))

    def plain(x):
        rows = [[jnp.prod(x[..., r + 1 : t + 1], axis=-1) for r in range(6)] for t in range(6)]
        d = jnp.stack([jnp.stack(row, axis=-1) for row in rows], axis=-2)
        return jnp.tril(d)

    @jax.jit
    def derivatives(x):
        second = jax.hessian(lambda x: jnp.sum(weights * chunk_coefficients.products_below(x)))
        f = chunk_coefficients.products_below
        return f(x), jax.jacrev(f)(x), jax.jacfwd(f)(x), second(x)

    @jax.jit
    def plain_derivatives(x):
        second = jax.hessian(lambda x: jnp.sum(weights * plain(x)))
        return plain(x), jax.jacrev(plain)(x), jax.jacfwd(plain)(x), second(x)

    for got, want in zip(derivatives(x), plain_derivatives(x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_newton_schulz_is_nearly_orthogonal():
    for shape in [(3, 6, 10), (2, 10, 6)]:
        x = normal(0, shape)
        y = ops.newton_schulz(x, 5)
        sv = jnp.linalg.svd(y, compute_uv=False)
        # Muon's quintic coefficients trade exactness for speed: singular values near [0.7, 1.2]
        assert float(sv.min()) > 0.6 and float(sv.max()) < 1.25, sv
        u, _, vt = jnp.linalg.svd(x, full_matrices=False)
        cos = jnp.sum(y * (u @ vt), axis=(-2, -1)) / jnp.linalg.norm(y, axis=(-2, -1))
        assert float(cos.min()) > 0.95 * min(shape[-2:]) ** 0.5, cos
        want = jnp.stack([ref.newton_schulz(m, 5) for m in x])
        np.testing.assert_allclose(y, want, rtol=1e-10, atol=1e-12)
        unit = x / jnp.linalg.norm(x, axis=(-2, -1), keepdims=True)
        np.testing.assert_allclose(ops.newton_schulz(x, 0), unit, rtol=1e-10)


def test_float32_runs_in_float32():
    x = jax.tree.map(lambda a: a.astype(jnp.float32), make_inputs(13))
    params = jax.tree.map(lambda a: a.astype(jnp.float32), make_params())
    o, st = TITANS(
        x["q"],
        x["k"],
        x["v"],
        x["lr"],
        x["momentum"],
        x["decay"],
        state=ops.titans_state(params),
        chunk_size=4,
    )
    assert o.dtype == jnp.float32 and st.params[0]["w"].dtype == jnp.float32
    o64, _ = TITANS(
        *(x[n].astype(jnp.float64) for n in ("q", "k", "v", "lr", "momentum", "decay")),
        state=ops.titans_state(jax.tree.map(lambda a: a.astype(jnp.float64), params)),
        chunk_size=4,
    )
    # the memory dynamics amplify rounding (outputs reach ~10): compare at float32 precision
    np.testing.assert_allclose(o, o64, rtol=0, atol=2e-5 * float(jnp.abs(o64).max()))


def test_gradient_memory_does_not_store_per_token_params():
    """Backward temp memory grows with the number of chunks, not with tokens x params."""
    params = make_params(d_in=8, d_out=8, hidden=64)
    state = ops.titans_state(params)
    state_bytes = 2 * sum(a.nbytes for a in jax.tree.leaves(params))

    def temp_bytes(t, chunk):
        x = make_inputs(t, d_k=8, d_v=8)

        def loss(q):
            o, _ = ops.titans(
                q, x["k"], x["v"], x["lr"], x["momentum"], x["decay"], state=state,
                chunk_size=chunk,
            )  # fmt: skip
            return o.sum()

        compiled = jax.jit(jax.grad(loss)).lower(x["q"]).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    # 12 more chunks store one (theta, S) each plus O(T d) activations; per-token states
    # would add 192 of them.
    small_t, large_t = temp_bytes(64, 16), temp_bytes(256, 16)
    assert large_t - small_t < 24 * state_bytes, (small_t, large_t, state_bytes)
    # The online form (256 tokens in blocks of 16) keeps one state a block (23 in all), not 256.
    assert temp_bytes(256, 1) < 48 * state_bytes, state_bytes


def test_bad_inputs_raise():
    x = make_inputs(5)
    params = make_params()
    q, k, v, lr = x["q"], x["k"], x["v"], x["lr"]
    with pytest.raises(ValueError, match="chunk_size"):
        ops.ttt_mlp(q, k, v, lr, params=params, chunk_size=0)
    with pytest.raises(ValueError, match="lr"):
        ops.ttt_mlp(q, k, v, lr[:, :3], params=params, chunk_size=2)
    with pytest.raises(ValueError, match=r"`k` must have shape \(B, T, H, d_k\)"):
        ops.ttt_mlp(q[..., :2], k, v, lr, params=params, chunk_size=2)
    with pytest.raises(ValueError, match=r"params\[0\]\['w'\]"):
        ops.ttt_mlp(q, k, v, lr, params=make_params(d_in=4), chunk_size=2)
    with pytest.raises(ValueError, match="residual_norm"):
        ops.ttt_mlp(
            q, k, v[..., :2], lr, params=make_params(d_out=2), chunk_size=2, residual_norm=True
        )
    with pytest.raises(ValueError, match="activation"):
        ops.ttt_mlp(q, k, v, lr, params=params, chunk_size=2, activation="swish2")
    state = ops.titans_state(params)
    with pytest.raises(ValueError, match="read"):
        ops.titans(q, k, v, lr, lr, lr, state=state, chunk_size=2, read="before")
    with pytest.raises(ValueError, match="momentum"):
        ops.titans(q, k, v, lr, lr, lr, state=(params, params[:1]), chunk_size=2)
    with pytest.raises(ValueError, match="window"):
        ops.atlas(q, k, v, lr, lr, lr, lr, state=state, window=0)
    with pytest.raises(ValueError, match="buffer"):
        ops.atlas(
            q, k, v, lr, lr, lr, lr, state=ops.atlas_state(params, window=2, d_k=DK), window=3
        )
    with pytest.raises(ValueError, match="muon_steps"):
        ops.atlas(q, k, v, lr, lr, lr, lr, state=state, muon_steps=-1)


STREAM_OPS = {  # op, its positional inputs, its state keyword, extra keywords
    "ttt_mlp": (ops.ttt_mlp, ("q", "k", "v", "lr"), "params", {}),
    "ttt_linear": (ops.ttt_linear, ("q", "k", "v", "lr"), "initial_state", {}),
    "titans": (ops.titans, ("q", "k", "v", "lr", "momentum", "decay"), "state", {}),
    "titans_chunk_start": (
        ops.titans,
        ("q", "k", "v", "lr", "momentum", "decay"),
        "state",
        {"read": "chunk_start"},
    ),
    "atlas": (
        ops.atlas,
        ("q", "k", "v", "lr", "momentum", "decay", "gates"),
        "state",
        {"window": 3},
    ),
}


def stream_state(name):
    params = make_params()
    if name == "ttt_linear":
        return make_params(hidden=(), bias=False)[0]["w"]
    if name == "ttt_mlp":
        return params
    if name.startswith("titans"):
        return ops.titans_state(params, small(params, 3))
    return ops.atlas_state(params, window=3, d_k=DK, momentum=small(params, 3))


@pytest.mark.parametrize(
    ("name", "length", "cuts"),
    [
        pytest.param(name, 11, (3, 6), marks=[pytest.mark.slow] * (name == "atlas"))
        for name in STREAM_OPS
        if name != "titans"
    ]
    + [pytest.param("titans", 7, tuple(range(1, 7)), marks=pytest.mark.slow)],
)
def test_a_stream_cut_inside_chunks_equals_one_call(name, length, cuts):
    """Pieces through ops.stream (chunks of 4; cuts inside chunks, a piece across a boundary;
    Titans token by token): outputs, the final state (pending tokens applied) and input
    gradients equal one call. (ATLAS's window buffer crosses the cuts.)"""
    op, names, state_name, kwargs = STREAM_OPS[name]
    x, state = make_inputs(length), stream_state(name)
    call = lambda *a, s: op(*a, chunk_size=4, **{state_name: s}, **kwargs)

    def whole(x):
        return call(*(x[n] for n in names), s=state)

    def pieces(x):
        s, pending, outputs = state, None, []
        for lo, hi in zip((0, *cuts), (*cuts, length), strict=True):
            o, s, pending = ops.stream(
                op,
                *(x[n][:, lo:hi] for n in names),
                pending=pending,
                chunk_size=4,
                **{state_name: s},
                **kwargs,
            )
            outputs.append(o)
        final = s if pending is None else call(*pending, s=s)[1]
        return jnp.concatenate(outputs, axis=1), final

    o_shape, final_shape = jax.eval_shape(whole, x)
    # the gradient of sum(o * weights) w.r.t. x: the VJP of (weights, 0)
    cotangent = (normal(9, o_shape.shape), jax.tree.map(jnp.zeros_like, final_shape))

    @jax.jit  # one program for both, values and gradients: compiling dominates here
    def values_and_gradients(x):
        return [vjp(f, x) for f in (whole, pieces)]

    def vjp(f, x):
        out, pullback = jax.vjp(f, x)
        return out, pullback(cotangent)[0]

    ((o, final), grad), ((o_stream, final_stream), grad_stream) = values_and_gradients(x)
    assert_tree_close(o_stream, o)
    assert_tree_close(final_stream, final)
    assert_tree_close(grad_stream, grad)


def test_stream_needs_one_state_and_matching_pending():
    x = make_inputs(5)
    args = (x["q"], x["k"], x["v"], x["lr"])
    with pytest.raises(ValueError, match="exactly one of"):
        ops.stream(ops.ttt_mlp, *args, chunk_size=4)
    _, params, pending = ops.stream(ops.ttt_mlp, *args, chunk_size=4, params=make_params())
    with pytest.raises(ValueError, match=r"`pending` must hold one array per input \(3\), got 4"):
        ops.stream(ops.ttt_mlp, *args[:3], pending=pending, chunk_size=4, params=params)
