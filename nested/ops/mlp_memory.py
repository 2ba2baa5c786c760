"""The per-head MLP memory f_theta of the Type II ops (TTT-MLP, Titans, ATLAS).

One memory per batch element and head. ``params`` is a tuple of layers, layer ``l`` a dict
``{"w": (B, H, d_{l+1}, d_l), "b": (B, H, d_{l+1})}`` ("b" optional), value-by-key convention
``W (d_out, d_in)``:

    depth 1:  f(x) = W x (+ b)
    depth L:  f(x) = W_L act(... act(W_1 x + b_1) ...) + b_L
    residual_norm (TTT paper, Sun et al. 2024, "Learning to (Learn at Test Time)"):
              f(x) = x + LN(MLP(x)), LN without affine (the paper's LN gain and bias are outer
              parameters; apply them outside the memory), requires d_in == d_out.

Every op writes with the local loss ``l_i(theta) = 1/2 |f_theta(x_i) - v_i|^2`` (constant 1/2).
Its gradient factorises per layer: ``grad W_l = delta_l x_l^T``, ``grad b_l = delta_l``, with
``x_l`` the layer's input and ``delta_l`` the loss gradient w.r.t. its pre-activation. Any state
that is the chunk-start state plus a weighted sum of such gradients is read without forming it
(:func:`dual_read`, the TTT dual form): ``W_t u = W_s u - sum_i Gamma_{t,i} delta_i (x_i . u)``.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nested.ops.functions import ACTIVATIONS, mlp_forward

Array = jax.Array
Params = tuple[dict[str, Array], ...]


class MemoryForm(NamedTuple):
    """Static shape of f_theta beyond its parameters: activation and the TTT residual+LN form."""

    activation: str | Callable[[Array], Array] = "gelu"
    residual_norm: bool = False
    norm_eps: float = 1e-6

    def act(self, x: Array) -> Array:
        return self.activation(x) if callable(self.activation) else ACTIVATIONS[self.activation](x)


def make_form(activation, residual_norm, norm_eps=1e-6) -> MemoryForm:
    """The ``MemoryForm`` of an op's memory arguments (``validation.check_activation`` first)."""
    return MemoryForm(activation, bool(residual_norm), float(norm_eps))


def init_mlp_memory(
    key: Array,
    *,
    batch: int,
    heads: int,
    d_in: int,
    d_out: int,
    hidden: int | Sequence[int] = (),
    bias: bool = False,
    scale: float = 1.0,
    dtype=jnp.float32,
) -> Params:
    """Initial memory parameters, one draw per head broadcast over the batch.

    Args:
      hidden: width(s) of the hidden layers: ``()`` gives depth 1 (linear ``W (d_out, d_in)``),
        ``256`` gives depth 2 (``W1 (256, d_in)``, ``W2 (d_out, 256)``).
      scale: weights are normal with variance ``scale / fan_in``; biases start at zero.
    Returns:
      tuple of layers ``{"w": (batch, heads, d_next, d_prev)[, "b": (batch, heads, d_next)]}``.
    """
    widths = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    dims = (d_in, *widths, d_out)
    keys = jax.random.split(key, len(dims) - 1)
    layers = []
    for key_l, fan_in, fan_out in zip(keys, dims[:-1], dims[1:], strict=True):
        w = jax.random.normal(key_l, (heads, fan_out, fan_in), dtype) * jnp.sqrt(scale / fan_in)
        layer = {"w": jnp.broadcast_to(w, (batch, *w.shape))}
        if bias:
            layer["b"] = jnp.zeros((batch, heads, fan_out), dtype)
        layers.append(layer)
    return tuple(layers)


def _forward(linear: Callable[[int, Array], Array], x: Array, depth: int, form: MemoryForm):
    """The network, with each layer's affine map supplied by ``linear(layer, input)``."""
    return mlp_forward(linear, x, depth, form.act, form.residual_norm, form.norm_eps)


def affine(layer: dict[str, Array], u: Array) -> Array:
    """``W u + b`` for u (B, H, N, d_in); W (B, H, d_out, d_in), or (B, H, N, d_out, d_in) with
    one matrix per row."""
    if layer["w"].ndim == 5:
        z = jnp.einsum("bhnoi,bhni->bhno", layer["w"], u)
        return z + layer["b"] if "b" in layer else z
    z = jnp.einsum("bhoi,bhni->bhno", layer["w"], u)
    return z + layer["b"][..., None, :] if "b" in layer else z


DEFAULT_FORM = MemoryForm()


def mlp_apply(params: Params, x: Array, form: MemoryForm = DEFAULT_FORM) -> Array:
    """f_theta(x): x (B, H, N, d_in) -> (B, H, N, d_out); per-row params (leading (B, H, N)) too."""
    return _forward(lambda layer, u: affine(params[layer], u), x, len(params), form)


class GradFactors(NamedTuple):
    """Per-sample loss gradients in factors, per layer l: ``grad_W_l l_n = deltas[l][n]
    inputs[l][n]^T``, ``grad_b_l l_n = deltas[l][n]`` (``sample_grads``)."""

    inputs: tuple[Array, ...]  # per layer (B, H, N, d_l): the layer's inputs x_l
    deltas: tuple[Array, ...]  # per layer (B, H, N, d_{l+1}): d l_n / d(pre-activation)


class ThetaCoefficients(NamedTuple):
    """A state in dual form over rows r (tokens, or one row for a shared state):

    theta_r = base_r theta_s + carry_r S_s - sum_n gamma_{r,n} grad l_n(theta_s).
    """

    base: Array  # A (B, H, R)
    carry: Array | None  # c (B, H, R); None without momentum
    gamma: Array  # Gamma (B, H, R, N)


