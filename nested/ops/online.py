"""Gradient factors of the online rule (chunk size 1) over one block, with their backward.

Token t of a block takes its loss gradient at the state before it,

    theta_{t-1} = A_{t-1} theta_s + c_{t-1} S_s - sum_{i<t} Gamma_{t-1,i} grad l_i(theta_{i-1}),

which is never formed: every layer map of the memory is applied in dual form
(``mlp_memory.dual_affine``), products with the block-start state and momentum plus a sum over the
factors (x_i, delta_i) of the block's earlier samples,

    Lin_l(u)   = A W_l u + c M_l u - sum_i Gamma_i (x_i . u + beta) delta_i     (+ A b + c m)
    Lin_l^T(e) = A W_l^T e + c M_l^T e - sum_i Gamma_i (delta_i . e) x_i

(beta = 1 with biases). A token runs the network forward (z_l = Lin_l(x_l), x_{l+1} =
act(z_l)) and its loss backward (delta_{L-1} from the output, delta_{l-1} = act'(z_{l-1})^T
Lin_l^T delta_l), and appends its factors (x_l, delta_l) to the block's buffers: a scan over
tokens, C = ONLINE_BLOCK of them (``nested.ops.chunk_scan``); ``block_grads`` is the entry.

The backward of that scan is written out (``jax.custom_vjp``): a reverse scan over tokens that
reads the finished buffers (token t's coefficients are zero on rows it had not yet seen, so the
final buffers give the same sums), keeps per token only z_l, Lin_l^T delta_l and the overlaps
delta_i . delta_t, and sums the parameters' cotangents once a block (one matmul over the
per-token cotangents). Autodiff of the scan instead stores the buffers per token, adds a
parameter-sized cotangent per token and runs about four times the forward's operations a token.
The forward's outputs and residuals are named ``SAVED``, which the block's rematerialisation
keeps (``chunk_scan.scan_chunks``), so the backward does not rerun the scan. The nonlinear
pieces (activation, residual LayerNorm head) are row-local and differentiated by ``jax.vjp``;
only the dual-form maps are transposed by hand, so every memory form (depth, activation,
biases, residual norm, momentum, ATLAS's windows of gated samples) takes this path. The
backward is itself differentiable (meta-gradients through a level that differentiates the op);
forward-mode (``jax.jvp``) is not available for chunk size 1, as for any ``custom_vjp``.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from nested.ops import mlp_memory as mm
from nested.ops.functions import mlp_output

Array = jax.Array

# Name of what the forward keeps for the backward: a rematerialised block need not rerun the scan.
SAVED = "online_factors"


class FirstLayer(NamedTuple):
    """The first layer's maps of a block's samples x (its inputs, known for the whole block),
    per token t and its w samples: one matmul each for the block, not one a token."""

    state: Array  # W_s x + b_s (B, H, C, w, d_1)
    momentum: Array | None  # M_s x + m_s (B, H, C, w, d_1); None without momentum
    scores: Array  # x . x_n (+ 1 with a bias) (B, H, C, w, N)


def _per_token(a: Array | None) -> Array | None:
    """A token's (B, H) coefficient as (B, H, 1): one state shared by the token's rows."""
    return None if a is None else a[:, :, None]


def _token_rows(coef: mm.ThetaCoefficients) -> mm.ThetaCoefficients:
    """A token's (A, c, Gamma) as one dual-form state shared by its rows."""
    return mm.ThetaCoefficients(
        _per_token(coef.base), _per_token(coef.carry), coef.gamma[:, :, None]
    )


def _head_delta(form: mm.MemoryForm, z: Array, v: Array, x0: Array | None) -> Array:
    """delta of the last layer: d/dz 1/2 |out(z) - v|^2, out = ``functions.mlp_output``."""
    out, pullback = jax.vjp(lambda z: mlp_output(x0, z, form.residual_norm, form.norm_eps), z)
    return pullback(out - v)[0]


