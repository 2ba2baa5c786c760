"""Document starts: a packed row of documents equals the documents run one by one.

Each document starts from the learned initial state (varlen semantics): the generic inner loop
for every named rule (values and gradients, float64, update chunks and blocks cutting through
document boundaries or not), and whole models (logits and gradients).
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers.kernel_checks import context as kernel_context

import nested as nl
from nested.core import inner, kernels
from nested.data.tokens import align_documents, document_ids
from nested.nn.attention import SlidingWindowAttention
from nested.nn.layers import MemoryLayer
from nested.nn.models import MemoryLM
from nested.ops import documents

# Document lengths of each row (B = 2 rows of T = 10), none a multiple of the chunks below.
DOCUMENTS = ((4, 6), (2, 5, 3))
B, H, T = len(DOCUMENTS), 2, 10


def documents_of(lengths=DOCUMENTS) -> jax.Array:
    """Document ids ``(B, T)`` int32 of rows of documents of ``lengths``."""
    return jnp.array([np.repeat(np.arange(len(row)), row) for row in lengths], jnp.int32)


def context(level, seed=0):
    """A random context of ``T`` tokens (``helpers.kernel_checks.context``)."""
    return kernel_context(level, T, seed)


def memories(level, seed):
    keys = jax.random.split(jax.random.key(seed), B * H)
    return jax.tree.map(
        lambda p: 0.5 * p.reshape(B, H, *p.shape[1:]), jax.vmap(level.memory.init)(keys)
    )


def carried(level, params):
    """A carried state: a non-zero rule state and a full window of earlier samples."""
    state = inner.initial_state(level, params)
    state = state.replace(opt_state=jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), state.opt_state))
    if state.cache is not None:
        window = jax.tree.map(lambda x: x + 0.3, state.cache["window"])
        state = state.replace(cache={"window": window})
    return state


def row(tree, b):
    return jax.tree.map(lambda x: x[b : b + 1], tree)


def one_by_one(level, state, initial, ctx):
    """Each row's documents run alone, the first from ``state``, the others from ``initial``:
    the concatenated reads and each row's last final state."""
    outputs, finals = [], []
    for b, lengths in enumerate(DOCUMENTS):
        start, reads, begin = row(state, b), [], 0
        for length in lengths:
            piece = jax.tree.map(lambda x, a=begin, n=length: x[b : b + 1, a : a + n], ctx)
            o, final = inner.run(level, start, piece, path="generic")
            reads.append(o)
            start, begin = row(initial, b), begin + length
        outputs.append(jnp.concatenate(reads, axis=1))
        finals.append(final)
    return jnp.concatenate(outputs), jax.tree.map(lambda *x: jnp.concatenate(x), *finals)


def test_document_starts_of_one_position_and_more():
    one = inner.document_starts(jnp.zeros((2, 1), jnp.int32))
    assert one.shape == (2, 1) and not one.any()  # a one-token window (a sampling step)
    got = inner.document_starts(jnp.array([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]]))
    assert got.tolist() == [[False, False, True, False, True], [False, True, False, False, False]]


def packed(level, state, initial, ctx):
    starts = inner.document_starts(documents_of())
    return inner.run(level, state, ctx._replace(starts=starts, initial=initial), path="generic")


def compare(level):
    """Packed equals one by one: reads, final states, and the gradients of a functional of
    both w.r.t. the context (k, v, q, gates), the carried and the initial parameters."""
    ctx = context(level)
    state = carried(level, memories(level, 1))
    initial = inner.initial_state(level, memories(level, 2))

    def loss(run, ctx, params, initial_params):
        o, final = run(
            level, state.replace(params=params), initial.replace(params=initial_params), ctx
        )
        value = jnp.sum(jnp.sin(o)) + sum(jnp.sum(x**2) for x in jax.tree.leaves(final))
        return value, (o, final)

    @jax.jit  # one program for both (compiling dominates)
    def both(ctx, params, initial_params):
        grad = jax.grad(loss, argnums=(1, 2, 3), has_aux=True)
        return [grad(run, ctx, params, initial_params) for run in (packed, one_by_one)]

    (grads, values), (ref_grads, ref_values) = both(ctx, state.params, initial.params)
    chex.assert_trees_all_close(values, ref_values, rtol=1e-9, atol=1e-12)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-8, atol=1e-10)
    # the later documents reach the initial parameters, the first ones the carried
    assert all(float(jnp.abs(g).max()) > 1e-6 for g in jax.tree.leaves(grads[1:]))


