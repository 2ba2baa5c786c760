"""Per-token references for the Type II ops, written from the equations.

Plain Python loops over tokens; each token's step (``jax.grad`` of its local loss, the state
recurrence, the read) is written for one (batch, head), vmapped over (B, H) and jitted.
Mini-batch semantics: every gradient of a chunk is taken at the chunk-start parameters, the
state recurrences run token by token. Written independently of
``nested.ops`` (own MLP, own Newton-Schulz).
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

ACT = {"gelu": jax.nn.gelu, "silu": jax.nn.silu, "tanh": jnp.tanh, "relu": jax.nn.relu}


def mlp(params, x, form):
    """f_theta(x) for one sample: params tuple of {"w": (out, in), "b": (out,)}."""
    form = dict(form)
    h = x
    for i, layer in enumerate(params):
        h = layer["w"] @ h + layer.get("b", 0.0)
        if i < len(params) - 1:
            h = ACT[form["activation"]](h)
    if form["residual_norm"]:
        mu = h.mean()
        var = ((h - mu) ** 2).mean()
        h = x + (h - mu) / jnp.sqrt(var + form["norm_eps"])
    return h


def loss(params, x, v, form):
    """1/2 |f_theta(x) - v|^2."""
    return 0.5 * jnp.sum((mlp(params, x, form) - v) ** 2)


def newton_schulz(x, steps):
    """Muon's quintic iteration on one matrix, on its short side."""
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    x = x / jnp.sqrt(jnp.sum(x**2) + 1e-14)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if transpose else x


def _tokens(x):
    """(B, T, H, ...) -> list over t of (B, H, ...)."""
    return [x[:, t] for t in range(x.shape[1])]


def _run(step, theta, extra, tokens, chunk_size):
    """Python loop over tokens; theta_s is the chunk-start state every gradient is taken at.

    step(theta_s, theta, extra, token) -> (theta, extra, o_t) (one jitted token step, vmapped
    over (B, H)). Differentiable: its VJP backpropagates through the same loop token by token
    (``_run_bwd``), each step's VJP a compiled function, which keeps the tests fast."""
    outs, _ = _forward(step, theta, extra, tokens, chunk_size)
    return outs


def _forward(step, theta, extra, tokens, chunk_size):
    outs, saved = [], []
    for t, token in enumerate(tokens):
        if t % chunk_size == 0:
            theta_s = theta
        saved.append((theta_s, theta, extra, token))
        theta, extra, o = step.fwd(theta_s, theta, extra, token)
        outs.append(o)
    return (jnp.stack(outs, axis=1), theta, extra), saved


def _run_fwd(step, theta, extra, tokens, chunk_size):
    return _forward(step, theta, extra, tokens, chunk_size)


def _run_bwd(step, chunk_size, saved, cot):
    ct_o, ct_theta, ct_extra = cot
    ct_theta_s = jax.tree.map(jnp.zeros_like, ct_theta)
    ct_tokens = [None] * len(saved)
    for t in reversed(range(len(saved))):
        grads = step.vjp(saved[t], (ct_theta, ct_extra, ct_o[:, t]))
        ct_theta_s = jax.tree.map(jnp.add, ct_theta_s, grads[0])
        ct_theta, ct_extra, ct_tokens[t] = grads[1:]
        if t % chunk_size == 0:  # theta_s is theta at the chunk start
            ct_theta = jax.tree.map(jnp.add, ct_theta, ct_theta_s)
            ct_theta_s = jax.tree.map(jnp.zeros_like, ct_theta_s)
    return ct_theta, ct_extra, ct_tokens


_run = jax.custom_vjp(_run, nondiff_argnums=(0, 4))
_run.defvjp(_run_fwd, _run_bwd)


class _Step(NamedTuple):
    fwd: Callable
    vjp: Callable


def _bh(fn):
    """A token step for one (batch, head), vmapped over (B, H), and its VJP, both compiled."""
    fn = jax.vmap(jax.vmap(fn))
    vjp = lambda primals, cot: jax.vjp(fn, *primals)[1](cot)
    return _Step(jax.jit(fn), jax.jit(vjp))


@functools.lru_cache
def _ttt_step(form):
    def step(theta_s, theta, _, tok):
        q, k, v, lr = tok
        g = jax.grad(loss)(theta_s, k, v, form)
        theta = jax.tree.map(lambda p, g: p - lr * g, theta, g)
        return theta, None, mlp(theta, q, form)

    return _bh(step)


def ttt_mlp_ref(q, k, v, lr, params, *, chunk_size, form):
    step = _ttt_step(_key(form))
    tokens = list(zip(*map(_tokens, (q, k, v, lr)), strict=True))
    o, theta, _ = _run(step, params, None, tokens, chunk_size)
    return o, theta