def _act_pullback(form: mm.MemoryForm, z: Array, e: Array) -> Array:
    """act'(z)^T e: the backward through a hidden layer's activation."""
    return jax.vjp(form.act, z)[1](e)[0]


def _matvec(layer: dict | None, u: Array, transpose: bool = False) -> Array | None:
    """W u (rows u (B, H, w, d_in)) or W^T u; None without a momentum."""
    if layer is None:
        return None
    spec = "bhoi,bhro->bhri" if transpose else "bhoi,bhri->bhro"
    return jnp.einsum(spec, layer["w"], u)


def _forward_token(params, momentum, form, bufs, xs):
    """One token: its factors appended to the buffers, and what the backward needs of it."""
    hidden, deltas = bufs  # hidden[l - 1]: layer l's inputs (l >= 1); deltas[l]: layer l's
    t, coef, first, v, x0 = xs
    depth = len(deltas)
    row = _token_rows(coef)
    z, inputs = [mm.dual_combine(row, *first, deltas[0])], []
    for layer in range(1, depth):
        u = form.act(z[-1])
        m = None if momentum is None else momentum[layer]
        z.append(mm.dual_affine(params[layer], m, row, u, hidden[layer - 1], deltas[layer]))
        inputs.append(u)
    delta = [None] * depth
    delta[-1] = _head_delta(form, z[-1], v, x0)
    back, overlaps = [None] * depth, [None] * depth
    for layer in range(depth - 1, 0, -1):
        p, m = params[layer], None if momentum is None else momentum[layer]
        overlaps[layer] = mm.dual_scores(None, delta[layer], deltas[layer])
        back[layer] = mm.dual_combine(
            row,
            _matvec(p, delta[layer], True),
            _matvec(m, delta[layer], True),
            overlaps[layer],
            hidden[layer - 1],
        )
        delta[layer - 1] = _act_pullback(form, z[layer - 1], back[layer])
    put = lambda buf, rows: jax.lax.dynamic_update_slice_in_dim(buf, rows, t * rows.shape[2], 2)
    bufs = (tuple(map(put, hidden, inputs)), tuple(map(put, deltas, delta)))
    return bufs, (tuple(z), tuple(back[1:]), tuple(overlaps[1:]))


def _tokens(x):
    """(B, H, C, ...) -> (C, B, H, ...): scan over the block's tokens."""
    return jax.tree.map(lambda a: jnp.moveaxis(a, 2, 0), x)


def _untokens(x):
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 2), x)


def _block_forward(form, params, momentum, coef, first, v, x0):
    """The scan over tokens: the buffers (hidden inputs, deltas) and per-token residuals."""
    c, w = v.shape[2], v.shape[3]
    empty = lambda d: jnp.zeros((*v.shape[:2], c * w, d), v.dtype)
    bufs = (
        tuple(empty(layer["w"].shape[-1]) for layer in params[1:]),
        tuple(map(empty, [first.state.shape[-1]] + [layer["w"].shape[-2] for layer in params[1:]])),
    )
    xs = (jnp.arange(c), *_tokens((coef, first, v, x0)))
    return jax.lax.scan(partial(_forward_token, params, momentum, form), bufs, xs)


