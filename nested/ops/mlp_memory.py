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

from nested.learn.memories import ACTIVATIONS, mlp_forward

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
    if not callable(activation) and activation not in ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is unknown; use one of {sorted(ACTIVATIONS)} or a callable."
        )
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


def memory_dims(params: Params) -> tuple[int, int]:
    """(d_in, d_out) of a memory."""
    return params[0]["w"].shape[-1], params[-1]["w"].shape[-2]


def check_params(params, *, batch: int, heads: int, d_in: int, d_out: int, form: MemoryForm, name):
    """Raise ValueError unless ``params`` is a well-formed memory for inputs of these sizes."""
    if (
        not isinstance(params, tuple | list)
        or not params
        or not all(isinstance(layer, dict) and "w" in layer for layer in params)
    ):
        raise ValueError(
            f"{name} must be a non-empty tuple of layers {{'w': (B, H, d_out, d_in)[, 'b']}}, "
            "e.g. from nested.ops.init_mlp_memory."
        )
    prev = d_in
    for i, layer in enumerate(params):
        w = layer["w"]
        if w.ndim != 4 or w.shape[:2] != (batch, heads) or w.shape[3] != prev:
            raise ValueError(
                f"{name}[{i}]['w'] has shape {w.shape}, expected ({batch}, {heads}, d_out, {prev})."
            )
        prev = w.shape[2]
        if "b" in layer and layer["b"].shape != (batch, heads, prev):
            raise ValueError(
                f"{name}[{i}]['b'] has shape {layer['b'].shape}, "
                f"expected ({batch}, {heads}, {prev})."
            )
        if set(layer) - {"w", "b"}:
            raise ValueError(f"{name}[{i}] has unknown keys {sorted(set(layer) - {'w', 'b'})}.")
    if prev != d_out:
        raise ValueError(f"{name} outputs dim {prev} but the values have dim {d_out}.")
    if form.residual_norm and d_in != d_out:
        raise ValueError(
            f"residual_norm=True needs the memory input dim ({d_in}) to equal its output dim "
            f"({d_out}); set residual_norm=False or make them equal."
        )


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


def sample_grads(params: Params, x: Array, v: Array, form: MemoryForm):
    """Per-sample gradients of ``l_i = 1/2 |f_theta(x_i) - v_i|^2`` at shared params, factorised.

    Args:
      x: (B, H, N, d_in) samples; v: (B, H, N, d_out) targets.
    Returns:
      ``(inputs, deltas)``, per layer ``(B, H, N, d_l)`` and ``(B, H, N, d_{l+1})``:
      ``grad_W_l l_i = deltas[l][i] inputs[l][i]^T``, ``grad_b_l l_i = deltas[l][i]``.
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
    return inputs, deltas


def weighted_grads(weights: Array, inputs, deltas, params: Params) -> Params:
    """``sum_i weights_i grad l_i`` as a params-shaped pytree; weights (B, H, N)."""
    out = []
    for layer, x, d in zip(params, inputs, deltas, strict=True):
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


def dual_combine(base, carry, state: Array, mom: Array | None, weights: Array, buf: Array):
    """``base state + carry mom - sum_n weights_n buf_n``, the dual form's sum for rows:
    state, mom (B, H, R, d) (mom None without momentum), base, carry (B, H, R) or (B, H, 1),
    weights (B, H, R, N), buf (B, H, N, d). Returns (B, H, R, d)."""
    z = base[..., None] * state - jnp.einsum("bhrn,bhnd->bhrd", weights, buf)
    return z if mom is None else z + carry[..., None] * mom


def dual_affine(layer, mom_layer, base, carry, gamma, u: Array, inputs, deltas) -> Array:
    """One layer's affine map at ``theta_t = base theta_s + carry S_s - sum_n gamma_n grad l_n``
    (dual form: theta_t is not formed), for rows u (B, H, R, d_in):

        base (W_s u + b_s) + carry (M_s u + m_s) - sum_n gamma_n (x_n . u + 1) d_n

    (the 1 only with biases). ``layer``, ``mom_layer``: the layer of theta_s and of S_s (None
    without momentum); base, carry: (B, H, R), or (B, H, 1) for one state shared by the rows;
    gamma: (B, H, R, N) or (B, H, 1, N); inputs (B, H, N, d_in), deltas (B, H, N, d_out): the
    layer's gradient factors (``sample_grads``). Returns (B, H, R, d_out)."""
    mom = None if mom_layer is None else affine(mom_layer, u)
    weights = gamma * dual_scores(layer, u, inputs)
    return dual_combine(base, carry, affine(layer, u), mom, weights, deltas)


def dual_read(
    params: Params,
    momentum: Params | None,
    base: Array,
    carry: Array | None,
    gamma: Array,
    x: Array,
    inputs,
    deltas,
    form: MemoryForm,
) -> Array:
    """Read ``o_t = f_{theta_t}(x_t)`` without forming theta_t (dual form).

    ``theta_t = base_t theta_s + carry_t S_s - sum_i gamma_{t,i} grad l_i(theta_s)`` with theta_s
    = ``params``, S_s = ``momentum``, the gradients given by ``sample_grads`` factors; every
    layer through :func:`dual_affine`.

    Args:
      base, carry: (B, H, C); gamma: (B, H, C, N); x: (B, H, C, d_in).
    Returns:
      (B, H, C, d_out).
    """

    def linear(layer, u):
        mom = None if momentum is None else momentum[layer]
        return dual_affine(params[layer], mom, base, carry, gamma, u, inputs[layer], deltas[layer])

    return _forward(linear, x, len(params), form)
