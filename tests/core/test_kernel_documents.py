"""Kernels with ``documents=True`` honour document starts exactly.

A context with ``starts`` (B, T) packs several documents into each row. A kernel marked
``documents`` must give what running each document alone through the same kernel gives (the
first document from ``state``, every later one from ``ctx.initial``, outputs concatenated, the
final state the last document's), values and gradients, float64. The reference is the kernel
without starts, which tests/core/test_kernels.py proves equal to the generic path. The starts fall
inside chunks, on chunk boundaries (4, 16, 32 and 64 tokens: every example's chunk or update
period divides one of them) and right after each other (a one-token document), so documents'
lengths are not multiples of any chunk.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested import ops
from nested.core import inner, kernels
from nested.ops import documents

B, H, T = 2, 2, 70
STARTS = ((5, 32, 45), (16, 17, 64))  # per batch row: positions where a document starts


def context(level, seed=0, positions=STARTS):
    """A random context (unit keys, activated gates) with documents starting at ``positions``
    (per row)."""
    keys = jax.random.split(jax.random.key(seed), 3 + len(level.gates))
    normal = lambda key, *dims: jax.random.normal(key, (B, T, H, *dims))
    gates = {
        name: gate.activate(
            normal(key, *(() if gate.size is None else (getattr(level.memory, gate.size),)))
        )
        for key, (name, gate) in zip(keys[3:], sorted(level.gates.items()), strict=True)
    }
    k = normal(keys[0], level.memory.d_k)
    starts = np.zeros((B, T), bool)
    for row, row_starts in enumerate(positions):
        starts[row, list(row_starts)] = True
    return inner.Context(
        k=k / jnp.linalg.norm(k, axis=-1, keepdims=True),
        v=normal(keys[1], level.memory.d_v),
        q=normal(keys[2], level.memory.d_k),
        gates=gates,
        starts=jnp.asarray(starts),
    )


def memories(level, seed):
    keys = jax.random.split(jax.random.key(seed), B * H)
    params = jax.vmap(level.memory.init)(keys)
    return jax.tree.map(lambda p: 0.5 * p.reshape(B, H, *p.shape[1:]), params)


def states(level):
    """The state of each row's first document (a non-zero rule state where the rule has one)
    and the state every later document starts from (other learned memories); both with a full
    window of earlier samples where the objective reads one (an Omega window), unlike each
    other, so a document's first windows must read the right one."""

    def filled(state, shift):
        opt_state = jax.tree.map(lambda x: shift * jnp.ones_like(x), state.opt_state)
        if state.cache is None or "window" not in state.cache:
            return state.replace(opt_state=opt_state)
        keys = jax.random.split(jax.random.key(int(10 * shift)), 3)
        window = {
            name: jax.random.uniform(key, x.shape, x.dtype, 0.2, 1.0)
            for key, (name, x) in zip(keys, sorted(state.cache["window"].items()), strict=True)
        }
        return state.replace(opt_state=opt_state, cache={**state.cache, "window": window})

    state = filled(inner.initial_state(level, memories(level, 9)), 0.1)
    return state, filled(inner.initial_state(level, memories(level, 7)), 0.3)


def alone(kernel, level, state, ctx, starts=STARTS):
    """The reference: every document of every row run alone through the kernel, no starts."""
    outputs, finals = [], []
    for row, positions in enumerate(starts):
        take = lambda tree: jax.tree.map(lambda x: x[row : row + 1], tree)
        current, pieces = take(state), []
        for i, (lo, hi) in enumerate(zip((0, *positions), (*positions, T), strict=True)):
            piece = ctx._replace(starts=None, initial=None)
            piece = jax.tree.map(lambda x: x[row : row + 1, lo:hi], piece)
            o, current = kernel.run(level, current if i == 0 else take(ctx.initial), piece)
            pieces.append(o)
        outputs.append(jnp.concatenate(pieces, axis=1))
        finals.append(current)
    return jnp.concatenate(outputs), jax.tree.map(lambda *x: jnp.concatenate(x), *finals)