def _transpose_map(p, m, transposed, coef, u, ct_z, buf_in, buf_out, scores, mask):
    """Cotangents of one dual-form map of a token's rows u (B, H, w, d_in),

        z = base W u + carry M u - sum_n gamma_n scores_n buf_out_n  (+ base b + carry m),

    scores_n = u . buf_in_n (+ 1), W^T in place of W for ``transposed`` (Lin^T, no bias), for
    z's cotangent ``ct_z``. Returns (ct_u, (ct_base, ct_carry, ct_gamma), ct_buf_in,
    ct_buf_out); the parameters' cotangents are summed over the block by the caller."""
    row = _token_rows(coef)
    a = mm.dual_scores(None, ct_z, buf_out)  # (B, H, w, N): buf_out_n . ct_z
    ga = row.gamma * a
    wt, mt = _matvec(p, ct_z, not transposed), _matvec(m, ct_z, not transposed)
    ct_u = mm.dual_combine(row, wt, mt, a, buf_in)
    sum_rows = jnp.sum(ct_z, axis=2)

    def ct_scale(layer, prod):
        ct = jnp.sum(u * prod, axis=(-2, -1))
        return ct + jnp.sum(layer["b"] * sum_rows, -1) if "b" in layer and not transposed else ct

    ct_coef = mm.ThetaCoefficients(
        ct_scale(p, wt),
        None if m is None else ct_scale(m, mt),
        -jnp.sum(scores * a, axis=2) * mask,
    )
    ct_buf_in = -jnp.einsum("bhrn,bhri->bhni", ga, u)
    ct_buf_out = -jnp.einsum("bhrn,bhro->bhno", row.gamma * scores, ct_z)
    return ct_u, ct_coef, ct_buf_in, ct_buf_out


def _backward_token(params, momentum, form, finals, cts, xs):
    """Token t's share of the backward (a reverse scan over tokens).

    ``cts``: the cotangents of the buffers, complete on token t's rows (every later token has
    added to them); returns them with token t's additions to the earlier rows, and token t's
    cotangents of its inputs plus the per-layer cotangents the parameters' sums need."""
    hidden, deltas = finals
    ct_hidden, ct_deltas = map(list, cts)
    t, coef, (state, mom, scores), v, x0, (z, back, overlaps) = xs
    base, carry, gamma = coef
    depth, w = len(deltas), v.shape[2]
    row = _token_rows(coef)
    # The rows token t had seen: its gamma's cotangent is zero elsewhere, where the forward
    # read zeros but the finished buffers hold later tokens' factors.
    mask = (jnp.arange(gamma.shape[-1]) < t * w).astype(gamma.dtype)[None, None]
    rows = lambda buf: jax.lax.dynamic_slice_in_dim(buf, t * w, w, 2)
    inputs, delta = [rows(b) for b in hidden], [rows(b) for b in deltas]
    ct_in = [rows(b) for b in ct_hidden]
    ct_d = [rows(b) for b in ct_deltas]
    ct_z = [jnp.zeros_like(x) for x in z]
    ct_coef = mm.ThetaCoefficients(
        jnp.zeros_like(base), None if carry is None else jnp.zeros_like(carry), 0.0
    )
    add = lambda acc, new: mm.ThetaCoefficients(
        *(None if a is None else a + b for a, b in zip(acc, new, strict=True))
    )
    ct_back = []
    layers = lambda l: (params[l], None if momentum is None else momentum[l])

    # The loss backward, reversed: delta_{l-1} = act'(z_{l-1})^T e_l, e_l = Lin_l^T delta_l.
    for layer in range(1, depth):
        pullback = jax.vjp(partial(_act_pullback, form), z[layer - 1], back[layer - 1])[1]
        dz, de = pullback(ct_d[layer - 1])
        ct_z[layer - 1] = ct_z[layer - 1] + dz
        ct_u, terms, ct_in_buf, ct_out_buf = _transpose_map(
            *layers(layer),
            True,
            coef,
            delta[layer],
            de,
            deltas[layer],
            hidden[layer - 1],
            overlaps[layer - 1],
            mask,
        )
        ct_d[layer] = ct_d[layer] + ct_u
        ct_coef = add(ct_coef, terms)
        ct_deltas[layer] = ct_deltas[layer] + ct_in_buf
        ct_hidden[layer - 1] = ct_hidden[layer - 1] + ct_out_buf
        ct_back.append(de)
    pullback = jax.vjp(partial(_head_delta, form), z[-1], v, x0)[1]
    dz, ct_v, ct_x0 = pullback(ct_d[-1])
    ct_z[-1] = ct_z[-1] + dz

    # The network forward, reversed: z_l = Lin_l(x_l), x_l = act(z_{l-1}).
    for layer in range(depth - 1, 0, -1):
        p = params[layer]
        s = mm.dual_scores(p, inputs[layer - 1], hidden[layer - 1])
        ct_u, terms, ct_in_buf, ct_out_buf = _transpose_map(
            *layers(layer),
            False,
            coef,
            inputs[layer - 1],
            ct_z[layer],
            hidden[layer - 1],
            deltas[layer],
            s,
            mask,
        )
        ct_coef = add(ct_coef, terms)
        ct_hidden[layer - 1] = ct_hidden[layer - 1] + ct_in_buf
        ct_deltas[layer] = ct_deltas[layer] + ct_out_buf
        total = ct_in[layer - 1] + ct_u
        ct_z[layer - 1] = ct_z[layer - 1] + jax.vjp(form.act, z[layer - 1])[1](total)[0]

    # The first layer: z_0 = base state + carry mom - sum_n gamma_n scores_n delta0_n.
    a = mm.dual_scores(None, ct_z[0], deltas[0])
    first = FirstLayer(
        mm.scale(base, ct_z[0]),
        None if carry is None else mm.scale(carry, ct_z[0]),
        -row.gamma * a,
    )
    rowdot = lambda x: jnp.sum(x * ct_z[0], axis=(-2, -1))
    ct_coef = add(
        ct_coef,
        (rowdot(state), None if mom is None else rowdot(mom), -jnp.sum(scores * a, 2) * mask),
    )
    ct_deltas[0] = ct_deltas[0] - jnp.einsum("bhrn,bhro->bhno", row.gamma * scores, ct_z[0])
    ys = (ct_coef, first, ct_v, ct_x0, tuple(ct_z[1:]), tuple(ct_back))
    return (tuple(ct_hidden), tuple(ct_deltas)), ys


