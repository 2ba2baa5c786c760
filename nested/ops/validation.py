"""Argument checks shared by the linear-memory ops, run on shapes before any tracing.

Each check raises ``ValueError`` naming the argument, the shape it must have and how to fix it,
so a wrong call fails at the call site instead of deep inside ``lax.scan``.
"""

from collections.abc import Sequence

import jax.numpy as jnp


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"`{name}` must have shape {expected}, got {tuple(got)}.")


def check_qkv(q, k, v, *, key_name: str = "k") -> tuple[int, int, int, int, int]:
    """Checks ``q (B, T, H, d_k)``, ``k (B, T, H, d_k)``, ``v (B, T, H, d_v)``.

    Returns ``(B, T, H, d_k, d_v)``.
    """
    if q.ndim != 4:
        _fail("q", "(B, T, H, d_k)", q.shape)
    b, t, h, dk = q.shape
    if t < 1:
        raise ValueError("`q` must hold at least one token (T >= 1), got T = 0.")
    if k.shape != q.shape:
        _fail(key_name, f"(B, T, H, d_k) = {q.shape} like `q`", k.shape)
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        _fail("v", f"(B, T, H, d_v) with (B, T, H) = {(b, t, h)} like `q`", v.shape)
    for name, x in (("q", q), (key_name, k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"`{name}` must be a floating array, got dtype {x.dtype}.")
    return b, t, h, dk, v.shape[-1]


def check_shape(name: str, x, expected: Sequence[int], layout: str) -> None:
    """Checks ``x.shape == expected``; ``layout`` names the axes, e.g. ``"(B, T, H)"``."""
    if x is None or tuple(x.shape) != tuple(expected):
        _fail(name, f"{layout} = {tuple(expected)}", () if x is None else x.shape)


def check_state(initial_state, b: int, h: int, dv: int, dk: int) -> None:
    """Checks an optional memory state of shape ``(B, H, d_v, d_k)``."""
    if initial_state is not None:
        check_shape("initial_state", initial_state, (b, h, dv, dk), "(B, H, d_v, d_k)")


def check_chunk_size(chunk_size, *, required: bool = False) -> None:
    """Checks that ``chunk_size`` is a positive Python int (or None when not ``required``)."""
    if chunk_size is None and not required:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"`chunk_size` must be a positive int{'' if required else ' or None'}, "
            f"got {chunk_size!r}."
        )
