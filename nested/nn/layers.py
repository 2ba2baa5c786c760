"""Token-mixing layers whose memory is a fast level (Flax NNX).

:class:`MemoryLayer` is the owner side of a fast level: it holds the slow parameters that
produce the level's context (query/key/value and gate projections, an optional short causal
convolution) and the level's learned initial state ``theta_0``, runs the level's inner loop
over the sequence, and maps the reads back to the model width. Everything it holds is trained
by the outer level through the inner loop.

Layers are pure with respect to fast state: ``layer(x, state) -> (y, state)``, where ``state``
is a :class:`nested.core.level.LevelState` with leading ``(B, H)`` dims; ``layer.initial_state(B)``
builds the state a sequence starts from (differentiable in ``theta_0``). A call may take document
``starts (B, T)`` (packed sequences): every document starting inside the call begins at the
initial state, and nothing (convolution, key shift) mixes tokens across a start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested.core import inner
from nested.core.level import InitialState, Level, LevelState
from nested.ops import functions


def dense(in_features: int, out_features: int, *, rngs: nnx.Rngs, **kwargs) -> nnx.Linear:
    """``nnx.Linear`` with its product's gradients written out (``dx = g W^T``, ``dW = x^T g``:
    :func:`nested.ops.functions.dense_dot_general`, the same numbers, faster on XLA:CPU); the
    dense layer of every nested model."""
    return nnx.Linear(
        in_features, out_features, dot_general=functions.dense_dot_general, rngs=rngs, **kwargs
    )


class ShortConv(nnx.Module):
    """Depthwise causal convolution over time, ``y_t = silu(sum_i w_i * x_{t-i})``.

    ``x (B, T, F)``; the cache holds the last ``width - 1`` inputs ``(B, width - 1, F)`` so a
    sequence processed in pieces gives the same result as in one call. With document
    ``starts (B, T)`` no input of an earlier document reaches a later one: each document
    starts from the empty (zero) cache.
    """

    def __init__(self, features: int, width: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.width = width
        init = jax.random.normal(rngs.params(), (width, features), param_dtype) / width
        self.kernel = nnx.Param(init.at[-1].add(1.0))  # start near the identity

    def initial_cache(self, batch_size: int) -> jax.Array:
        """At least float32 whatever the compute precision: a carried stream keeps one dtype."""
        dtype = jnp.promote_types(self.kernel.dtype, jnp.float32)
        return jnp.zeros((batch_size, self.width - 1, self.kernel.shape[1]), dtype)

    def __call__(self, x: jax.Array, cache: jax.Array, starts=None) -> tuple[jax.Array, jax.Array]:
        """``x (B, T, *F)`` whose features ``F`` flatten to the kernel's; the cache keeps its
        shape ``(B, width - 1, prod(F))``. Features kept apart (Hope's ``(3, dim)``) are never
        merged into one dim: a merge of a split dim costs a reshard on a mesh."""
        B, T, *features = x.shape
        lead = (1,) * len(features)
        window = cache.reshape(B, self.width - 1, *features).astype(x.dtype)
        padded = jnp.concatenate([window, x], axis=1)
        taps = [padded[:, i : i + T] for i in range(self.width)]  # x_{t - width + 1 + i}
        tail = padded[:, T:]
        if starts is not None:  # inputs of an earlier document read as the empty cache's zeros
            keep = same_document(starts, self.width).astype(x.dtype)
            taps = [tap * keep[:, :, i].reshape(B, T, *lead) for i, tap in enumerate(taps)]
            tail = jnp.stack([tap[:, -1] for tap in taps[1:]], axis=1)
        kernel = self.kernel[...].astype(x.dtype).reshape(self.width, *features)
        y = sum(kernel[None, None, i] * tap for i, tap in enumerate(taps))
        return jax.nn.silu(y), tail.reshape(cache.shape).astype(cache.dtype)


def same_document(starts: jax.Array, width: int) -> jax.Array:
    """``(B, T, width)`` bool: whether input ``t - width + 1 + i`` (the cache before position
    0) belongs to the document of position ``t``, given document ``starts (B, T)``; the row's
    first document owns the cache."""
    T = starts.shape[1]
    begin = inner.document_begins(starts)[:, :, None]
    source = jnp.arange(T)[None, :, None] - width + 1 + jnp.arange(width)[None, None]
    return (begin == 0) | (source >= begin)


def initial_memories(memory, key: jax.Array, count: int | None) -> InitialState:
    """The learned initial state ``theta_0`` of ``count`` memories (leading dim; None: one),
    float32."""
    params = (
        memory.init(key) if count is None else jax.vmap(memory.init)(jax.random.split(key, count))
    )
    return InitialState(jax.tree.map(lambda p: p.astype(jnp.float32), params))


def per_sequence(tree, batch_size: int):
    """``tree`` broadcast to a leading batch dim: every sequence starts from the same state."""
    return jax.tree.map(lambda p: functions.broadcast_rows(p, batch_size), tree)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class MemoryLayer(nnx.Module):
    """A sequence mixer whose memory is the fast level ``level`` (one memory per head).

    Context: ``k_t = W_k x_t``, ``v_t = W_v x_t``, ``q_t = W_q x_t`` per head (after an optional
    short causal convolution; keys and queries L2-normalised by default) and one projection
    per gate of the level (``(B, T, H)``, in the gate's range by construction). Output:
    ``y_t = W_o [norm(o_t) * sigmoid(W_g x_t)]`` with ``o_t`` the level's read of ``q_t``.

    Args:
      level: the fast level (its memory fixes ``d_k``, ``d_v``).
      dim: model width; heads: number of memory heads.
      conv: width of the short causal convolution on q, k, v (0 disables it).
      normalize_keys: L2-normalise keys and queries per head (needed by the delta family).
      output_gate: multiply the normalised reads by a sigmoid gate of the input.
      key_shift: write the previous token's key with the current value,
        ``x_t = k_{t-1}`` (Falcon's temporal alignment: predict the next latent).
      turn: MemT turn semantics with turns of ``turn`` tokens: every token of a turn reads
        the memory snapshot taken at the start of the turn; the turn is written token by
        token afterwards (:func:`nested.core.inner.run_turns`).
      experts: Mixture-of-Storage (MemT): ``experts`` memories per head sharing the head's
        keys, values and queries, each with its own gates, combined by dense learned routing:
        the write gate ``write_gate`` of expert ``e`` is scaled by ``softmax_e(W_w x_t)`` and
        the reads are mixed by ``softmax_e(W_r x_t)``.
    """

    def __init__(
        self,
        level: Level,
        *,
        dim: int,
        heads: int,
        rngs: nnx.Rngs,
        conv: int = 4,
        normalize_keys: bool = True,
        output_gate: bool = True,
        key_shift: bool = False,
        turn: int | None = None,
        experts: int = 1,
        write_gate: str | None = None,
    ):
        if level.is_outer:
            raise ValueError(f"level {level.name!r} is the outermost level, not a fast level")
        if experts > 1 and write_gate not in level.gates:
            raise ValueError(
                f"level {level.name!r}: Mixture-of-Storage routes writes through a gate; set "
                f"write_gate to one of {sorted(level.gates)}"
            )
        if turn is not None and turn < 1:
            raise ValueError(f"turn={turn} must be a positive number of tokens or None")
        self.level = level
        self.heads, self.experts = heads, experts
        self.normalize_keys, self.key_shift, self.turn = normalize_keys, key_shift, turn
        self.write_gate = write_gate
        d_k, d_v = level.memory.d_k, level.memory.d_v
        memories = heads * experts
        linear = lambda n_in, n_out, **kw: dense(n_in, n_out, rngs=rngs, **kw)
        self.qkv = linear(dim, heads * (2 * d_k + d_v), use_bias=False)
        self.conv = ShortConv(heads * (2 * d_k + d_v), conv, rngs=rngs) if conv > 1 else None
        self.gates = nnx.Dict(
            {
                name: linear(
                    dim,
                    memories * self._gate_size(gate),
                    bias_init=nnx.initializers.constant(gate.bias()),
                )
                for name, gate in level.gates.items()
            }
        )
        self.routes = linear(dim, 2 * memories) if experts > 1 else None
        self.initial_params = initial_memories(level.memory, rngs.params(), memories)
        self.norm = nnx.RMSNorm(d_v, rngs=rngs)
        self.gate_out = linear(dim, heads * d_v) if output_gate else None
        self.out = linear(heads * d_v, dim, use_bias=False)

    def initial_cache(self, batch_size: int) -> dict:
        """The layer's own per-stream state at a sequence's start (convolution, key shift)."""
        cache = {}
        if self.conv is not None:
            cache["conv"] = self.conv.initial_cache(batch_size)
        if self.key_shift:
            cache["key"] = jnp.zeros((batch_size, self.heads, self.level.memory.d_k), jnp.float32)
        return cache

    def initial_state(self, batch_size: int) -> LevelState:
        """The state a sequence starts from: the learned ``theta_0`` for every batch element."""
        params = per_sequence(self.initial_params.get_value(), batch_size)
        return inner.initial_state(self.level, params, self.initial_cache(batch_size))

    def context(self, x: jax.Array, cache: dict, starts=None):
        """Project ``x (B, T, dim)`` to the level's context; returns ``(Context, cache)``.

        With document ``starts (B, T)`` the convolution and the key shift do not reach across
        a start, and the context carries the starts and this layer's initial state."""
        B, T, _ = x.shape
        d_k, d_v = self.level.memory.d_k, self.level.memory.d_v
        cache = dict(cache)
        qkv = self.qkv(x)
        if self.conv is not None:
            qkv, cache["conv"] = self.conv(qkv, cache["conv"], starts)
        qkv = qkv.reshape(B, T, self.heads, 2 * d_k + d_v)
        q, k, v = jnp.split(qkv, [d_k, 2 * d_k], axis=-1)
        if self.normalize_keys:
            q, k = l2_normalize(q), l2_normalize(k)
        if self.key_shift:
            previous = cache["key"].astype(k.dtype)[:, None]
            k, cache["key"] = (
                jnp.concatenate([previous, k[:, :-1]], 1),
                k[:, -1].astype(cache["key"].dtype),
            )
            if starts is not None:  # a document's first key is the empty cache's
                k = jnp.where(starts[:, :, None, None], 0, k)
        gates = {}
        for name, proj in self.gates.items():
            gate = self.level.gates[name]
            shape = (B, T, -1) if gate.size is None else (B, T, -1, self._gate_size(gate))
            gates[name] = gate.activate(proj(x)).reshape(shape)
        if self.experts > 1:
            repeat = lambda a: jnp.repeat(a, self.experts, axis=2)
            q, k, v = repeat(q), repeat(k), repeat(v)
            write, _ = self._routes(x)
            gate = gates[self.write_gate]
            write = write.reshape(B, T, -1)
            gates[self.write_gate] = gate * write.reshape(write.shape + (1,) * (gate.ndim - 3))
        ctx = inner.Context(k=k, v=v, q=q, gates=gates)
        if starts is not None:
            ctx = ctx._replace(starts=starts, initial=self.initial_state(B))
        return ctx, cache

    def _gate_size(self, gate) -> int:
        return 1 if gate.size is None else getattr(self.level.memory, gate.size)

    def _routes(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Write and read routing weights ``(B, T, H, E)``, each a softmax over experts."""
        B, T, _ = x.shape
        logits = self.routes(x).reshape(B, T, 2, self.heads, self.experts)
        routes = jax.nn.softmax(logits, axis=-1)
        return routes[:, :, 0], routes[:, :, 1]

    def __call__(
        self, x: jax.Array, state: LevelState, starts=None
    ) -> tuple[jax.Array, LevelState]:
        """``x (B, T, dim) -> (y (B, T, dim), state)``; with document ``starts (B, T)`` bool
        every document starting inside ``x`` starts from :meth:`initial_state`."""
        with jax.named_scope("projections"):  # the level's context from x
            ctx, cache = self.context(x, state.cache, starts)
        if self.turn is None:
            o, state = inner.run(self.level, state, ctx)
        else:
            o, state = inner.run_turns(self.level, state, ctx, self.turn)
        return self.readout(o, x), state.replace(cache=cache)

    def retrieve(self, params, q: jax.Array, x: jax.Array) -> jax.Array:
        """Read the memories ``params`` without writing: queries ``q (B, T, H, d_k)`` of ``x
        (B, T, dim)``, normalised as the layer's own and shared by a head's experts, read and
        mapped to the model width by :meth:`readout`."""
        if self.normalize_keys:
            q = l2_normalize(q)
        q = jnp.repeat(q, self.experts, axis=2)
        return self.readout(inner.read(self.level, params, q), x)

    def readout(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """The reads ``o (B, T, H * experts, d_v)`` of the queries of ``x (B, T, dim)`` mapped to
        the model width: experts mixed by their read routes, normalised, gated, projected. The
        reads come in the fast state's precision and go on in the activations' (``x``'s)."""
        B, T, _ = x.shape
        o = o.astype(x.dtype)
        if self.experts > 1:
            _, read = self._routes(x)
            o = jnp.sum(o.reshape(B, T, self.heads, self.experts, -1) * read[..., None], axis=3)
        o = self.norm(o)
        if self.gate_out is not None:
            o = o * jax.nn.sigmoid(self.gate_out(x)).reshape(o.shape)
        return self.out(o.reshape(B, T, -1))