def _param_cts(params, momentum, coef, finals, ct_z, ct_back, w):
    """Cotangents of the layers l >= 1 (W, b; M, m) over the block: the sum over tokens t and
    their rows n of base_t (ct_z_n x_n^T + delta_n ct_e_n^T) (b: base_t ct_z_n), carry_t the
    same for the momentum: weighted sums of outer products (``mlp_memory.weighted_grads``)."""
    hidden, deltas = finals
    base, carry, _ = coef
    flat = lambda x: x.reshape(*x.shape[:2], -1, x.shape[-1])  # (B, H, C, w, d) -> (B, H, Cw, d)
    cz, ce = [flat(x) for x in ct_z], [flat(x) for x in ct_back]

    def layer_cts(layers, a):
        if layers is None:
            return None
        rows = jnp.repeat(a, w, axis=2)  # a token's coefficient on each of its rows
        direct = mm.weighted_grads(rows, mm.GradFactors(hidden, cz), layers[1:])
        no_bias = ({},) * len(ce)
        through = mm.weighted_grads(rows, mm.GradFactors(ce, deltas[1:]), no_bias)
        pairs = zip(direct, through, strict=True)
        return (None, *({**d, "w": d["w"] + t["w"]} for d, t in pairs))

    return layer_cts(params, base), layer_cts(momentum, carry)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def block_factors(form, params, momentum, coef, first, v, x0):
    """Gradient factors of the online rule over a block of C tokens, w samples a token.

    Args:
      form: the memory's ``MemoryForm``.
      params, momentum: the block-start state theta_s and S_s (momentum None without one);
        layer 0 is not read (pass None): its products come in ``first``.
      coef: per token the coefficients of theta_{t-1} (rows: the C tokens), over the N = C w
        samples (column j w + s: token j's sample s).
      first: the first layer's maps of the samples (``FirstLayer``).
      v: (B, H, C, w, d_out) targets; x0: the samples (B, H, C, w, d_in) for the residual
        norm head (else None).
    Returns:
      (hidden, deltas): layer l >= 1's inputs (B, H, N, d_l), layer l's deltas
      (B, H, N, d_{l+1}): sample n's loss gradient is ``deltas[l][n] x_l[n]^T``.
    """
    return _block_forward(form, params, momentum, coef, first, v, x0)[0]


