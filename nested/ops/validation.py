"""Argument checks of every op of ``nested.ops``, run on shapes before any tracing.

Each check raises ``ValueError`` in one style: the argument in backticks, what it must be (a
shape with its axes named, a range, a layout), what it got, and how to fix it where that is not
plain, e.g. ``ValueError: `k` must have shape (B, T, H, d_k) = (1, 5, 2, 4) like `q`, got
(1, 5, 2, 3).`` A wrong call fails at the call site instead of deep inside ``lax.scan``.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nested.ops.chunk_scan import READS
from nested.ops.functions import ACTIVATIONS


def _fail(name: str, expected: str, got, fix: str = "") -> None:
    raise ValueError(f"`{name}` must have shape {expected}, got {tuple(got)}{fix}.")


def check_sequence(q, k, v, *, key_name: str = "k") -> tuple[int, int, int, int, int]:
    """Checks ``q (B, T, H, d_k)``, ``k (B, T, H, d_k)``, ``v (B, T, H, d_v)``.

    Returns ``(B, T, H, d_k, d_v)``.
    """
    if q.ndim != 4:
        _fail("q", "(B, T, H, d_k)", q.shape)
    b, t, h, _ = q.shape
    if k.shape != q.shape:
        _fail(key_name, f"(B, T, H, d_k) = {q.shape} like `q`", k.shape)
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        _fail("v", f"(B, T, H, d_v) with (B, T, H) = {(b, t, h)} like `q`", v.shape)
    return (*q.shape, v.shape[-1])


def check_qkv(q, k, v, *, key_name: str = "k") -> tuple[int, int, int, int, int]:
    """``check_sequence`` for the linear memories, which also need a token and float arrays."""
    if q.ndim == 4 and q.shape[1] < 1:
        raise ValueError("`q` must hold at least one token (T >= 1), got T = 0.")
    dims = check_sequence(q, k, v, key_name=key_name)
    for name, x in (("q", q), (key_name, k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"`{name}` must be a floating array, got dtype {x.dtype}.")
    return dims


def check_shape(name: str, x, expected: Sequence[int], layout: str, fix: str = "") -> None:
    """Checks ``x.shape == expected``; ``layout`` names the axes, e.g. ``"(B, T, H)"``; ``fix``
    (``"; ..."``) says how to build the right one."""
    if x is None or tuple(x.shape) != tuple(expected):
        _fail(name, f"{layout} = {tuple(expected)}", () if x is None else x.shape, fix)


def check_gates(b: int, t: int, h: int, **gates) -> None:
    """Checks that every gate is ``(B, T, H)``."""
    for name, gate in gates.items():
        check_shape(name, gate, (b, t, h), "(B, T, H)")


def check_state(initial_state, b: int, h: int, dv: int, dk: int) -> None:
    """Checks an optional linear memory state of shape ``(B, H, d_v, d_k)``."""
    if initial_state is not None:
        check_shape("initial_state", initial_state, (b, h, dv, dk), "(B, H, d_v, d_k)")


def check_starts(starts, start_state, b: int, t: int, like=None, name="start_state") -> None:
    """Checks optional document starts ``(B, T)`` bool, given with the state ``name`` every
    document after the first starts from, of the structure and shapes of ``like`` (the op's
    state) when given."""
    if starts is None:
        if start_state is not None:
            raise ValueError(f"`{name}` is the state of the documents after `starts`: pass both.")
        return
    check_shape("starts", starts, (b, t), "(B, T)")
    if starts.dtype != jnp.bool_:
        raise ValueError(f"`starts` must be a bool array, got dtype {starts.dtype}.")
    if start_state is None:
        raise ValueError(f"`starts` needs `{name}`, the state its documents start from.")
    shapes = lambda tree: jax.tree.map(jnp.shape, tuple(tree))
    if like is not None and (
        jax.tree.structure(tuple(start_state)) != jax.tree.structure(tuple(like))
        or shapes(start_state) != shapes(like)
    ):
        raise ValueError(
            f"`{name}` must have the structure and shapes of the op's state {shapes(like)}, "
            f"got {shapes(start_state)}."
        )


def check_documents(starts, start_state, b: int, t: int, h: int, dv: int, dk: int) -> None:
    """``check_starts`` for the linear memories: ``start_state`` is ``(B, H, d_v, d_k)``."""
    check_starts(starts, start_state, b, t)
    if starts is not None:
        check_shape("start_state", start_state, (b, h, dv, dk), "(B, H, d_v, d_k)")


def check_int(name: str, value, minimum: int = 1, *, optional: bool = False) -> None:
    """Checks that ``value`` is an int >= ``minimum`` (or None when ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"`{name}` must be {kind}{' or None' if optional else ''}, got {value!r}.")


