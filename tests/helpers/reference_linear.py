"""Per-token references for the linear-memory ops, written straight from their equations.

A Python loop over time on (B, H, d_v, d_k) states, one equation per rule; deliberately
independent of nested.ops (no chunking, no shared kernel) so that tests compare two derivations.
Each step (write, then read) is jitted on per-token slices, so it compiles once for all lengths,
and the loop stays in Python (an unrolled loop under one ``jit`` is slow to compile).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _outer(a, b):
    return a[..., :, None] * b[..., None, :]


def _matvec(w, x):
    return jnp.einsum("bhvk,bhk->bhv", w, x)


@functools.partial(jax.jit, static_argnums=0)
def _write_then_read(step, state, q_t, scale, *inputs_t):
    state = step(state, *inputs_t)
    return state, scale * _matvec(state, q_t)


def _run(step, state, q, scale, *inputs):
    """The loop over t: ``W_t = step(W_{t-1}, *inputs[:, t])``, ``o_t = scale W_t q_t``."""
    columns = [jnp.unstack(x, axis=1) for x in inputs]
    outs = []
    for t, q_t in enumerate(jnp.unstack(q, axis=1)):
        state, o_t = _write_then_read(step, state, q_t, scale, *(c[t] for c in columns))
        outs.append(o_t)
    return jnp.stack(outs, axis=1), state


def _hebbian_step(w, k, v):
    return w + _outer(v, k)


def hebbian(q, k, v, state, scale=1.0):
    """W_t = W_{t-1} + v_t k_t^T."""
    return _run(_hebbian_step, state, q, scale, k, v)


def _delta_step(w, k, v, beta):
    return w + beta[..., None, None] * _outer(v - _matvec(w, k), k)


def delta(q, k, v, beta, state, scale=1.0):
    """W_t = W_{t-1} + b_t (v_t - W_{t-1} k_t) k_t^T."""
    return _run(_delta_step, state, q, scale, k, v, beta)


def _gated_delta_step(w, k, v, beta, alpha):
    eye = jnp.eye(k.shape[-1], dtype=k.dtype)[None, None]
    b = beta[..., None, None]
    return alpha[..., None, None] * (w @ (eye - b * _outer(k, k))) + b * _outer(v, k)


def gated_delta(q, k, v, beta, alpha, state, scale=1.0):
    """W_t = a_t W_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T."""
    return _run(_gated_delta_step, state, q, scale, k, v, beta, alpha)


def _falcon1_step(w, x, v, beta, lam, eps):
    e = beta / (jnp.sum(x**2, -1) + lam + eps)
    return (1 - e * lam)[..., None, None] * w + e[..., None, None] * _outer(v - _matvec(w, x), x)


def falcon1(q, x, v, beta, lam, state, eps, scale=1.0):
    """W_t = (1 - e_t l_t) W_{t-1} + e_t (v_t - W_{t-1} x_t) x_t^T, e_t = b_t/(|x_t|^2+l_t+eps)."""
    eps = jnp.full(lam.shape, eps, lam.dtype)
    return _run(_falcon1_step, state, q, scale, x, v, beta, lam, eps)


def _falcon_window_step(w, xs, vs, beta, lam, eps):
    norm = sum(jnp.sum(x**2, -1) for x in xs) + lam + eps  # (B, H)
    update = sum(_outer(v - _matvec(w, x), x) for x, v in zip(xs, vs, strict=True))
    b = beta if beta.ndim == 3 else beta[..., None]  # (B, H, d_v or 1)
    e = (b / norm[..., None])[..., None]  # (B, H, d_v or 1, 1): one gain per row
    return (1 - e * lam[..., None, None]) * w + e * update


def falcon_window(q, x, v, beta, lam, state, eps, window, scale=1.0):
    """Falcon-3 (Falcon-2 when beta is (B, T, H, d_v)): over i in [max(0, t-c+1), t],
    W_t = (1 - e_t l_t) W_{t-1} + e_t sum_i (v_i - W_{t-1} x_i) x_i^T,
    e_t = b_t / (sum_i |x_i|^2 + l_t + eps), one e_t per value row when beta has a d_v axis."""
    xs, vs, betas, lams = (jnp.unstack(a, axis=1) for a in (x, v, beta, lam))
    outs = []
    for t, q_t in enumerate(jnp.unstack(q, axis=1)):
        window_t = range(max(0, t - window + 1), t + 1)
        x_t, v_t = [xs[i] for i in window_t], [vs[i] for i in window_t]
        args = (x_t, v_t, betas[t], lams[t], eps)
        state, o_t = _write_then_read(_falcon_window_step, state, q_t, scale, *args)
        outs.append(o_t)
    return jnp.stack(outs, axis=1), state


def _gdn2_step(w, k, v, erase, write, log_decay):
    eye = jnp.eye(k.shape[-1], dtype=k.dtype)[None, None]
    u = jnp.sqrt(erase) * k
    decay = jnp.exp(log_decay)[..., None, :] * eye  # diag(exp(l)), (B, H, d_k, d_k)
    return w @ decay @ (eye - _outer(u, u)) + _outer(write * v, u)


def gdn2(q, k, v, erase, write, log_decay, state, scale):
    """u = sqrt(erase) k; W_i = W_{i-1} D_i (I - u u^T) + (write * v) u^T, D = diag(exp(l))."""
    return _run(_gdn2_step, state, q, scale, k, v, erase, write, log_decay)


def _ttt_step(w, start, k, v, lr):
    return w - lr[..., None, None] * _outer(_matvec(start, k) - v, k)


def ttt_linear(q, k, v, lr, state, chunk):
    """Mini-batch SGD on 1/2 |W k - v|^2 from the batch start W_s:
    W_t = W_s - sum_{j<=t in batch} lr_j (W_s k_j - v_j) k_j^T."""
    ks, vs, lrs = (jnp.unstack(a, axis=1) for a in (k, v, lr))
    outs = []
    for t, q_t in enumerate(jnp.unstack(q, axis=1)):
        if t % chunk == 0:
            start = state
        args = (start, ks[t], vs[t], lrs[t])
        state, o_t = _write_then_read(_ttt_step, state, q_t, 1.0, *args)
        outs.append(o_t)
    return jnp.stack(outs, axis=1), state


# Test helpers shared by the test_ops_* files of the linear memories.

B, H, DK, DV = 2, 2, 5, 3
EPS_FALCON = 1e-3


def make_inputs(t, seed=0, dtype=jnp.float64):
    """Random inputs for every linear op at (B, T, H) = (2, t, 2), d_k = 5 != d_v = 3."""
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    normal = lambda *shape: jax.random.normal(next(keys), shape, dtype)
    uniform = lambda lo, hi, *shape: jax.random.uniform(next(keys), shape, dtype, lo, hi)
    k = normal(B, t, H, DK)
    return {
        "q": normal(B, t, H, DK),
        "k": k / jnp.linalg.norm(k, axis=-1, keepdims=True),
        "v": normal(B, t, H, DV),
        "x": normal(B, t, H, DK),
        "beta": uniform(0.1, 0.9, B, t, H),
        "beta_rows": uniform(0.1, 0.9, B, t, H, DV),
        "alpha": uniform(0.5, 1.0, B, t, H),
        "lam": uniform(0.0, 2.0, B, t, H),
        "erase": uniform(0.1, 0.9, B, t, H, DK),
        "write": uniform(0.1, 0.9, B, t, H, DV),
        "log_decay": -jax.nn.softplus(normal(B, t, H, DK)),
        "lr": uniform(0.1, 0.9, B, t, H),
        "state": normal(B, H, DV, DK),
    }


def assert_tree_close(actual, expected, rtol=1e-9, atol=1e-10, err_msg=""):
    def check(path, a, e):
        msg = f"{err_msg} {jax.tree_util.keystr(path)}"
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=msg)

    jax.tree_util.tree_map_with_path(check, actual, expected)


# (T, chunk sizes) of the reference comparisons: lengths that are not multiples of the chunk, a
# chunk longer than the sequence (None resolves to >= 32) and the per-token scan (1).
LENGTHS_AND_CHUNKS = ((1, (None,)), (7, (4, None)), (37, (1, 4, 16, None)))


def check_against_reference(op, reference, names, lengths_and_chunks=LENGTHS_AND_CHUNKS):
    """Asserts that ``op(inputs, chunk)`` equals ``reference(inputs)`` in value and in the
    gradient of a random linear functional of ``(o, final_state)`` w.r.t. the inputs ``names``,
    for every length and chunk size of ``lengths_and_chunks``."""
    problems = []
    for t, chunks in lengths_and_chunks:
        inputs = make_inputs(t, seed=t)
        o, s = jax.eval_shape(lambda inputs=inputs: reference(inputs))
        k1, k2 = jax.random.split(jax.random.key(t + 1))
        cotangent = (
            jax.random.normal(k1, o.shape, o.dtype),
            jax.random.normal(k2, s.shape, s.dtype),
        )
        problems.append((inputs, cotangent, chunks))

    def value_and_pullback(fn, inputs, cotangent, diff):
        out, pullback = jax.vjp(lambda d: fn({**inputs, **d}), diff)
        return out, pullback(cotangent)[0]

    def run_op(diffs):
        # One program for all cases: XLA's fixed cost per compilation dominates these tests.
        return [
            [value_and_pullback(lambda a, c=c: op(a, c), inputs, cot, d) for c in chunks]
            for (inputs, cot, chunks), d in zip(problems, diffs, strict=True)
        ]

    diffs = [{n: inputs[n] for n in names} for inputs, _, _ in problems]
    for (inputs, cot, chunks), d, got in zip(problems, diffs, jax.jit(run_op)(diffs), strict=True):
        expected = value_and_pullback(reference, inputs, cot, d)
        for chunk, result in zip(chunks, got, strict=True):
            t = inputs["q"].shape[1]
            assert_tree_close(result, expected, err_msg=f"T={t} chunk_size={chunk}")


def split_in_two(op, inputs, at, chunk):
    """Runs ``op`` on tokens [0, at), then on [at, T) from the carried state."""
    head = {n: x if n == "state" else x[:, :at] for n, x in inputs.items()}
    tail = {n: x if n == "state" else x[:, at:] for n, x in inputs.items()}
    o1, s1 = op(head, chunk)
    o2, s2 = op({**tail, "state": s1}, chunk)
    return jnp.concatenate([o1, o2], axis=1), s2


def check_chunking_is_invisible(op, odd_chunks=(3, 5, 37)):
    """Chunk sizes that need padding agree with the per-token scan; a sequence split in two
    calls with the carried state equals one call; ``initial_state=None`` equals zeros."""
    inputs = make_inputs(37, seed=3)
    zeros = {**inputs, "state": jnp.zeros_like(inputs["state"])}

    def run(a):
        return (
            [op(a, c) for c in (1, *odd_chunks)],
            (op(a, 16), split_in_two(op, a, 20, 16)),
            (op({**a, "state": None}, None), op(zeros, None)),
        )

    (base, *odd), (whole, split), (with_none, with_zeros) = jax.jit(run)(inputs)
    for chunk, result in zip(odd_chunks, odd, strict=True):
        assert_tree_close(result, base, err_msg=f"chunk_size={chunk}")
    assert_tree_close(split, whole, err_msg="split in two calls")
    assert_tree_close(with_none, with_zeros, err_msg="initial_state=None")


def check_float32_strong_decay(op, inputs, names):
    """Float32 chunked results (values and gradients w.r.t. ``names``) are finite and match
    the per-token scan although cumulative in-chunk decays far exceed float32's exp range."""

    def loss(diff, chunk):
        return sum(jnp.sum(x) for x in op({**inputs, **diff}, chunk))

    def run(diff):
        return [(op({**inputs, **diff}, c), jax.grad(loss)(diff, c)) for c in (1, 16, None)]

    expected, *chunked = jax.jit(run)({n: inputs[n] for n in names})
    for result in chunked:
        for leaf in jax.tree.leaves(result):
            assert leaf.dtype == jnp.float32
            assert bool(jnp.all(jnp.isfinite(leaf)))
        assert_tree_close(result[0], expected[0], rtol=1e-5, atol=1e-5)
