"""Self-modifying memory (Hope; Behrouz et al. 2025, "Nested Learning").

In a plain memory layer the maps producing the memory's keys, values and queries are slow
weights. Here they are themselves fast memories, updated in context, so the layer modifies
how its memory learns. Three levels are involved:

* ``memory``: the fast memory reading and writing the sequence (e.g. Titans), any period;
* ``projections``: three linear memories ``P_k, P_v, P_q (dim, dim)`` producing its context,
  ``k_t = P_k x_t``, ``v_t = P_v x_t``, ``q_t = P_q x_t`` (split into heads), updated every
  ``C = projections.every`` tokens on *self-generated* targets: each ``P_c`` regresses
  ``x_t -> P_c v_t``, the projection applied to the value the layer produced, i.e. one step of
  the projection level's rule on ``1/2 |P_c x_t - P_c v_t|^2`` (all evaluated at the chunk's
  start, mini-batch semantics), with a learned per-token step size;
* the outer level, owning the projections' initial values, the gates and the output map.

The projections form a recurrence of their own (their targets are their own projections of
the values, never the memory's reads), so the layer runs it first, a scan over chunks of ``C``
tokens: project each token with its period's ``P`` (then a short causal convolution over time,
as in Titans, carried across calls: a one-layer model needs it to pair a key with the next
token's value), and at the period's end step the projection level on the period's tokens.
The memory then runs once over the whole sequence (its own kernel, its own periods). Gates of
the memory come from slow projections of ``x``. The whole thing is differentiated exactly by
the outer level (no stop-gradient through the writes).

Document starts ``(B, T)`` (packed sequences): every document runs as if alone. The memory and
the convolution restart at its start (the varlen semantics of ``nested.core.inner``); its
tokens are projected with the initial projections until its first period ends, ``C`` tokens
after its start, and its periods are counted from its start: a chunk of the row then holds
the end of at most one period (that of the document running at the chunk's first token), its
tokens before that end projected with the old ``P``, the ones after with the updated ``P``
(:func:`_schedule`). The state returned after the last token has the last document's
unfinished period applied, as a call over that document alone would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested.core import inner, probes
from nested.core.level import InitialState, Level
from nested.nn.layers import ShortConv, dense, initial_memories, l2_normalize, per_sequence
from nested.ops import documents, loops


class SelfModifyingLayer(nnx.Module):
    """Hope's self-modifying memory mixer: ``x (B, T, dim) -> (B, T, dim)``.

    Needs ``dim == heads * d_k == heads * d_v`` of the memory level (the self-generated
    targets apply the projections to values), and a projection level whose memory maps
    ``dim -> dim`` and whose update rule reads at most one gate (the step size).
    """

    def __init__(
        self,
        level: Level,
        *,
        projections: Level,
        dim: int,
        heads: int,
        rngs: nnx.Rngs,
        conv: int = 4,
        output_gate: bool = True,
    ):
        d_k, d_v = level.memory.d_k, level.memory.d_v
        if heads * d_k != dim or heads * d_v != dim:
            raise ValueError(
                f"level {level.name!r}: a self-modifying memory needs heads * d_k == heads * d_v"
                f" == dim, got heads={heads}, d_k={d_k}, d_v={d_v}, dim={dim}"
            )
        if (projections.memory.d_k, projections.memory.d_v) != (dim, dim):
            raise ValueError(
                f"level {projections.name!r}: projection memories must map dim -> dim = {dim}"
            )
        if projections.every % level.every:
            raise ValueError(
                f"level {level.name!r}: every={level.every} does not divide the period "
                f"every={projections.every} of its owner {projections.name!r}"
            )
        if len(projections.gates) > 1:
            raise ValueError(
                f"level {projections.name!r}: projection updates read at most one gate (the "
                f"step size), got {sorted(projections.gates)}"
            )
        self.level, self.projections = level, projections
        self.heads = heads
        linear = lambda n_in, n_out, **kw: dense(n_in, n_out, rngs=rngs, **kw)
        self.gates = nnx.Dict(
            {
                name: linear(dim, heads, bias_init=nnx.initializers.constant(gate.bias()))
                for name, gate in level.gates.items()
            }
        )
        self.projection_gates = nnx.Dict(
            {
                name: linear(dim, 3, bias_init=nnx.initializers.constant(gate.bias()))
                for name, gate in projections.gates.items()
            }
        )
        self.conv = ShortConv(3 * dim, conv, rngs=rngs) if conv > 1 else None
        init = jax.random.normal(rngs.params(), (3, dim, dim), jnp.float32) / jnp.sqrt(dim)
        self.initial_projections = InitialState(init)
        self.initial_params = initial_memories(level.memory, rngs.params(), heads)
        self.norm = nnx.RMSNorm(d_v, rngs=rngs)
        self.gate_out = linear(dim, dim) if output_gate else None
        self.out = linear(dim, dim, use_bias=False)

    def initial_state(self, batch_size: int) -> dict:
        memory = per_sequence(self.initial_params.get_value(), batch_size)
        projections = ({"w": per_sequence(self.initial_projections[...], batch_size)},)
        cache = None if self.conv is None else {"conv": self.conv.initial_cache(batch_size)}
        return {
            "memory": inner.initial_state(self.level, memory, cache),
            "projections": inner.initial_state(self.projections, projections),
        }

    def _period(self, carry, chunk):
        """One chunk of ``C`` tokens of the projection recurrence (module docstring).

        ``carry = (projection state, convolution cache, previous chunk's items)``; ``chunk``:
        ``x (B, C', dim)`` and the projection gates ``(B, C', 3)``, and with documents the
        schedule of :func:`_schedule` (``mode``, ``end``, ``update``, ``restart``) and
        ``starts (B, C)``. Returns the carry and ``(kvq, targets)``, each ``(B, C', 3, dim)``:
        the tokens' projections before the convolution and their projected values."""
        state, cache, previous = carry
        x, gates = chunk["x"], chunk["gates"]
        project = lambda P, a: jnp.einsum("bpoi,bti->btpo", P, a)

        def values(kvq, cache):  # the convolved values, (B, C', dim)
            if self.conv is None:
                return kvq[:, :, 1], cache
            y, cache = self.conv(kvq, cache, chunk.get("starts"))
            return y[:, :, 1], cache

        P = state.params[0]["w"]
        if "mode" not in chunk:  # no documents: the chunk is one period of the row's grid
            kvq = project(P, x)
            v, cache = values(kvq, cache)
            targets = project(P, v)
            state = inner.run(self.projections, state, self._context(x, targets, gates))[1]
            return (state, cache, previous), (kvq, targets)
        B, C, _ = x.shape
        fresh = self.initial_state(B)["projections"]
        if cache is not None:
            cache = inner.select_rows(chunk["restart"], jnp.zeros_like(cache), cache)
        # The running period: the previous chunk's tokens from `end` on, this chunk's before
        # `end` (projected with P); then the period's update gives the next projections.
        v, _ = values(project(P, x), cache)
        current = {"x": x, "targets": project(P, v), "gates": gates}
        window = jax.tree.map(
            lambda p, c: jax.vmap(lambda a, e: jax.lax.dynamic_slice_in_dim(a, e, C))(
                jnp.concatenate([p, c], axis=1), chunk["end"]
            ),
            previous,
            current,
        )
        ctx = self._context(window["x"], window["targets"], window["gates"])
        new = inner.run(self.projections, state, ctx)[1]
        new = inner.select_rows(chunk["update"], new, state)
        mode = chunk["mode"][:, :, None, None]
        by_mode = lambda a: jnp.where(
            mode == 0,
            project(P, a),
            jnp.where(mode == 1, project(new.params[0]["w"], a), project(fresh.params[0]["w"], a)),
        )
        kvq = by_mode(x)
        v, cache = values(kvq, cache)
        targets = by_mode(v)
        state = inner.select_rows(chunk["mode"][:, -1] == 2, fresh, new)
        items = {"x": x, "targets": targets, "gates": gates}
        return (state, cache, items), (kvq, targets)

    def _context(self, x, targets, gates) -> inner.Context:
        """The projection level's context: inputs ``x (B, n, dim)`` regressed onto ``targets
        (B, n, 3, dim)``, one "head" per projection, gates ``(B, n, 3)``."""
        inputs = jnp.broadcast_to(x[:, :, None], targets.shape)
        return inner.Context(k=inputs, v=targets, q=inputs, gates=gates)

    def _projections(self, x, state, starts):
        """The projection recurrence over ``x (B, T, dim)``: ``(kvq (B, T, 3, dim)`` before
        the convolution, the final projection state)."""
        B, T, dim = x.shape
        C = self.projections.every
        gates = {
            name: self.projections.gates[name].activate(proj(x))
            for name, proj in self.projection_gates.items()
        }
        cache = None if self.conv is None else state["memory"].cache["conv"]
        chunks = lambda tree, n: jax.tree.map(
            lambda a: jnp.moveaxis(a.reshape(B, n // C, C, *a.shape[2:]), 1, 0), tree
        )
        items = {"x": x, "gates": gates}
        scan = lambda carry, xs: loops.remat_scan(self._period, carry, xs)
        if starts is None:
            full = T // C * C
            outputs, carry = [], (state["projections"], cache, None)
            with probes.repeated("Hope's projection periods (a scan over chunks)"):
                if full:
                    carry, (kvq, _) = scan(
                        carry, chunks(jax.tree.map(lambda a: a[:, :full], items), full)
                    )
                    outputs.append(jnp.moveaxis(kvq, 0, 1).reshape(B, full, 3, dim))
            if full < T:
                carry, (kvq, _) = self._period(carry, jax.tree.map(lambda a: a[:, full:], items))
                outputs.append(kvq)
            return jnp.concatenate(outputs, axis=1), carry[0]
        padded = -(-T // C) * C
        pad = lambda a: jnp.pad(a, [(0, 0), (0, padded - T)] + [(0, 0)] * (a.ndim - 2))
        schedule = _schedule(starts, C, padded)
        xs = chunks({**jax.tree.map(pad, items), "starts": pad(starts)}, padded)
        xs["starts"] = xs["starts"].at[:, :, 0].set(False)  # a restart empties the cache instead
        xs.update(jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), schedule))
        P = state["projections"].params[0]["w"]
        empty = {  # the chunk before the first: no period reaches back into it
            "x": jnp.zeros((B, C, dim), x.dtype),
            "targets": jnp.zeros((B, C, 3, dim), jnp.result_type(P, x)),
            "gates": jax.tree.map(lambda a: jnp.zeros_like(a[:, :C]), gates),
        }
        with probes.repeated("Hope's projection periods (a scan over chunks)"):
            (projections, _, _), (kvq, targets) = scan((state["projections"], cache, empty), xs)
        unchunk = lambda a: jnp.moveaxis(a, 0, 1).reshape(B, padded, 3, dim)[:, :T]
        kvq, targets = unchunk(kvq), unchunk(targets)
        # The last document's unfinished period, applied to the returned state (as alone).
        n = (T - inner.document_begins(starts)[:, -1]) % C  # (B,) its tokens so far
        last = jax.tree.map(
            lambda a: jnp.concatenate([jnp.zeros_like(a[:, :C]), a], axis=1)[:, T:],
            {"x": x, "targets": targets, "gates": gates},
        )
        ctx = self._context(last["x"], last["targets"], last["gates"])
        first = (jnp.arange(C)[None] == (C - n)[:, None]) & (n[:, None] > 0)
        ctx = ctx._replace(starts=first, initial=projections)
        with documents.on_grid(1):  # its start is anywhere in the period
            finished = inner.run(self.projections, projections, ctx)[1]
        return kvq, inner.select_rows(n > 0, finished, projections)

    def __call__(self, x: jax.Array, state: dict, starts=None) -> tuple[jax.Array, dict]:
        """``x (B, T, dim) -> (y (B, T, dim), state)``; document ``starts (B, T)``: see the
        module docstring."""
        B, T, dim = x.shape
        with jax.named_scope("self_modifying"):  # the projection recurrence
            kvq, projections = self._projections(x, state, starts)
        memory = state["memory"]
        if self.conv is not None:
            kvq, conv = self.conv(kvq, memory.cache["conv"], starts)
            memory = memory.replace(cache={**memory.cache, "conv": conv})
        k, v, q = jnp.moveaxis(kvq, 2, 0)
        heads = lambda a: a.reshape(B, T, self.heads, -1)
        gates = {
            name: self.level.gates[name].activate(proj(x)) for name, proj in self.gates.items()
        }
        ctx = inner.Context(
            k=l2_normalize(heads(k)), v=heads(v), q=l2_normalize(heads(q)), gates=gates
        )
        if starts is not None:
            ctx = ctx._replace(starts=starts, initial=self.initial_state(B)["memory"])
        o, memory = inner.run(self.level, memory, ctx)
        o = self.norm(o.astype(x.dtype))
        if self.gate_out is not None:
            o = o * jax.nn.sigmoid(self.gate_out(x)).reshape(o.shape)
        return self.out(o.reshape(B, T, -1)), {"memory": memory, "projections": projections}


def _schedule(starts: jax.Array, C: int, padded: int) -> dict[str, jax.Array]:
    """Where each row's projection periods fall in chunks of ``C`` tokens, given document
    ``starts (B, T)``: periods are counted from each document's start (the row's first
    document from the row's start), so a chunk holds the end of at most one period, that of
    the document running at its first token. Per chunk (leading ``(B, padded / C)``):

    * ``end``: where that period ends, in ``(0, C]`` (``C``: at the chunk's end);
    * ``update``: whether it ends here (no document starts before ``end``, ``end`` within the
      row) and its update applies;
    * ``restart``: a document starts at the chunk's first token;
    * ``mode (.., C)``: which projections each token uses: 0 the running period's, 1 the next
      period's (from ``end`` on), 2 the initial ones (from the chunk's first start on)."""
    B, T = starts.shape
    starts = jnp.pad(starts, [(0, 0), (0, padded - T)])
    begin = inner.document_begins(starts)[:, ::C]  # the document running at each chunk's start
    first = jnp.arange(0, padded, C)[None]
    end = C - (first - begin) % C
    grid = starts.reshape(B, -1, C)
    first_start = jnp.where(jnp.any(grid, axis=2), jnp.argmax(grid, axis=2), C)
    position = jnp.arange(C)[None, None]
    mode = jnp.where(
        position >= first_start[..., None], 2, (position >= end[..., None]).astype(jnp.int32)
    )
    return {
        "end": end,
        "update": (end <= first_start) & (first + end <= T),
        "restart": grid[:, :, 0],
        "mode": mode,
    }