def together(kernel, level, state, ctx):
    return kernel.run(level, state, ctx)


def compare(kernel, level, positions=STARTS):
    """Outputs, final state and the gradients of a functional of both w.r.t. the context
    (k, v, q, gates), the first state and the documents' initial state."""
    state, initial = states(level)
    ctx = context(level, positions=positions)._replace(initial=initial)
    starts, ctx = ctx.starts, ctx._replace(starts=None)  # the arrays differentiated: no bools

    def gradient(path, ctx, state):
        def loss(ctx, state):
            o, final = path(kernel, level, state, ctx._replace(starts=starts))
            value = jnp.sum(jnp.sin(o)) + sum(jnp.sum(x**2) for x in jax.tree.leaves(final))
            return value, (o, final)

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(ctx, state)

    # One program for both, values and gradients: compiling dominates these tests.
    paths = (together, functools.partial(alone, starts=positions))
    both = jax.jit(lambda *a: [gradient(path, *a) for path in paths])
    (grads, outputs), (ref_grads, ref_outputs) = both(ctx, state)
    chex.assert_trees_all_close(outputs, ref_outputs, rtol=1e-8, atol=1e-11)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-7, atol=1e-10)


DOCUMENTS = [kernel for kernel in kernels.KERNELS if kernel.documents]
# Run with -m slow: every neural example beyond TTT-MLP's mini-batches (0) shares its
# machinery, and the second examples of the linear kernels their first's (the default suite
# keeps the first example of every kernel, and the delta rule's chunk-boundary cases).
NEURAL = next(kernel for kernel in DOCUMENTS if kernel.name == "neural_gradient_descent")
ATLAS = next(kernel for kernel in DOCUMENTS if kernel.name == "atlas")
SLOW = {(NEURAL.name, i) for i in range(len(NEURAL.examples()))}
SLOW |= {("gdn2", 1), ("falcon", 0), ("delta_rule", 1)}
SLOW |= {("gated_delta_rule", i) for i in range(2)}  # the delta rule's machinery, gated
SLOW |= {("atlas", i) for i in range(4)}  # Muon's segments, the online rule's window rows
EXAMPLES = [
    pytest.param(
        kernel,
        i,
        id=f"{kernel.name}-{i}",
        marks=[pytest.mark.slow] if (kernel.name, i) in SLOW else [],
    )
    for kernel in DOCUMENTS
    for i in range(len(kernel.examples()))
]


@pytest.mark.parametrize(("kernel", "index"), EXAMPLES)
def test_documents_run_as_if_alone(kernel, index):
    compare(kernel, kernel.examples()[index])


# Documents declared on a grid of 16 (``documents.on_grid``) that every chunk, update period and
# online block of these examples divides: the ops restart at chunk starts and build no segments.
LINEAR = {kernel.name: kernel for kernel in DOCUMENTS}
ON_GRID = [
    pytest.param(NEURAL, 0, id="ttt-mini-batch"),
    pytest.param(NEURAL, 3, id="titans-online"),
    *(pytest.param(ATLAS, i, id=f"atlas-{i}", marks=pytest.mark.slow) for i in range(4)),
    *(pytest.param(LINEAR[name], 1, id=f"{name}-chunk-4") for name in ("delta_rule", "gdn2")),
    pytest.param(LINEAR["delta_rule"], 2, id="delta-mini-batch"),
    *(
        pytest.param(LINEAR[name], 1, id=f"{name}-chunk-4", marks=pytest.mark.slow)
        for name in ("linear_attention", "gated_delta_rule", "falcon")
    ),
]
GRID_STARTS = ((32,), (16, 48))


def no_segments(*args):
    raise AssertionError("segments built for documents declared on the chunks' grid")


@pytest.mark.parametrize(("kernel", "index"), ON_GRID)
def test_documents_declared_on_the_chunk_grid_run_as_if_alone_without_segments(
    kernel, index, monkeypatch
):
    monkeypatch.setattr(documents, "segments", no_segments)
    with documents.on_grid(16):
        compare(kernel, kernel.examples()[index], positions=GRID_STARTS)


