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

Per chunk of ``C`` tokens: project with the chunk-start ``P`` (then a short causal
convolution over time, as in Titans, carried across chunks: a one-layer model needs it to pair
a key with the next token's value), run the memory over the chunk, then update ``P``. Gates
of the memory come from slow projections of ``x``. The whole thing is differentiated exactly
by the outer level (no stop-gradient through the writes).

Document starts ``(B, T)`` (packed sequences): a chunk whose first token starts a document
begins from the initial state (memory, projections, convolution); inside a chunk, the tokens of
a document starting there are projected with the initial projections, and the memory, the
projection level and the convolution restart at the start. Chunks stay ``C`` tokens from the
row's start, so a packed row equals its documents run alone when they start at multiples of
``C``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nested.core import inner, probes
from nested.core.level import InitialState, Level
from nested.nn.layers import ShortConv, initial_memories, l2_normalize, per_sequence


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
        linear = lambda n_in, n_out, **kw: nnx.Linear(n_in, n_out, rngs=rngs, **kw)
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

    def _chunk(self, state: dict, inputs) -> tuple[dict, jax.Array]:
        """One projection period, ``inputs = (x (B, C, dim), starts (B, C) or None)``, with
        the chunk-start projections (the initial ones for a document starting in the chunk)."""
        x, starts = inputs
        B, C, dim = x.shape
        fresh = None
        if starts is not None:
            fresh = self.initial_state(B)
            state = inner.select_rows(starts[:, 0], fresh, state)
            starts = starts.at[:, 0].set(False)
        P = state["projections"].params[0]["w"]  # (B, 3, dim, dim)

        def project(a):  # (B, C, dim) -> (B, C, 3, dim)
            out = jnp.einsum("bpoi,bti->btpo", P, a)
            if starts is None:
                return out
            later = inner.document_begins(starts)[:, :, None, None] > 0
            initial = fresh["projections"].params[0]["w"]
            return jnp.where(later, jnp.einsum("bpoi,bti->btpo", initial, a), out)

        kvq = project(x)
        memory = state["memory"]
        if self.conv is not None:
            kvq, conv = self.conv(kvq, memory.cache["conv"], starts)
            memory = memory.replace(cache={**memory.cache, "conv": conv})
        k, v, q = jnp.moveaxis(kvq.reshape(B, C, 3, dim), 2, 0)
        heads = lambda a: a.reshape(B, C, self.heads, -1)
        gates = {
            name: self.level.gates[name].activate(proj(x)) for name, proj in self.gates.items()
        }
        ctx = inner.Context(
            k=l2_normalize(heads(k)), v=heads(v), q=l2_normalize(heads(q)), gates=gates
        )
        if starts is not None:
            ctx = ctx._replace(starts=starts, initial=fresh["memory"])
        o, memory = inner.run(self.level, memory, ctx)
        targets = project(v)  # each projection applied to the values
        inputs = jnp.broadcast_to(x[:, :, None], (B, C, 3, dim))
        proj_gates = {
            name: self.projections.gates[name].activate(proj(x))
            for name, proj in self.projection_gates.items()
        }
        proj_ctx = inner.Context(k=inputs, v=targets, q=inputs, gates=proj_gates)
        if starts is not None:
            proj_ctx = proj_ctx._replace(starts=starts, initial=fresh["projections"])
        _, projections = inner.run(self.projections, state["projections"], proj_ctx)
        return {"memory": memory, "projections": projections}, o

    def __call__(self, x: jax.Array, state: dict, starts=None) -> tuple[jax.Array, dict]:
        """``x (B, T, dim) -> (y (B, T, dim), state)``; document ``starts (B, T)``: see the
        module docstring."""
        B, T, dim = x.shape
        C = self.projections.every
        full = T // C * C
        outputs = []
        if full:
            chunks = jax.tree.map(
                lambda a: jnp.moveaxis(a[:, :full].reshape(B, full // C, C, *a.shape[2:]), 1, 0),
                (x, starts),
            )
            with probes.repeated("Hope's projection periods (a scan over chunks)"):
                state, o = jax.lax.scan(jax.checkpoint(self._chunk), state, chunks)
            outputs.append(jnp.moveaxis(o, 0, 1).reshape(B, full, *o.shape[3:]))
        if full < T:
            state, o = self._chunk(state, jax.tree.map(lambda a: a[:, full:], (x, starts)))
            outputs.append(o)
        o = self.norm(jnp.concatenate(outputs, axis=1).astype(x.dtype))
        if self.gate_out is not None:
            o = o * jax.nn.sigmoid(self.gate_out(x)).reshape(o.shape)
        return self.out(o.reshape(B, T, -1)), state
