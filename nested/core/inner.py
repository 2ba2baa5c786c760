"""The inner loop of a fast level: its update rule stepped over a stream of context items.

Given a level, its fast state (leading dims ``(B, H)``) and the context its owner produced,
``run`` returns the reads ``o (B, T, H, d_v)`` and the final state. The *generic* path needs no
code per rule: for each memory (vmapped over batch and heads) it runs

* an outer ``lax.scan`` over blocks of ``chunk`` tokens, each block under ``jax.checkpoint``
  (the backward pass stores one state per block, not per token), optionally cutting gradients
  every ``truncate`` tokens;
* inside a block, a scan over the level's update chunks of ``every`` tokens: the gradients of
  the objective for every token of the chunk are taken at the chunk-start state ``theta_s``
  (``jax.vmap(jax.grad(objective))``, mini-batch semantics), then the rule is stepped token by
  token on those gradients:

      theta'_t = a_t theta_{t-1}                 (retention gate, if the rule has one)
      g_t      = grad L(a_t theta_s; item_t)
      theta_t  = theta'_t + rule(g_t, gates_t)
      o_t      = f_{theta_t}(q_t)                (or f_{theta_s}(q_t) with read="chunk_start")

With ``every=1``, ``theta_s = theta_{t-1}`` and this is the online per-token definition.
Sequences whose length is not a multiple of the block are padded with inert tokens (masked:
the state does not change).

Document starts (packed sequences, the varlen semantics of flash-linear-attention's
``cu_seqlens``): a context may carry ``starts (B, T)``, True where a new document begins inside
the row, and ``initial``, the state each such document starts from. Every document then runs
exactly as if alone from ``initial``: its parameters, rule state and objective window restart
there, its update chunks of ``every`` tokens (and truncations) are counted from its start and
its last partial chunk ends at its end. The row's first document continues ``state`` as
without starts. The generic path does this with a scan over tokens carrying ``theta_s``
(:func:`run_documents`); a kernel runs such a context only if it declares ``documents=True``.

``run`` uses a kernel of :mod:`nested.core.kernels` instead when one implements the level as
declared (``path="auto"``); ``path="generic"`` always runs the loop above, and
``path="kernel"`` demands a kernel, raising an error that says why none implements the level.
While a probe of :mod:`nested.core.probes` selects the level, the probe runs it instead
(measurements such as :mod:`nested.plasticity.alignment`: the generic loop with an
:class:`UpdateHook` at the end of each update period).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from nested.core import kernels, probes
from nested.core.level import Level, LevelState
from nested.ops import loops

DEFAULT_BLOCK_TOKENS = 64


class Context(NamedTuple):
    """What the owner produces for a fast level: arrays ``(B, T, H, ...)``.

    ``k (B, T, H, d_k)``, ``v (B, T, H, d_v)``, ``q (B, T, H, d_k)``; ``gates`` maps each gate
    name of the level to ``(B, T, H)``, or ``(B, T, H, size)`` for a vector gate.
    ``starts (B, T)`` bool, True where a new document starts (never at position 0), and
    ``initial``, the :class:`LevelState` every such document starts from (the structure,
    dtypes and leading ``(B, H)`` of the state given to :func:`run`): both or neither.
    """

    k: jax.Array
    v: jax.Array
    q: jax.Array
    gates: dict[str, jax.Array]
    starts: jax.Array | None = None
    initial: LevelState | None = None


def document_starts(documents: jax.Array) -> jax.Array:
    """``starts (B, T)`` bool from document ids ``documents (B, T)`` int: True at ``t > 0``
    where ``documents[:, t] != documents[:, t - 1]``."""
    change = documents[:, 1:] != documents[:, :-1]
    return jnp.concatenate([jnp.zeros((len(documents), 1), bool), change], axis=1)


def document_begins(starts: jax.Array) -> jax.Array:
    """``(B, T)`` int32: the position where each position's document begins in its row (0 for
    the row's first document), ``begin_t = max {s <= t : starts_s}``; ``t - begin_t`` is the
    position within the document."""
    T = starts.shape[1]
    return jax.lax.cummax(jnp.where(starts, jnp.arange(T, dtype=jnp.int32), 0), axis=1)


def initial_state(level: Level, params: Any, cache: Any = None) -> LevelState:
    """A level's state at the start of a stream from memory ``params`` with leading (B, H).

    A level whose objective reads a window of ``c > 1`` items (ATLAS's Omega rule) also keeps
    the last ``c - 1`` of them, ``cache["window"]``: ``{"k": (B, H, c - 1, d_k), "v": (B, H,
    c - 1, d_v), "gate": (B, H, c - 1)}``, empty (zero gates) at the start, so a stream split
    across calls sees the same windows as one call.
    """
    opt_state = jax.vmap(jax.vmap(level.rule.transform.init))(params)
    window = window_size(level)
    if window > 1:
        leaf = jax.tree.leaves(params)[0]
        empty = lambda *dims: jnp.zeros((*leaf.shape[:2], window - 1, *dims), leaf.dtype)
        buffer = {"k": empty(level.memory.d_k), "v": empty(level.memory.d_v), "gate": empty()}
        cache = {**(cache or {}), "window": buffer}
    return LevelState(params, opt_state, cache, level.name)


def window_size(level: Level) -> int:
    """Items the level's objective reads per step (1 unless it is windowed, e.g. Omega)."""
    return getattr(level.objective, "window", 1)


def check_context(level: Level, ctx: Context) -> None:
    """Raise ValueError naming the level and field when the context does not fit the memory."""
    where = f"level {level.name!r}"
    if ctx.k.ndim != 4:
        raise ValueError(f"{where}: context k must be (B, T, H, d_k), got shape {ctx.k.shape}")
    lead = ctx.k.shape[:3]
    expect = {"k": level.memory.d_k, "q": level.memory.d_k, "v": level.memory.d_v}
    for field, dim in expect.items():
        shape = getattr(ctx, field).shape
        if shape != (*lead, dim):
            raise ValueError(
                f"{where}: context {field} has shape {shape}, the memory needs {(*lead, dim)}"
            )
    if (ctx.starts is None) != (ctx.initial is None):
        raise ValueError(f"{where}: context starts and initial come together; got one of them")
    if ctx.starts is not None and (ctx.starts.shape != lead[:2] or ctx.starts.dtype != bool):
        raise ValueError(
            f"{where}: context starts must be bool {lead[:2]}, got {ctx.starts.dtype} "
            f"{ctx.starts.shape}"
        )
    missing = set(level.gates) - set(ctx.gates)
    if missing:
        raise ValueError(f"{where}: the owner emits no gate(s) {sorted(missing)}")
    for name, gate in level.gates.items():
        expected = lead if gate.size is None else (*lead, getattr(level.memory, gate.size))
        if ctx.gates[name].shape != expected:
            raise ValueError(
                f"{where}: gate {name!r} has shape {ctx.gates[name].shape}, expected {expected}"
            )


def block_tokens(level: Level) -> int:
    """Tokens per rematerialised block: ``level.chunk`` or the default, a multiple of every
    that divides ``truncate`` when the level truncates."""
    block = level.chunk or max(1, -(-DEFAULT_BLOCK_TOKENS // level.every)) * level.every
    return block if level.truncate is None else math.gcd(block, level.truncate)


PATHS = ("auto", "kernel", "generic")


def kernel_for(level: Level, path: str = "auto", *, documents: bool = False):
    """The kernel ``run`` uses for ``level`` on ``path`` (None: the generic loop).

    ``documents``: the context has document starts, which only a kernel declaring
    ``documents=True`` honours; ``path="auto"`` then falls back to the generic loop.
    """
    if path not in PATHS:
        raise ValueError(f"path={path!r} is unknown; use one of {PATHS}")
    if path == "generic":
        return None
    kernel, reasons = kernels.find(level)
    if kernel is not None and documents and not getattr(kernel, "documents", False):
        if path == "kernel":
            raise ValueError(
                f"level {level.name!r}: kernel {kernel.name!r} does not implement document "
                f"starts (Context.starts); run it with path='auto' or 'generic'"
            )
        return None
    if kernel is None and path == "kernel":
        why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
        raise ValueError(
            f"level {level.name!r}: no kernel implements this declaration ({why}); run it with "
            f"path='auto' or 'generic' (the generic inner loop), or register a kernel in "
            f"nested.core.kernels"
        )
    return kernel


def run(level: Level, state: LevelState, ctx: Context, *, path: str = "auto"):
    """Run a fast level over a sequence. Returns ``(o (B, T, H, d_v), final state)``.

    ``path``: ``"auto"`` (a kernel implementing the declaration, else the generic loop),
    ``"kernel"`` (a kernel or an error) or ``"generic"``; with document starts in ``ctx``,
    only kernels that implement them count (:func:`kernel_for`). The final state keeps the
    dtypes of ``state`` (the context may compute in another one). A probe selecting the level
    (:func:`nested.core.probes.active`) runs it instead, whatever ``path``.
    """
    kernel = kernel_for(level, path, documents=ctx.starts is not None)
    check_context(level, ctx)
    probe = probes.active(level)
    with jax.named_scope(f"inner.{level.name}"):  # a part of lm_throughput --profile
        if probe is not None:
            o, new = probe.run(level, state, ctx)
        else:
            o, new = (run_generic if kernel is None else kernel.run)(level, state, ctx)
    return o, jax.tree.map(lambda n, s: n.astype(s.dtype), new, state)


def read(level: Level, params: Any, q: jax.Array) -> jax.Array:
    """Read every memory: ``params`` leading ``(B, H)``, ``q (B, T, H, d_k) -> (B, T, H, d_v)``."""
    per_memory = jax.vmap(level.memory.apply, in_axes=(None, 0))  # over tokens
    o = jax.vmap(jax.vmap(per_memory))(params, jnp.moveaxis(q, 2, 1))
    return jnp.moveaxis(o, 1, 2)


def run_turns(level: Level, state: LevelState, ctx: Context, turn: int):
    """MemT turn semantics: the sequence is cut into turns of ``turn`` tokens; every token of
    a turn reads the snapshot ``theta_s`` taken at the turn's start, ``o_t = f_{theta_s}(q_t)``,
    and the turn's tokens are written afterwards, token by token (with the level's own rule
    and period, its kernel included). Returns ``(o, final state)`` like :func:`run`. Document
    starts are refused (turns count from the row's start)."""
    if ctx.starts is not None:
        raise ValueError(
            f"level {level.name!r}: MemT turns do not implement document starts; run the "
            f"layer without turn= or without documents"
        )
    T = ctx.k.shape[1]
    full = T // turn * turn
    outputs = []
    if full:
        turns = jax.tree.map(
            lambda x: jnp.moveaxis(x[:, :full].reshape(x.shape[0], -1, turn, *x.shape[2:]), 1, 0),
            ctx,
        )

        def step(state, turn_ctx):
            with probes.repeated("MemT turns (a scan over turns)"):
                return run(level, state, turn_ctx)[1], read(level, state.params, turn_ctx.q)

        state, o = jax.lax.scan(step, state, turns)
        outputs.append(jnp.moveaxis(o, 0, 1).reshape(ctx.k.shape[0], full, *o.shape[3:]))
    if full < T:
        tail = jax.tree.map(lambda x: x[:, full:], ctx)
        outputs.append(read(level, state.params, tail.q))
        state = run(level, state, tail)[1]
    return jnp.concatenate(outputs, axis=1), state


def _select(mask, new, old):
    return jax.tree.map(lambda n, o: jnp.where(mask, n, o), new, old)


def select_rows(flag: jax.Array, new, old):
    """``new`` in the rows where ``flag (B,)`` is set, else ``old``, leaf by leaf (leaves with
    a leading batch dim): a fresh state for the rows whose call starts a document."""
    return jax.tree.map(
        lambda n, o: jnp.where(flag.reshape(flag.shape + (1,) * (n.ndim - 1)), n, o), new, old
    )


def retained(level: Level, params: Any, item: dict) -> Any:
    """``a_t theta``: the state after the rule's retention gate (identity without one).

    A ``log_decay`` gate retains ``exp(a)``; a vector gate scales the last axis of each leaf.
    """
    name = level.rule.retain
    if name is None:
        return params
    a = item[name]
    if level.gates[name].kind == "log_decay":
        a = jnp.exp(a)
    return jax.tree.map(lambda p: p * a.reshape((1,) * (p.ndim - a.ndim) + a.shape), params)


def objective_grad(level: Level, params: Any, item: dict) -> Any:
    """Gradient of the level's objective for one item, at the retained ``params``."""
    at = retained(level, params, item)
    return jax.grad(lambda p: level.objective(level.memory, p, item))(at)


def rule_step(level: Level, params: Any, opt_state: Any, grad: Any, item: dict):
    """One step of the level's rule: ``theta' = a theta``, ``theta = theta' + rule(grad)``.

    Returns ``(params, opt_state)``; the gates are read from ``item``.
    """
    rule = level.rule
    gates = {name: item[name] for name in rule.gates}
    params = retained(level, params, item)
    updates, opt_state = rule.transform.update(grad, opt_state, params, **gates)
    return optax.apply_updates(params, updates), opt_state


class UpdateHook(NamedTuple):
    """A function applied at the end of every update period of the generic loop.

    ``fn(start, end, local_grad, x) -> (end, stats)`` for one memory: ``start`` and ``end``
    are its parameters at the period's start and end, ``local_grad`` the gradient of the
    level's objective summed over the period's tokens (each taken at ``start``, as the rule
    takes it), ``x`` this update's slice of ``inputs``; it returns the parameters the next
    period starts from and a pytree of per-update statistics. ``inputs``: a pytree of arrays
    ``(B, H, U)``, ``U = ceil(T / every)``, one value per memory and update. With
    ``fixed_gradients`` every gradient of the objective is taken at ``stop_gradient`` of the
    state, so a change of the state reaches later tokens through the reads and the rule's
    linear carry (retention), not through the later updates.
    """

    fn: Callable[[Any, Any, Any, Any], tuple[Any, Any]]
    inputs: Any
    fixed_gradients: bool = False


def _chunk_step(level: Level, hook: UpdateHook | None, carry, chunk):
    """One update chunk of ``every`` tokens for one memory; returns the reads (and the hook's
    statistics, with a hook)."""
    params_start, _ = carry
    items, mask, x = chunk
    at = params_start
    if hook is not None and hook.fixed_gradients:
        at = jax.lax.stop_gradient(at)
    grads = jax.vmap(lambda item: objective_grad(level, at, item))(items)

    def token(carry, inputs):
        grad, item, valid = inputs
        new = rule_step(level, *carry, grad, item)
        params, opt_state = _select(valid, new, carry)
        read_params = params if level.read == "after_write" else params_start
        return (params, opt_state), level.memory.apply(read_params, item["q"])

    (params, opt_state), o = jax.lax.scan(token, carry, (grads, items, mask))
    if hook is None:
        return (params, opt_state), o
    local = jax.tree.map(lambda g: jnp.tensordot(mask.astype(g.dtype), g, axes=1), grads)
    params, stats = hook.fn(params_start, params, local, x)
    return (params, opt_state), (o, stats)


def _run_one(level, params, opt_state, items, mask, n_blocks: int, block: int, hook, x):
    """The generic inner loop for one memory: ``items`` leaves are ``(T_padded, ...)``, the
    hook's inputs ``x`` leaves ``(T_padded / every,)``."""
    every = level.every
    per_block = block // every

    def reshape(x):
        return x.reshape(n_blocks, per_block, every, *x.shape[1:])

    blocks = jax.tree.map(reshape, (items, mask))
    blocks = (*blocks, jax.tree.map(lambda a: a.reshape(n_blocks, per_block), x))

    @jax.checkpoint
    def block_step(carry, block_inputs):
        return jax.lax.scan(lambda c, x: _chunk_step(level, hook, c, x), carry, block_inputs)

    cut_every = None if level.truncate is None else level.truncate // block

    def outer(carry, inputs):
        index, block_inputs = inputs
        if cut_every is not None:
            cut = (index > 0) & (index % cut_every == 0)
            carry = jax.tree.map(lambda x: jnp.where(cut, jax.lax.stop_gradient(x), x), carry)
        return block_step(carry, block_inputs)

    (params, opt_state), out = jax.lax.scan(
        outer, (params, opt_state), (jnp.arange(n_blocks), blocks)
    )
    o, stats = (out, None) if hook is None else out
    stats = jax.tree.map(lambda a: a.reshape(n_blocks * per_block, *a.shape[2:]), stats)
    return o.reshape(n_blocks * block, -1), params, opt_state, stats


def windowed(
    items: dict, window: int, names, buffer: dict, starts=None, fresh=None
) -> tuple[dict, dict]:
    """For each named item ``(B, T, H, ...)``, the last ``window`` values at every step,
    ``(B, T, H, window, ...)`` oldest first, the first ones from ``buffer`` (the previous
    call's last ``window - 1`` items, ``(B, H, window - 1, ...)``, keyed ``k``, ``v`` and
    ``gate`` for the names in that order). Returns them and the buffer for the next call.

    With document ``starts (B, T)``, slot ``j`` of step ``t`` in a document beginning at
    ``b > 0`` holds item ``t - window + 1 + j`` if that is ``>= b``, else entry ``t - b + j`` of
    ``fresh`` (the buffer a document starts with, laid out as ``buffer``)."""
    out, tail = {}, {}
    for name, key in zip(names, ("k", "v", "gate"), strict=True):
        x = jnp.moveaxis(items[name], 1, 2)  # (B, H, T, ...)
        T = x.shape[2]
        full = jnp.concatenate([buffer[key].astype(x.dtype), x], axis=2)
        stacked = jnp.stack([full[:, :, i : i + T] for i in range(window)], axis=3)
        if starts is not None:
            begin = document_begins(starts)[:, :, None]  # (B, T, 1)
            slot = jnp.arange(window)[None, None]
            t = jnp.arange(T)[None, :, None]
            before = (begin > 0) & (t - window + 1 + slot < begin)  # (B, T, window)
            index = jnp.clip(t - begin + slot, 0, window - 2)
            first = jax.vmap(lambda f, i: f[:, i])(fresh[key].astype(x.dtype), index)
            before = before.reshape(before.shape[0], 1, *before.shape[1:], *(1,) * (x.ndim - 3))
            stacked = jnp.where(before, first, stacked)
        out[name] = jnp.moveaxis(stacked, 2, 1)
        tail[key] = stacked[:, :, -1, 1:].astype(buffer[key].dtype)
    return out, tail


def run_generic(level: Level, state: LevelState, ctx: Context):
    """The rule-agnostic inner loop (see the module docstring)."""
    o, state, _ = run_hooked(level, state, ctx, None)
    return o, state


def _items(level: Level, ctx: Context, cache):
    """The context as items ``{"k", "v", "q", gate names: (B, T, H, ...)}``, windows stacked
    for a windowed objective (:func:`windowed`), and the cache after them."""
    items = {"k": ctx.k, "v": ctx.v, "q": ctx.q, **ctx.gates}
    window = window_size(level)
    if window > 1:
        names = ("k", "v", level.objective.gate)
        fresh = None if ctx.initial is None else ctx.initial.cache["window"]
        stacked, buffer = windowed(items, window, names, cache["window"], ctx.starts, fresh)
        items.update(stacked)
        cache = {**cache, "window": buffer}
    return items, cache


def _blocked_items(level: Level, ctx: Context, cache):
    """:func:`_items`, padded to whole blocks of :func:`block_tokens` and laid out ``(B, T, H,
    ...) -> (B, H, T + pad, ...)`` (the vmaps over B, then H see one memory's stream).
    Returns ``(items, cache, n_blocks, block, pad)``."""
    items, cache = _items(level, ctx, cache)
    T = ctx.k.shape[1]
    block = block_tokens(level)
    n_blocks = -(-T // block)
    pad = n_blocks * block - T
    items = jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)), items)
    return jax.tree.map(lambda x: jnp.moveaxis(x, 2, 1), items), cache, n_blocks, block, pad


def run_hooked(level: Level, state: LevelState, ctx: Context, hook: UpdateHook | None):
    """The generic inner loop with ``hook`` applied at the end of every update period.

    Returns ``(o, final state, stats)``: ``stats`` the hook's per-update statistics with
    leading ``(B, H, U)`` (None without a hook). A context with document starts runs
    :func:`run_documents` (no hook).
    """
    if ctx.starts is not None:
        if hook is not None:
            raise ValueError(
                f"level {level.name!r}: update hooks (probes) do not run on a context with "
                f"document starts; measure without documents"
            )
        return (*run_documents(level, state, ctx), None)
    T = ctx.k.shape[1]
    items, cache, n_blocks, block, pad = _blocked_items(level, ctx, state.cache)
    mask = jnp.arange(T + pad) < T
    updates = -(-T // level.every)
    padded_updates = (T + pad) // level.every
    x = None
    if hook is not None:
        x = jax.tree.map(
            lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, padded_updates - updates)]), hook.inputs
        )

    def one(params, opt_state, items, x):
        return _run_one(level, params, opt_state, items, mask, n_blocks, block, hook, x)

    o, params, opt_state, stats = jax.vmap(jax.vmap(one))(state.params, state.opt_state, items, x)
    o = jnp.moveaxis(o, 1, 2)[:, :T]
    stats = jax.tree.map(lambda a: a[:, :, :updates], stats)
    return o, state.replace(params=params, opt_state=opt_state, cache=cache), stats