def test_a_declared_grid_the_chunks_do_not_divide_keeps_the_segments():
    """Starts at multiples of 16 inside the delta rule's 32-token chunks: segments, exact."""
    level = LINEAR["delta_rule"].examples()[0]
    assert ops.chunked.default_chunk_size() == 32 and level.chunk is None
    with documents.on_grid(16):
        compare(LINEAR["delta_rule"], level, positions=GRID_STARTS)


@pytest.mark.parametrize("kernel", DOCUMENTS, ids=lambda kernel: kernel.name)
def test_a_row_without_starts_is_one_document(kernel):
    """The document path with no start (every row) gives the path without starts, on the
    kernel's last example (a mini-batch period or the online rule among them)."""
    level = kernel.examples()[-1]
    state, initial = states(level)
    ctx = context(level)
    none = ctx._replace(starts=jnp.zeros_like(ctx.starts), initial=initial)
    both = jax.jit(lambda s, c: [kernel.run(level, s, x) for x in (c, c._replace(starts=None))])
    packed, plain = both(state, none)
    chex.assert_trees_all_close(packed, plain, rtol=1e-10, atol=1e-12)


PER_TOKEN = {
    "gated_delta_rule": lambda c, gate, **kw: ops.gated_delta_rule(
        *c, gate[..., 0], log_alpha=-jax.nn.softplus(gate[..., 1]), **kw
    ),
    "falcon-2 (per channel)": lambda c, gate, **kw: ops.falcon(
        *c, jax.nn.sigmoid(gate[..., :3]), jax.nn.softplus(gate[..., 3]), **kw
    ),
}


@pytest.mark.parametrize("op", PER_TOKEN.values(), ids=PER_TOKEN.keys())
def test_the_per_token_path_restarts_too(op):
    """The delta family's per-token scan (``chunk_size=1``, a reset at each start: the
    definition) equals its chunked form, Falcon-2's per-channel decays too."""
    ctx = context(kernels.KERNELS[0].examples()[0])
    W0, W1 = (jax.random.normal(jax.random.key(i), (B, H, 3, 4)) for i in (1, 2))
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(3), (B, T, H, 4)))
    run = lambda chunk: op(
        (ctx.q, ctx.k, ctx.v),
        gate,
        initial_state=W0,
        chunk_size=chunk,
        starts=ctx.starts,
        start_state=W1,
    )
    chex.assert_trees_all_close(run(1), run(16), rtol=1e-10, atol=1e-12)


def test_starts_come_with_the_state_documents_start_from():
    ctx = context(kernels.KERNELS[0].examples()[0])
    with pytest.raises(ValueError, match="`starts` needs `start_state`"):
        ops.linear_attention(ctx.q, ctx.k, ctx.v, starts=ctx.starts)
    with pytest.raises(ValueError, match="`starts` must be a bool array"):
        ops.linear_attention(
            ctx.q, ctx.k, ctx.v, starts=ctx.starts.astype(int), start_state=jnp.zeros((B, H, 3, 4))
        )
    with pytest.raises(ValueError, match="document starts need window=1"):
        ops.falcon(
            ctx.q,
            ctx.k,
            ctx.v,
            jnp.ones((B, T, H)),
            jnp.ones((B, T, H)),
            window=2,
            starts=ctx.starts,
            start_state=jnp.zeros((B, H, 3, 4)),
        )


def test_every_documents_kernel_is_covered():
    """The cases above come from the registry: every kernel marked ``documents`` is in them,
    on each of its examples, and the delta-rule family is among them."""
    covered = {(param.values[0].name, param.values[1]) for param in EXAMPLES}
    for kernel in kernels.KERNELS:
        cases = {(kernel.name, i) for i in range(len(kernel.examples()))}
        assert cases <= covered if kernel.documents else not cases & covered
    assert {"linear_attention", "delta_rule", "gated_delta_rule"} <= {k.name for k in DOCUMENTS}