def sample_grads(params: Params, x: Array, v: Array, form: MemoryForm) -> GradFactors:
    """Per-sample gradients of ``l_n = 1/2 |f_theta(x_n) - v_n|^2`` at shared params, factorised.

    Args:
      x: (B, H, N, d_in) samples; v: (B, H, N, d_out) targets.
    """

    def forward(offsets):
        inputs = []

        def linear(layer, u):
            inputs.append(u)
            return affine(params[layer], u) + offsets[layer]

        return _forward(linear, x, len(params), form), inputs

    # The loss gradient w.r.t. a zero offset added to a pre-activation is that layer's delta.
    offsets = [jnp.zeros((*x.shape[:-1], layer["w"].shape[-2]), x.dtype) for layer in params]
    out, vjp, inputs = jax.vjp(forward, offsets, has_aux=True)
    (deltas,) = vjp(out - v)
    return GradFactors(tuple(inputs), tuple(deltas))


def clipped(grads: GradFactors, params: Params, max_norm: float) -> GradFactors:
    """Each sample's gradient scaled to norm at most ``max_norm`` (``rules.GradientDescent``'s
    clip): ``|grad l_n|^2 = sum_l |delta_l|^2 (|x_l|^2 + 1 if layer l has a bias)``, a sum of
    outer products' norms, and the factor ``c / sqrt(max(|grad l_n|^2, c^2))`` scales every
    layer's delta."""
    squares = sum(
        jnp.sum(d * d, axis=-1) * (jnp.sum(x * x, axis=-1) + ("b" in layer))
        for layer, x, d in zip(params, grads.inputs, grads.deltas, strict=True)
    )
    factor = max_norm * jax.lax.rsqrt(jnp.maximum(squares, max_norm**2))  # (B, H, N)
    return grads._replace(deltas=tuple(d * factor[..., None] for d in grads.deltas))


def weighted_grads(weights: Array, grads: GradFactors, params: Params) -> Params:
    """``sum_n weights_n grad l_n`` as a params-shaped pytree; weights (B, H, N)."""
    out = []
    for layer, x, d in zip(params, grads.inputs, grads.deltas, strict=True):
        wd = d * weights[..., None]
        grad = {"w": jnp.einsum("bhno,bhni->bhoi", wd, x)}
        if "b" in layer:
            grad["b"] = jnp.sum(wd, axis=-2)
        out.append(grad)
    return tuple(out)


def scale(a: Array, x: Array) -> Array:
    """``a * x`` for a (B, H) coefficient and a (B, H, ...) leaf."""
    return a.reshape(a.shape + (1,) * (x.ndim - 2)) * x


def dual_scores(layer, u: Array, inputs: Array) -> Array:
    """The dual form's scores ``x_n . u`` (+ 1 when ``layer`` has a bias; ``layer`` None: none):
    u (B, H, R, d), inputs (B, H, N, d) -> (B, H, R, N)."""
    scores = jnp.einsum("bhri,bhni->bhrn", u, inputs)
    return scores + 1.0 if layer is not None and "b" in layer else scores


def dual_combine(
    theta: ThetaCoefficients, state: Array, mom: Array | None, scores: Array, buf: Array
) -> Array:
    """The dual form's sum for rows r: ``base_r state_r + carry_r mom_r - sum_n gamma_{r,n}
    scores_{r,n} buf_n``. state, mom (B, H, R, d) (mom None without momentum); ``theta``'s
    base, carry (B, H, R) and gamma (B, H, R, N), or R = 1 for one state shared by the rows;
    scores (B, H, R, N), buf (B, H, N, d). Returns (B, H, R, d)."""
    weights = theta.gamma * scores
    z = theta.base[..., None] * state - jnp.einsum("bhrn,bhnd->bhrd", weights, buf)
    return z if mom is None else z + theta.carry[..., None] * mom


def dual_affine(layer, mom_layer, theta: ThetaCoefficients, u: Array, inputs, deltas) -> Array:
    """One layer's affine map at the dual-form state ``theta`` (theta_r is not formed), for rows
    u (B, H, R, d_in):

        base_r (W_s u + b_s) + carry_r (M_s u + m_s) - sum_n gamma_{r,n} (x_n . u + 1) d_n

    (the 1 only with biases). ``layer``, ``mom_layer``: the layer of theta_s and of S_s (None
    without momentum); inputs (B, H, N, d_in), deltas (B, H, N, d_out): the layer's gradient
    factors (``sample_grads``). Returns (B, H, R, d_out)."""
    mom = None if mom_layer is None else affine(mom_layer, u)
    scores = dual_scores(layer, u, inputs)  # before W u: sets the order u's cotangents sum in
    return dual_combine(theta, affine(layer, u), mom, scores, deltas)


def dual_read(
    params: Params,
    momentum: Params | None,
    theta: ThetaCoefficients,
    x: Array,
    grads: GradFactors,
    form: MemoryForm,
) -> Array:
    """Read ``o_r = f_{theta_r}(x_r)`` without forming theta_r (dual form).

    theta_s = ``params``, S_s = ``momentum`` (None without momentum), the gradients in
    ``grads``; every layer through :func:`dual_affine`. x (B, H, C, d_in) -> (B, H, C, d_out).
    """

    def linear(layer, u):
        mom = None if momentum is None else momentum[layer]
        factors = grads.inputs[layer], grads.deltas[layer]
        return dual_affine(params[layer], mom, theta, u, *factors)

    return _forward(linear, x, len(params), form)