def check_clip(clip, chunk_size: int) -> None:
    """A gradient clip is None or a positive number, with mini-batches (``chunk_size > 1``)."""
    if clip is None:
        return
    if isinstance(clip, bool) or not isinstance(clip, int | float) or not 0 < clip < np.inf:
        raise ValueError(f"`clip` must be a positive number or None, got {clip!r}.")
    if chunk_size == 1:
        raise ValueError(
            "`clip` needs `chunk_size` > 1: the online rule (chunk_size=1) does not clip."
        )


def check_one_of(passed: dict[str, bool], what: str = "") -> str:
    """Checks that exactly one of the arguments ``passed`` (name -> whether it was given) was
    given; returns its name. ``what`` leads the message, e.g. ``"the op's state as "``."""
    given = [name for name, was in passed.items() if was]
    if len(given) != 1:
        names = ", ".join(f"`{name}`" for name in passed)
        got = ", ".join(f"`{name}`" for name in given) or "none"
        raise ValueError(f"Pass {what}exactly one of {names}; got {got}.")
    return given[0]


def check_read(read) -> None:
    if read not in READS:
        raise ValueError(f"`read` must be one of {READS}, got {read!r}.")


def check_activation(activation) -> None:
    if not callable(activation) and activation not in ACTIVATIONS:
        raise ValueError(
            f"`activation` must be a callable or one of {sorted(ACTIVATIONS)}, got {activation!r}."
        )


def check_params(params, *, b: int, h: int, d_in: int, d_out: int, residual_norm, name: str):
    """Checks an MLP memory (``mlp_memory``): a tuple of layers ``{"w": (B, H, d_next, d_prev)
    [, "b": (B, H, d_next)]}`` from ``d_in`` to ``d_out``; ``name`` is the argument's."""
    if (
        not isinstance(params, tuple | list)
        or not params
        or not all(isinstance(layer, dict) and "w" in layer for layer in params)
    ):
        raise ValueError(
            f"`{name}` must be a non-empty tuple of layers {{'w': (B, H, d_out, d_in)[, 'b']}}, "
            f"got {type(params).__name__}; build one with nested.ops.init_mlp_memory."
        )
    prev = d_in
    for i, layer in enumerate(params):
        w = layer["w"]
        if w.ndim != 4 or w.shape[:2] != (b, h) or w.shape[3] != prev:
            _fail(f"{name}[{i}]['w']", f"(B, H, d_out, d_in) = ({b}, {h}, d_out, {prev})", w.shape)
        prev = w.shape[2]
        if "b" in layer:
            check_shape(f"{name}[{i}]['b']", layer["b"], (b, h, prev), "(B, H, d_out)")
        if set(layer) - {"w", "b"}:
            unknown = sorted(set(layer) - {"w", "b"})
            raise ValueError(f"`{name}[{i}]` must hold only 'w' and 'b', got keys {unknown}.")
    if prev != d_out:
        raise ValueError(f"`{name}` must output the values' dim d_v = {d_out}, got {prev}.")
    if residual_norm and d_in != d_out:
        raise ValueError(
            f"`residual_norm` must be False when the memory's input dim ({d_in}) and output dim "
            f"({d_out}) differ (f(x) = x + LN(MLP(x))); make them equal or set it to False."
        )


def check_memory_state(state, **dims) -> None:
    """Checks a (params, momentum) state of a momentum rule (``titans``, ``atlas``); ``dims``
    as ``check_params``'s."""
    if not isinstance(state, tuple) or len(state) < 2:
        raise ValueError(
            f"`state` must be (params, momentum), got {type(state).__name__}; build one with "
            "nested.ops.titans_state(params)."
        )
    check_params(state[0], name="state.params", **dims)
    shapes = lambda tree: jax.tree.map(jnp.shape, tuple(tree))
    if jax.tree.structure(tuple(state[0])) != jax.tree.structure(tuple(state[1])) or shapes(
        state[0]
    ) != shapes(state[1]):
        raise ValueError(
            "`state.momentum` must have the structure and shapes of `state.params`, got "
            f"{shapes(state[1])}."
        )


def check_window_buffer(state, *, b: int, h: int, window: int, d_k: int, d_v: int) -> None:
    """Checks an ``AtlasState``'s buffer of the last window - 1 (key, value, gate) samples."""
    n = window - 1
    fix = f"; build the window buffer with nested.ops.atlas_state(params, window={window}, ...)"
    check_shape("state.keys", state.keys, (b, h, n, d_k), "(B, H, window - 1, d_k)", fix)
    check_shape("state.values", state.values, (b, h, n, d_v), "(B, H, window - 1, d_v)", fix)
    check_shape("state.gates", state.gates, (b, h, n), "(B, H, window - 1)", fix)


def check_pending(pending, inputs) -> None:
    """Checks ``stream``'s pending tokens: one array per input, or None."""
    if pending is not None and len(pending) != len(inputs):
        raise ValueError(
            f"`pending` must hold one array per input ({len(inputs)}), got {len(pending)}; pass "
            "the previous piece's pending with the same inputs."
        )