def _fwd(form, params, momentum, coef, first, v, x0):
    finals, residuals = _block_forward(form, params, momentum, coef, first, v, x0)
    finals, residuals = checkpoint_name((finals, residuals), SAVED)
    return finals, (params, momentum, coef, first, v, x0, finals, residuals)


def _bwd(form, saved, cts):
    params, momentum, coef, first, v, x0, finals, residuals = saved
    c, w = v.shape[2], v.shape[3]
    xs = (jnp.arange(c), *_tokens((coef, first, v, x0)), residuals)
    step = partial(_backward_token, params, momentum, form, finals)
    _, ys = jax.lax.scan(step, cts, xs, reverse=True)
    ct_coef, ct_first, ct_v, ct_x0, ct_z, ct_back = _untokens(ys)
    ct_params, ct_momentum = _param_cts(params, momentum, coef, finals, ct_z, ct_back, w)
    return ct_params, ct_momentum, ct_coef, ct_first, ct_v, ct_x0


block_factors.defvjp(_fwd, _bwd)


def sample_rows(c: int, window: int) -> np.ndarray:
    """(C, window): the rows of token t's samples in [prefix; chunk] arrays, t .. t + window - 1."""
    return np.arange(c)[:, None] + np.arange(window)


def rows_like(rows, x: Array) -> Array:
    """Sample rows (C, window) or (B, 1, C, window) broadcast to (B, H, C, window), ``x``'s
    leading (B, H)."""
    return jnp.broadcast_to(jnp.asarray(rows), (*x.shape[:2], *rows.shape[-2:]))


def block_grads(
    params: mm.Params,
    momentum: mm.Params | None,
    before: mm.ThetaCoefficients,
    k: Array,
    v: Array,
    form: mm.MemoryForm,
    rows,
) -> mm.GradFactors:
    """Gradient factors of the online rule over one block of C tokens: token t's gradient is
    taken at theta_{t-1}, in dual form over the block's earlier tokens (``block_factors``).

    Args:
      params, momentum: the block-start state theta_s, S_s (momentum None without one).
      before: the coefficients of theta_{t-1}: base, carry (B, H, C), gamma (B, H, C, C window),
        column j window + s the s-th sample of token j.
      k, v: (B, H, N, d) samples; rows: (C, window) or (B, 1, C, window), the rows of token
        t's window in them (``sample_rows``: rows t .. t + window - 1 of [prefix; chunk]).
    Returns:
      the factors of the C window samples, token by token (as ``mlp_memory.sample_grads``).
    """
    c, window = rows.shape[-2:]
    flat = rows_like(rows, k).reshape(*k.shape[:2], c * window, 1)
    gather = lambda x: jnp.take_along_axis(x, flat, axis=2)  # (B, H, C * window, d)
    keys = gather(k)
    per_token = lambda x: x.reshape(*x.shape[:2], c, window, x.shape[-1])
    # The first layer's inputs are the samples, known for the whole block: its products with
    # the block-start state and its dual-form scores are one matmul each, not one a token.
    scores = mm.dual_scores(params[0], keys, keys)
    first = FirstLayer(
        per_token(mm.affine(params[0], keys)),
        None if momentum is None else per_token(mm.affine(momentum[0], keys)),
        per_token(scores),
    )
    rest = lambda p: None if p is None else (None, *p[1:])
    hidden, deltas = block_factors(
        form,
        rest(params),
        rest(momentum),
        before,
        first,
        per_token(gather(v)),
        per_token(keys) if form.residual_norm else None,
    )
    return mm.GradFactors((keys, *hidden), deltas)