FAST = [rule for rule in nl.recipes.named() if rule != "cms"]  # CMS learns the outer loss
SMALL = {"ttt_mlp": {"hidden": 4}, "titans": {"hidden": 4}, "atlas": {"hidden": 4, "ns_steps": 2}}
HEAVY = ("ttt_mlp", "titans", "atlas", "falcon", "gdn2")  # every=3 of these: slow tests
# Also with -m slow: the neural rules but Titans (their machinery is Titans'), and the period-3
# cases of the rules whose period-1 case runs by default.
SLOW_ALONE = {("atlas", 1), ("ttt_mlp", 1), ("ttt_linear", 3), ("gated_delta", 3)}
PERIODS = [(rule, 1) for rule in FAST] + [(rule, 3) for rule in FAST if rule not in HEAVY]
CASES = [
    pytest.param(rule, {"every": every}, marks=[pytest.mark.slow] * ((rule, every) in SLOW_ALONE))
    for rule, every in PERIODS
]
SLOW_CASES = [(rule, {"every": 3}) for rule in HEAVY] + [
    ("delta", {"every": 2, "chunk": 4}),
    ("titans", {"every": 3, "chunk": 3, "read": "chunk_start"}),
    ("titans", {"every": 1, "read": "chunk_start", "truncate": 2}),
    ("ttt_linear", {"every": 2, "truncate": 4}),
    ("gated_delta", {"every": 4, "chunk": 8}),
]