def _document_flags(level: Level, starts: jax.Array, T_padded: int) -> dict:
    """Per-step flags ``(B, T_padded)`` bool of a context with document ``starts (B, T)``:
    ``start`` (a document starts), ``chunk`` (an update chunk starts: the position within
    the document is a multiple of ``every``), ``cut`` (gradients stop: a positive multiple of
    ``truncate`` within the document), ``valid`` (not padding)."""
    B, T = starts.shape
    starts = jnp.pad(starts, [(0, 0), (0, T_padded - T)])
    position = jnp.arange(T_padded)[None] - document_begins(starts)
    valid = jnp.broadcast_to(jnp.arange(T_padded)[None] < T, (B, T_padded))
    cut = jnp.zeros_like(starts)
    if level.truncate is not None:
        cut = valid & (position > 0) & (position % level.truncate == 0)
    return {"start": starts, "chunk": position % level.every == 0, "cut": cut, "valid": valid}


def _run_one_documents(level, params, opt_state, initial, items, flags, n_blocks: int):
    """The inner loop of one memory over a stream of documents: a scan over tokens whose
    carry holds the state and the chunk-start parameters ``theta_s``. At a document start
    the state is ``initial`` (``(params, opt_state)``); at a chunk start ``theta_s`` is the
    state; every gradient is taken at ``theta_s``. Leaves of ``items`` and ``flags`` are
    ``(T_padded, ...)``; blocks of ``T_padded / n_blocks`` tokens are rematerialised."""

    def token(carry, inputs):
        params, opt_state, start = carry
        item, flag = inputs
        params, opt_state = _select(flag["start"], initial, (params, opt_state))
        params, opt_state = _select(
            flag["cut"], jax.lax.stop_gradient((params, opt_state)), (params, opt_state)
        )
        start = _select(flag["chunk"], params, start)
        grad = objective_grad(level, start, item)
        new = rule_step(level, params, opt_state, grad, item)
        params, opt_state = _select(flag["valid"], new, (params, opt_state))
        read_params = params if level.read == "after_write" else start
        return (params, opt_state, start), level.memory.apply(read_params, item["q"])

    blocks = jax.tree.map(lambda x: x.reshape(n_blocks, -1, *x.shape[1:]), (items, flags))
    block_step = lambda carry, block: jax.lax.scan(token, carry, block)
    (params, opt_state, _), o = loops.remat_scan(block_step, (params, opt_state, params), blocks)
    return o.reshape(-1, o.shape[-1]), params, opt_state


def run_documents(level: Level, state: LevelState, ctx: Context):
    """The generic inner loop on a context with document starts: each document runs as if
    alone from ``ctx.initial`` (its update chunks counted from its start, windows holding
    none of the previous document's items); the row's first one continues ``state``.
    Returns ``(o (B, T, H, d_v), final state)``."""
    T = ctx.k.shape[1]
    items, cache, n_blocks, _, pad = _blocked_items(level, ctx, state.cache)
    flags = _document_flags(level, ctx.starts, T + pad)
    initial = (ctx.initial.params, ctx.initial.opt_state)

    def one(params, opt_state, initial, items, flags):
        return _run_one_documents(level, params, opt_state, initial, items, flags, n_blocks)

    per_head = jax.vmap(one, in_axes=(0, 0, 0, 0, None))
    o, params, opt_state = jax.vmap(per_head)(state.params, state.opt_state, initial, items, flags)
    o = jnp.moveaxis(o, 1, 2)[:, :T]
    return o, state.replace(params=params, opt_state=opt_state, cache=cache)