@functools.lru_cache
def _titans_step(form):
    def step(theta_s, theta, s, tok):
        q, k, v, h, m, a = tok
        g = jax.grad(loss)(theta_s, k, v, form)
        s = jax.tree.map(lambda s, g: m * s - h * g, s, g)
        theta = jax.tree.map(lambda p, s: (1 - a) * p + s, theta, s)
        return theta, s, _reads(theta, theta_s, q, form)

    return _bh(step)


def _reads(theta, theta_s, q, form):
    """Both reads, stacked: after the token's write, and at the chunk start."""
    return jnp.stack([mlp(theta, q, form), mlp(theta_s, q, form)])


READ_INDEX = {"after_write": 0, "chunk_start": 1}


def titans_ref(q, k, v, lr, mom, decay, params, momentum, *, chunk_size, read, form):
    step = _titans_step(_key(form))
    tokens = list(zip(*map(_tokens, (q, k, v, lr, mom, decay)), strict=True))
    o, theta, s = _run(step, params, momentum, tokens, chunk_size)
    return o[:, :, :, READ_INDEX[read]], (theta, s)


def identity(x):
    return x


@functools.lru_cache
def _atlas_step(form, phi, muon_steps):
    def step(theta_s, theta, s, tok):
        q, keys, values, weights, h, m, a = tok  # keys, values, weights: the window's samples

        def omega(th):
            losses = jax.vmap(lambda k, v: loss(th, phi(k), v, form))(keys, values)
            return jnp.sum(weights * losses)

        g = jax.grad(omega)(theta_s)
        s = jax.tree.map(lambda s, g: m * s - g, s, g)
        upd = tuple(
            {
                n: (newton_schulz(x, muon_steps) if n == "w" and muon_steps else x)
                for n, x in lay.items()
            }
            for lay in s
        )
        theta = jax.tree.map(lambda p, u: (1 - a) * p + h * u, theta, upd)
        return theta, s, _reads(theta, theta_s, phi(q), form)

    return _bh(step)


def atlas_ref(
    q, k, v, lr, mom, decay, gates, state, *, window, chunk_size, phi, muon_steps, read, form
):
    """state: (params, momentum, keys (B,H,c-1,d), values, gates (B,H,c-1)); phi None = identity.

    L_t = sum_{i=t-c+1..t} g_i 1/2 |f(phi(k_i)) - v_i|^2, samples before the sequence from the
    state's buffer; S_t = m_t S_{t-1} - grad L_t; theta_t = (1-a_t) theta_{t-1} + h_t NS(S_t)."""
    params, momentum, buf_k, buf_v, buf_g = state
    keys = jnp.concatenate([buf_k, jnp.moveaxis(k, 1, 2)], axis=2)  # (B, H, c-1+T, d)
    values = jnp.concatenate([buf_v, jnp.moveaxis(v, 1, 2)], axis=2)
    weights = jnp.concatenate([buf_g, jnp.moveaxis(gates, 1, 2)], axis=2)
    # samples t-c+1 .. t of token t sit at indices t .. t+c-1 of the buffer-prefixed arrays
    win = lambda x, t: x[:, :, t : t + window]
    tokens = [
        (q[:, t], win(keys, t), win(values, t), win(weights, t), lr[:, t], mom[:, t], decay[:, t])
        for t in range(q.shape[1])
    ]
    step = _atlas_step(_key(form), phi or identity, muon_steps)
    o, theta, s = _run(step, params, momentum, tokens, chunk_size)
    o = o[:, :, :, READ_INDEX[read]]
    n = keys.shape[2]
    tail = lambda x: x[:, :, n - (window - 1) :]
    return o, (theta, s, tail(keys), tail(values), tail(weights))


@jax.jit
def _delta_step(w, tok):
    q, k, v, b = tok
    w = w + b[..., None, None] * jnp.einsum(
        "bhv,bhk->bhvk", v - jnp.einsum("bhvk,bhk->bhv", w, k), k
    )
    return w, jnp.einsum("bhvk,bhk->bhv", w, q)


def delta_rule_ref(q, k, v, beta, w0):
    """Delta rule W_t = W_{t-1} + beta_t (v_t - W_{t-1} k_t) k_t^T, o_t = W_t q_t.

    w0: (B, H, d_v, d_k)."""
    outs, w = [], w0
    for tok in zip(*map(_tokens, (q, k, v, beta)), strict=True):
        w, o = _delta_step(w, tok)
        outs.append(o)
    return jnp.stack(outs, axis=1), w


def _key(form):
    """Hashable form for the step caches."""
    return tuple(sorted(form.items()))