@pytest.mark.parametrize(("rule", "kwargs"), CASES, ids=lambda x: str(x))
def test_packed_documents_equal_documents_one_by_one(rule, kwargs):
    compare(nl.recipes.named()[rule](d_k=3, d_v=3, **SMALL.get(rule, {}), **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize(("rule", "kwargs"), SLOW_CASES, ids=lambda x: str(x))
def test_packed_documents_with_blocks_reads_and_truncation(rule, kwargs):
    compare(nl.recipes.named()[rule](d_k=3, d_v=3, **SMALL.get(rule, {}), **kwargs))


def test_a_kernel_without_document_starts_is_refused_or_passed_over(monkeypatch):
    level = nl.recipes.delta(d_k=3, d_v=3)
    kernel = kernels.find(level)[0]
    if hasattr(kernel, "documents"):  # the registered kernel may implement them
        kernel = dataclasses.replace(kernel, documents=False)
    monkeypatch.setattr(kernels, "find", lambda level: (kernel, {}))
    ctx = context(level)
    state = inner.initial_state(level, memories(level, 1))
    docs = ctx._replace(starts=inner.document_starts(documents_of()), initial=state)
    with pytest.raises(
        ValueError, match=r"^level 'memory': kernel 'delta_rule' does not implement"
    ):
        inner.run(level, state, docs, path="kernel")
    auto, generic = (inner.run(level, state, docs, path=p)[0] for p in ("auto", "generic"))
    np.testing.assert_array_equal(auto, generic)
    # without starts the kernel runs as before, and equals the generic loop
    assert inner.kernel_for(level, "kernel") is kernel
    np.testing.assert_allclose(
        inner.run(level, state, ctx, path="kernel")[0],
        inner.run(level, state, ctx, path="generic")[0],
        rtol=1e-10,
    )


def test_a_context_with_half_of_the_document_fields_is_refused():
    level = nl.recipes.delta(d_k=3, d_v=3)
    ctx = context(level)
    state = inner.initial_state(level, memories(level, 1))
    with pytest.raises(ValueError, match="starts and initial come together"):
        inner.run(level, state, ctx._replace(initial=state))
    with pytest.raises(ValueError, match=r"starts must be bool \(2, 10\)"):
        inner.run(level, state, ctx._replace(starts=jnp.zeros((2, 9), bool), initial=state))


# -- models --------------------------------------------------------------------------------

VOCAB, DIM, HEADS = 11, 8, 2


def program(mixer, level, *, projections=None, cms=(), document_grid=1, **kwargs):
    def model(rngs):
        return MemoryLM(
            level,
            vocab=VOCAB,
            dim=DIM,
            heads=HEADS,
            layers=1,
            mixer=mixer,
            projections=projections,
            cms=cms,
            rngs=rngs,
            **kwargs,
        )

    backbone = nl.Level(
        "backbone",
        memory=model,
        objective=nl.objectives.next_token,
        update=optax.sgd(0.1),
        every="step",
    )
    fast = [level, *([projections] if projections else []), *cms]
    owners = {level.name: "backbone" for level in fast}
    if projections is not None:
        owners[level.name] = projections.name
    system = nl.NestedSystem([backbone, *fast], owners=owners)
    return nl.compile(system, document_grid=document_grid)


def cms_levels(periods):
    return [
        nl.Level(
            f"cms{c}",
            memory=nl.memories.MLP(DIM, DIM, DIM),
            objective=nl.objectives.outer_loss,
            update=optax.sgd(0.5),
            every=c,
        )
        for c in periods
    ]


def compare_model(prog, lengths):
    """Logits and the gradient of a functional of them w.r.t. every slow parameter: packed
    rows of documents of ``lengths`` equal each document run alone from a fresh state (with
    targets, so outer-loss levels learn)."""
    documents = documents_of(lengths)
    T = documents.shape[1]
    tokens = jax.random.randint(jax.random.key(3), (len(lengths), T + 1), 0, VOCAB)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    weights = jax.random.normal(jax.random.key(4), (len(lengths), T, VOCAB))
    params = jax.tree.map(lambda p: p.astype(jnp.float64), prog.init(jax.random.key(0)).params)

    def packed(params):
        return prog.apply(params, inputs, targets=targets, documents=documents)[0]

    def one_by_one(params):
        rows = []
        for b, row_lengths in enumerate(lengths):
            begins = np.cumsum((0, *row_lengths[:-1]))
            rows.append(
                jnp.concatenate(
                    [
                        prog.apply(
                            params,
                            inputs[b : b + 1, a : a + n],
                            targets=targets[b : b + 1, a : a + n],
                        )[0]
                        for a, n in zip(begins, row_lengths, strict=True)
                    ],
                    axis=1,
                )
            )
        return jnp.concatenate(rows)

    @jax.jit
    def both(params):
        grad = lambda f: jax.value_and_grad(lambda p: jnp.sum(weights * f(p)))(params)
        return [(f(params), grad(f)) for f in (packed, one_by_one)]

    (logits, grads), (ref_logits, ref_grads) = both(params)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-9, atol=1e-11)
    # (nnx.Embed rounds its output to float32: the embeddings' gradients are float32's)
    chex.assert_trees_all_close(grads, ref_grads, rtol=2e-6, atol=1e-8)
    # the documents change the result: without them the state leaks from one into the next
    leaked = jax.jit(lambda p: prog.apply(p, inputs, targets=targets)[0])(params)
    assert float(jnp.max(jnp.abs(leaked - logits))) > 1e-3


@pytest.mark.slow
def test_memory_layers_with_convolution_restart_at_document_starts():
    compare_model(program("memory", nl.recipes.ttt_linear(d_k=4, d_v=4, every=3)), DOCUMENTS)


@pytest.mark.parametrize(
    ("mixer", "rule", "kwargs"),
    [
        pytest.param("memory", "falcon", {"key_shift": True}, marks=pytest.mark.slow),
        pytest.param("gate", "delta", {"window": 3}, marks=pytest.mark.slow),
        pytest.param("layer", "gated_delta", {"window": 4}, marks=pytest.mark.slow),
        ("adatransformer", "hebbian", {"window": None}),
    ],
)
def test_hybrid_mixers_restart_at_document_starts(mixer, rule, kwargs):
    level = nl.recipes.RULES[rule](d_k=4, d_v=4, **SMALL.get(rule, {}))
    compare_model(program(mixer, level, **kwargs), DOCUMENTS)


@pytest.mark.slow
@pytest.mark.parametrize("grid", [1, 4])  # 4: declared, segments of 4 run without segments
def test_memory_as_context_restarts_at_document_starts_on_segment_boundaries(grid):
    level = nl.recipes.titans(d_k=4, d_v=4, every=2, hidden=4)
    prog = program("context", level, window=4, persistent=2, document_grid=grid)
    compare_model(prog, ((4, 8), (8, 4)))


@pytest.mark.slow
def test_a_program_declared_on_a_grid_runs_documents_alone_and_refuses_others(monkeypatch):
    """``document_grid=4``: CMS spans of 4 and a delta rule of 4-token chunks see starts only
    at their first tokens (the model runs without ids, the op without segments), exact; a
    batch with a start off the grid is refused on the host."""
    monkeypatch.setattr(documents, "segments", lambda *a: pytest.fail("segments built"))
    level = nl.recipes.delta(d_k=DIM // HEADS, d_v=DIM // HEADS, chunk=4)
    prog = program("memory", level, cms=cms_levels((4,)), document_grid=4)
    compare_model(prog, ((4, 8), (8, 4)))
    params = prog.init(jax.random.key(0)).params
    inputs = jnp.zeros((B, T), jnp.int32)
    with pytest.raises(
        ValueError,
        match=r"apply: a document starts at position 2 of row 0, off the program.s document_grid=4",
    ):
        prog.apply(params, inputs, documents=documents_of(((2, 2, 6), (4, 6))))
    batch = {"inputs": inputs, "targets": inputs, "documents": documents_of()}
    with pytest.raises(ValueError, match=r"batch: a document starts at position 2 of row 1"):
        prog.loss(params, batch)


@pytest.mark.slow
@pytest.mark.parametrize("grid", [1, 4])  # 4: declared (the task's align), CMS spans without ids
def test_hope_with_cms_on_documents_aligned_to_its_grid_runs_each_as_alone(grid):
    """The task's alignment (``nested.data.tokens.align_documents``: documents at multiples of
    the shortest CMS period, 4, after EOS pads that stay in the document they end) makes Hope
    with CMS exact; the projections' period is exact on any grid
    (``test_hope.test_packed_documents_off_the_chunk_grid_run_as_if_alone``)."""
    eos = VOCAB - 1
    stream = np.concatenate([np.append(np.ones(n, int), eos) for n in (4, 1, 6, 2, 9, 3, 5)])
    rows = align_documents(stream, eos, 4)[0][:32].reshape(2, 16)
    lengths = tuple(tuple(np.bincount(document_ids(r[None], eos)[0])) for r in rows)
    assert all(len(row) > 2 for row in lengths)
    level = nl.recipes.delta(d_k=DIM // HEADS, d_v=DIM // HEADS)
    projections = nl.recipes.projections(d_k=DIM, d_v=DIM, every=2)
    hope = program(
        "self_modifying", level, projections=projections, cms=cms_levels((4, 8)), document_grid=grid
    )
    compare_model(hope, lengths)


# -- streams split across calls --------------------------------------------------------------


def split_equals_whole(call, state, x, documents, at):
    """``call(x, state, starts) -> (y, state)`` over the row of ``documents`` in one call
    equals two calls split at ``at`` (each with its own starts)."""
    starts = lambda d: inner.document_starts(d)
    whole, final = call(x, state, starts(documents))
    first, middle = call(x[:, :at], state, starts(documents[:, :at]))
    second, end = call(x[:, at:], middle, starts(documents[:, at:]))
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), whole, rtol=1e-12, atol=1e-14)
    chex.assert_trees_all_close(end, final, rtol=1e-12, atol=1e-14)
    return whole


def test_a_call_after_a_document_start_does_not_reach_back_across_it():
    """The attention cache keeps where the document began, the convolution and key caches
    hold none of the previous document: a document starting 2 tokens before the end of a call
    continues in the next call as it would alone."""
    documents = jnp.array([[0] * 6 + [1] * 6, [0] * 12], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (2, 12, DIM))
    attention = SlidingWindowAttention(dim=DIM, heads=HEADS, window=5, rngs=nnx.Rngs(0))
    memory = MemoryLayer(
        nl.recipes.delta(d_k=4, d_v=4), dim=DIM, heads=HEADS, key_shift=True, rngs=nnx.Rngs(0)
    )
    wide = lambda tree: jax.tree.map(  # caches in float64, for exact comparisons
        lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )
    for layer in (attention, memory):
        call = jax.jit(layer.__call__)
        whole = split_equals_whole(call, wide(layer.initial_state(2)), x, documents, 8)
        alone, _ = call(x[:1, 6:], wide(layer.initial_state(1)), None)
        np.testing.assert_allclose(whole[:1, 6:], alone, rtol=1e-12, atol=1e-14)


def test_documents_of_a_batch_are_checked():
    prog = program("memory", nl.recipes.delta(d_k=4, d_v=4))
    batch = {"inputs": jnp.zeros((2, 10), jnp.int32), "targets": jnp.zeros((2, 10), jnp.int32)}
    with pytest.raises(ValueError, match="documents must be integer document ids of shape"):
        prog.check_batch({**batch, "documents": jnp.zeros((2, 10))})
    with pytest.raises(ValueError, match=r"batch: documents has shape \(2, 9\)"):
        prog.check_batch({**batch, "documents": jnp.zeros((2, 9), jnp.int32)})
    with pytest.raises(ValueError, match=r"apply: documents must be integer document ids"):
        prog.apply(
            prog.init(jax.random.key(0)).params, batch["inputs"], documents=jnp.ones((2, 10))
        )


def test_memt_turns_refuse_document_starts():
    mixer = MemoryLayer(
        nl.recipes.delta(d_k=4, d_v=4), dim=DIM, heads=HEADS, turn=3, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(0), (2, 10, DIM))
    with pytest.raises(ValueError, match="MemT turns do not implement document starts"):
        mixer(x, mixer.initial_state(2), inner.document_starts(documents_of()))
