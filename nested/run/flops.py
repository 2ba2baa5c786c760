"""Analytic FLOPs per token of the language models of ``configs/lm.py``, inner loops included.

``per_token(config)`` reads a config (or a built :class:`~nested.run.config.Experiment`) and
returns the forward and training FLOPs of one token of a training sequence, by part::

    from nested.run import config as nc, flops
    flops.per_token(nc.load("configs/lm.py:hope-tiny"))
    # {'embedding': 0.0, 'head': ..., 'mlp': ..., 'projections': ..., 'attention': ...,
    #  'inner': ..., 'self_modifying': ..., 'cms': ..., 'cms_grads': ..., 'forward': ...,
    #  'backward': ..., 'train': ...}

Conventions.

* A multiply-add is 2 FLOPs. Counted: the matrix products (``dot_general``/einsum) and the
  short causal convolution (``2 w`` per feature, a contraction over its ``w`` taps). Not
  counted: elementwise work (norms, activations, gates, masks, softmax, RoPE, the loss), which
  XLA's ``cost_analysis`` adds at 1 FLOP per element (1-17% of its total at the ``tiny`` size,
  ``tests/run/test_flops.py``), and the embedding (a gather).
* Products are counted as the kernels compute them: a chunk's masked ``C x C`` products whole
  (the chunkwise form's cost, not a per-token recurrence's), every chunk of a sequence
  including the last one's state update (the steady state of a long sequence; a compiler may
  drop the last update when nothing reads the final state, ``1 / N`` of that term), padding of
  a last partial chunk included.
* Attention: ``attention="causal"`` (default, for MFU) counts the query-key pairs a query
  attends, ``(T + 1) / 2`` keys on average for causal attention and ``mean_t min(t, W)`` for a
  window ``W``; ``attention="dense"`` counts the score blocks as the code forms them
  (:func:`attention_keys`: ``T`` or ``T + W - 1`` keys a query up to 512 keys, then the
  blockwise path's 512 x 512 blocks), which is what XLA counts; Titans MAC's segments
  ``n_p + 2 S`` keys dense, ``n_p + S + 1`` causal (below).
* Training = forward + backward, the backward counted as 2x the forward (each product needs
  the cotangents of its two operands: two products of its size), except for the two ops with
  written-out derivatives: the chunk's triangular inverse (forward by block doubling, about
  ``2 L^3 / 3``; backward ``d(I + A)^{-1} = -X dA X``, two ``L x L`` products, ``4 L^3``) and
  the decay matrices of the neural memories (forward an associative scan, no product;
  backward one ``C x C`` product, ``2 C^3``). Hope's forward already holds a backward pass
  (the CMS gradients, ``cms_grads``); its training FLOPs are 3x that forward too (the
  gradient of a gradient is again two products per product). Recomputation of
  rematerialised blocks (``jax.checkpoint`` in the chunk scans, Hope's spans) is not counted:
  these are model FLOPs (MFU), not hardware FLOPs.
* Packed documents: counted as one document. With document starts the kernels compute more
  (the neural memories' chunks are read from each segment's base state, up to 3 passes;
  ATLAS falls back to the per-token generic loop): overhead, not model FLOPs.

Notation: ``L`` layers, ``d`` width, ``h`` heads, ``V`` vocabulary (the task's: the columns a
padded vocabulary adds, ``model.vocab_multiple``, are overhead), ``T`` sequence length,
``m`` the SwiGLU width, ``d_k, d_v`` a memory head's key and value widths, ``w`` the
convolution width, ``g`` the gate widths of a level summed over its gates (1 per scalar gate),
``C`` an update chunk, ``N = ceil(T / C)`` chunks, ``W`` an attention window. Neural memories
``f(x) = W_D s(... s(W_1 x))`` have layers ``l = 1..D`` of shape ``(o_l, i_l)``, ``P_l = o_l
i_l``, ``sum P``, ``sum i``, ``sum o`` over the layers and ``P_{>1}`` over ``l >= 2``. Per
token (all heads, all layers), forward:

    head        2 d V
    mlp         L 6 d m                                        (SwiGLU: gate, up, down)
    attention   projections 8 d^2 (q, k, v, out); scores and reads 4 d kappa,
                kappa = keys a query (above)
    memory      projections 2 d h (2 d_k + d_v) + 2 w h (2 d_k + d_v) + 2 d h g
                + 2 d h d_v (output gate) + 2 h d_v d; inner loop below

Inner loops, per head and chunk of ``C`` tokens (divided by ``C``, times ``N C / T``):

    delta, gated delta (chunked WY form, C = chunk, default 32):
        4 C^2 d_k (q k^T, k k^T) + 4 C^2 d_v ((I + A)^{-1} u, scores u)
        + 4 C d_k d_v (reads of the chunk-start state by k and q) + 2 C d_k d_v (next state)
        + 2 P sum_{s = 1, 2, 4, .., P/2} s^2 (block-doubling inverse, P = C rounded up to 2^k)
    mini-batch delta (exact=False: TTT-Linear as a delta rule, Hope's projections):
        4 C d_k d_v + 2 C d_k d_v [+ 2 C^2 (d_k + d_v) when its reads are used]
    neural memories (TTT-Linear, TTT-MLP, Titans; dual form, n = C samples):
        gradients  2 n sum P + 2 n P_{>1}       (forward, then deltas back to layer 1)
        reads      2 C sum P [+ 2 C sum P, the momentum's]  + 2 C n sum i + 2 C n sum o
        coefficients [2 C^2 n (decay matrix times steps) + 2 C^2 (momentum carry)]
        next state 2 n sum P [+ 2 n sum P, the momentum]  ([..]: Titans, not TTT)
    ATLAS (Muon, Omega window c, n = C + c - 1 samples, K Newton-Schulz steps):
        gradients 2 n sum P + 2 n P_{>1}; momentum coefficients 2 C^2 n; per-token momenta
        2 C n sum P; Newton-Schulz C sum_l K (4 a_l^2 b_l + 2 a_l^3), a_l <= b_l the sides of
        layer l; per-token states 2 C^2 sum P; reads 2 C sum P

Titans MAC (segments of ``S = W`` tokens, ``n_p`` persistent tokens, per token): query
``2 d h d_k``, retrieval ``2 h sum P`` + its read-out ``4 d h d_v``, attention projections of
the retrieved and the segment's tokens ``12 d^2`` and its output ``2 d^2``, the persistent
tokens' ``6 d^2 n_p / T``, attention ``4 d kappa`` with ``kappa = n_p + 2 S`` (dense) or ``n_p +
S + 1`` (causal), then the memory layer over the attention's output (inner loop per segment).
MAG and MAL: an attention block (window ``W``) and a memory layer.

Hope (self-modifying mixer, projection period ``C_p``; CMS blocks ``j = 1..K`` fastest
first, hidden ``h_j``, periods ``C_j``), per token: ``12 d^2`` (``P x``, ``P v`` of three
``d x d`` projections) + ``18 d^2`` (their mini-batch delta update, three ``d x d`` memories
whose reads nothing uses: no scores) + ``6 w d`` (convolution) + ``2 d h g + 6 d g_p``
(``g``, ``g_p`` the memory's and the projections' gates) + ``4 d^2`` (output gate, output) +
the memory's inner loop; CMS ``4 d sum_j h_j`` a layer. The model runs span by span
(``C_1`` tokens); each span differentiates its token losses with respect to every CMS block
(``cms_grads``, every span and level: a rolled loop cannot tell which updates a sequence will
use):

    cms_grads = 2 d V + (L - 1) (M + 8 d sum_j h_j) + 8 d sum_{j>1} h_j + 6 d h_1

with ``8 d h`` a block's weight gradients and pass-through, ``6 d h_1`` the lowest block's
weight gradients alone, and ``M`` a mixer's backward pass to its input with the fast states
of the span's start held constant (products with a slow weight or a span-start state once,
products of two functions of the input twice; exact when ``C_1 = C_p = C`` as in the
configs).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ml_collections import config_dict

from nested.core import kernels
from nested.learn import memories, objectives
from nested.nn.attention import BLOCK
from nested.ops import chunked
from nested.run import config as nc

ATTENTION = ("causal", "dense")
PARTS = (
    "embedding",
    "head",
    "mlp",
    "projections",
    "attention",
    "inner",
    "self_modifying",
    "cms",
    "cms_grads",
)


class Flops(NamedTuple):
    """FLOPs of a part: its forward and its backward pass."""

    forward: float = 0.0
    backward: float = 0.0

    def __add__(self, other):
        return Flops(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, factor: float):
        return Flops(self.forward * factor, self.backward * factor)

    __rmul__ = __mul__


def dots(forward: float) -> Flops:
    """Products whose backward needs both operands' cotangents: 2x the forward."""
    return Flops(forward, 2.0 * forward)


# -- attention --------------------------------------------------------------------------------


def attention_keys(T: int, window: int | None, attention: str = "causal") -> float:
    """Mean keys a query meets (``kappa``). Causal: ``(T + 1) / 2``, or ``mean_{t=1..T}
    min(t, W)`` with a window. Dense, as ``nested.nn.attention.causal_attention`` computes:
    up to ``BLOCK`` keys (the ``W - 1`` cached and the call's ``T``) the whole score matrix,
    ``T`` or ``T + W - 1``; beyond, the ``BLOCK x BLOCK`` blocks its blockwise path visits
    (query block ``i`` from its window's first key block to its last key's), over ``T``."""
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION}")
    if attention == "causal":
        if window is None or window >= T:
            return (T + 1) / 2
        return (window * (window + 1) / 2 + (T - window) * window) / T
    past = 0 if window is None else window - 1
    keys = past + T
    if keys <= BLOCK:
        return keys
    blocks = -(-keys // BLOCK)
    reach = blocks if window is None else min(blocks, -(-(BLOCK + window - 1) // BLOCK) + 1)
    visited = 0
    for t0 in range(0, T, BLOCK):  # as attend_blockwise: padded query blocks included
        lowest = 0 if window is None else max(t0 + past - window + 1, 0) // BLOCK
        last = min(t0 + BLOCK - 1 + past, keys - 1) // BLOCK
        visited += min(last - lowest + 1, reach)
    return visited * BLOCK * BLOCK / T


def attention_block(d: int, T: int, window: int | None, attention: str) -> dict[str, Flops]:
    """Causal softmax attention (``nested.nn.attention``): ``8 d^2`` projections, ``4 d kappa``
    scores and reads, per token."""
    return {
        "projections": dots(8 * d * d),
        "attention": dots(4 * d * attention_keys(T, window, attention)),
    }


# -- memory layers ----------------------------------------------------------------------------


def gate_width(level) -> int:
    """``g``: the widths of the level's gates summed (1 a scalar gate, else its memory dim)."""
    return sum(
        1 if gate.size is None else getattr(level.memory, gate.size)
        for gate in level.gates.values()
    )


def memory_projections(level, d: int, h: int, conv: int, output_gate: bool) -> Flops:
    """``MemoryLayer`` without its inner loop, per token: q, k, v, convolution, gates, output
    gate, output, ``2 d h (2 d_k + d_v) + 2 w h (2 d_k + d_v) + 2 d h g + 2 d h d_v + 2 h d_v
    d``."""
    d_k, d_v = level.memory.d_k, level.memory.d_v
    width = h * (2 * d_k + d_v)
    total = 2 * d * width + 2 * d * h * gate_width(level) + 2 * h * d_v * d
    if conv > 1:
        total += 2 * conv * width
    if output_gate:
        total += 2 * d * h * d_v
    return dots(total)


def _layers(memory) -> list[tuple[int, int]]:
    """The memory network's layer shapes ``(o_l, i_l)`` (polynomial features: on the inner
    network's input)."""
    if isinstance(memory, memories.Featurized):
        memory = memory.memory
    if isinstance(memory, memories.Linear):
        return [(memory.d_v, memory.d_k)]
    if isinstance(memory, memories.MLP):
        return memory.shapes
    raise NotImplementedError(f"FLOPs of a {type(memory).__name__} memory are not counted")


def read_memory(level) -> float:
    """One read ``f_theta(q)`` of a memory, ``2 sum P`` (a head, a token)."""
    return 2.0 * sum(o * i for o, i in _layers(level.memory))


def _chunks(T: int, C: int) -> list[int]:
    """The chunk lengths a sequence of ``T`` tokens runs in (whole chunks of ``C``, the rest)."""
    return [C] * (T // C) + ([T % C] if T % C else [])


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def inverse(L: int) -> Flops:
    """``(I + A)^{-1}`` of an ``L x L`` chunk: block doubling, ``2 P sum_{s<P} s^2`` (``P = L``
    rounded up to a power of 2, ``s`` the block sizes 1, 2, 4, ...); backward ``4 L^3``."""
    P = _pow2(L)
    forward = 2 * P * sum(s * s for s in (1 << i for i in range(P.bit_length() - 1)))
    return Flops(forward, 4.0 * L**3)


def delta_chunk(C: int, d_k: int, d_v: int, *, exact: bool = True, reads_used: bool = True):
    """One chunk of ``C`` tokens of the delta family (``nested.ops.chunked``), one head."""
    total = dots(4 * C * d_k * d_v + 2 * C * d_k * d_v)  # reads of the state, the next state
    if reads_used:
        total += dots(2 * C * C * d_k + 2 * C * C * d_v)  # scores q k^T, scores times u
    if exact:
        total += dots(2 * C * C * d_k + 2 * C * C * d_v) + inverse(C)  # coupling, (I + A)^-1 u
    return total


def delta_sequence(T: int, chunk: int, d_k: int, d_v: int, **kwargs) -> Flops:
    """``delta_chunk`` over a sequence: chunks of ``min(chunk, T)`` tokens, the last padded."""
    size = min(chunk, T)
    return math.ceil(T / size) * delta_chunk(size, d_k, d_v, **kwargs)


def _decay_products(C: int, count: int) -> Flops:
    """``count`` decay matrices (``chunk_coefficients.products_below``): an associative scan
    forward (no product), one ``C x C`` product backward each."""
    return Flops(0.0, count * 2.0 * C**3)


class Inner(NamedTuple):
    """An inner loop's FLOPs per token; for Hope's CMS gradients also its ``pullback`` (its
    backward to its inputs with the chunk-start state held constant: products with that
    state once, products of two inputs twice) and ``carry`` (the same backward of its
    next-state products alone); None where not counted."""

    flops: Flops
    pullback: float | None = None
    carry: float | None = None


def neural_chunk(layers, C: int, *, titans: bool, read: str) -> Inner:
    """One chunk of the dual-form rule of the neural memories (``nested.ops.chunk_scan``,
    ``minibatch_step``), one head: ``titans`` adds the momentum and decay terms (TTT has
    neither)."""
    n = C  # samples: one a token
    P = sum(o * i for o, i in layers)
    deeper = sum(o * i for o, i in layers[1:])
    ins, outs = sum(i for _, i in layers), sum(o for o, _ in layers)
    grads = 2 * n * P + 2 * n * deeper
    states = 2 * C * P * (2 if titans else 1)  # W_s u, and the momentum's S_s u
    if read == "after_write":
        pairs = 2 * C * n * ins + 2 * C * n * outs  # scores x_n . u, their sum of deltas
    else:
        states, pairs = 2 * C * P, 0
    coefficients = (2 * C * C * n + 2 * C * C) if titans else 0  # decay times steps, carry
    carry = 2 * n * P * (2 if titans else 1)
    decays = _decay_products(C, 2) if titans else Flops()
    forward = dots(grads + states + pairs + coefficients + carry) + decays
    # Backward to the inputs: products with a chunk-start state once, of two inputs twice.
    pullback = grads + states + 2 * (pairs + coefficients) + decays.backward
    return Inner(forward, pullback, 2 * carry)


def atlas_chunk(layers, C: int, window: int, ns_steps: int) -> Flops:
    """One chunk of ATLAS with Muon (``nested.ops.atlas._muon_step``), one head."""
    n = C + window - 1
    P = sum(o * i for o, i in layers)
    deeper = sum(o * i for o, i in layers[1:])
    newton = 0
    for o, i in layers:
        a, b = min(o, i), max(o, i)
        newton += ns_steps * (4 * a * a * b + 2 * a**3)
    total = (
        2 * n * P
        + 2 * n * deeper  # sample gradients
        + 2 * C * C * n  # momentum decay times the band
        + 2 * C * n * P  # per-token momenta S_t
        + C * newton  # Newton-Schulz of every S_t
        + 2 * C * C * P  # per-token states theta_t
        + 2 * C * P  # reads f_{theta_t}(q_t)
    )
    return dots(total) + _decay_products(C, 2)


def inner_loop(level, T: int, heads: int) -> Inner:
    """The inner loop of ``level`` over ``T`` tokens, per token and all ``heads``, as the
    kernel ``nested.core.kernels.find(level)`` runs it (:class:`Inner`; the pullback and carry
    of the neural memories only)."""
    kernel, reasons = kernels.find(level)
    if kernel is None:
        raise NotImplementedError(
            f"level {level.name!r} runs the generic loop (no kernel: {reasons}); its FLOPs are "
            "not counted"
        )
    d_k, d_v = level.memory.d_k, level.memory.d_v
    if kernel.name in ("delta_rule", "gated_delta_rule"):
        if level.every == 1:
            chunk = level.chunk or chunked.default_chunk_size()
            total = delta_sequence(T, chunk, d_k, d_v)
        else:  # mini-batch: TTT-Linear's dual form (nested.ops.ttt_linear)
            total = delta_sequence(T, level.every, d_k, d_v, exact=False)
        return Inner(total * (heads / T))
    if level.every == 1:
        raise NotImplementedError(
            f"level {level.name!r}: the online neural memories (every=1) are not counted"
        )
    layers = _layers(level.memory)
    count = math.ceil(T / level.every)  # chunks; a last partial one is padded
    n = count * heads / T
    if kernel.name == "neural_gradient_descent":
        rule = level.rule
        titans = not (rule.momentum is None and rule.decay is None and level.read == "after_write")
        chunk = neural_chunk(layers, level.every, titans=titans, read=level.read)
        # A single chunk runs without a loop: its unused next state is dead code, no carry.
        carry = chunk.carry * n if count > 1 else 0.0
        return Inner(chunk.flops * n, chunk.pullback * n, carry)
    if kernel.name == "atlas":
        objective = level.objective
        window = objective.window if isinstance(objective, objectives.Omega) else 1
        if not level.rule.ns_steps:
            raise NotImplementedError("ATLAS without Newton-Schulz steps is not counted")
        return Inner(atlas_chunk(layers, level.every, window, level.rule.ns_steps) * n)
    raise NotImplementedError(f"level {level.name!r}: kernel {kernel.name!r} is not counted")


# -- mixers -----------------------------------------------------------------------------------


def _memory_layer(level, d, h, T, model) -> tuple[dict[str, Flops], Inner]:
    """A ``MemoryLayer`` over ``T`` tokens: its parts, and as an :class:`Inner` the whole
    layer's pullback (its projections, once: slow weights) and its inner loop's carry."""
    projections = memory_projections(level, d, h, model.conv, model.output_gate)
    inner = inner_loop(level, T, h)
    pullback = None if inner.pullback is None else projections.forward + inner.pullback
    return {"projections": projections, "inner": inner.flops}, inner._replace(pullback=pullback)


def _context(level, d, h, T, model, attention) -> dict[str, Flops]:
    """Titans MAC (``nested.nn.hybrid.MemoryAsContext``), per token."""
    S, n_p = model.window, model.persistent
    d_k, d_v = level.memory.d_k, level.memory.d_v
    parts = {"projections": Flops(), "attention": Flops(), "inner": Flops()}
    for t in _chunks(T, S):
        retrieve = 2 * d * h * d_k + 2 * d * h * d_v * model.output_gate + 2 * h * d_v * d
        own = retrieve + 12 * d * d + 2 * d * d  # k, v of the retrieved tokens; q, k, v; out
        kappa = n_p + (2 * t if attention == "dense" else t + 1)
        memory, _ = _memory_layer(level, d, h, t, model)
        parts["projections"] += (dots(own) + memory["projections"]) * t
        parts["inner"] += (dots(h * read_memory(level)) + memory["inner"]) * t
        parts["attention"] += dots(4 * d * kappa * t)
    parts["projections"] += dots(6 * d * d * n_p)  # the persistent tokens' q, k, v, once
    return {k: v * (1 / T) for k, v in parts.items()}


def _self_modifying(level, projections, d, h, T, model) -> tuple[dict[str, Flops], Inner]:
    """Hope's mixer (``nested.nn.hope.SelfModifyingLayer``), per token; as an :class:`Inner`
    its pullback and carry (of the memory's next state, and of the projections' update:
    ``P v`` and the reads ``6 + 12 d^2`` once, the next states ``6 d^2`` twice; none where a
    single period runs, without a loop)."""
    C = projections.every
    looped = T >= 2 * C
    parts = {"projections": Flops(), "inner": Flops(), "self_modifying": Flops()}
    pullback = carry = 0.0
    gates = 2 * d * h * len(level.gates) + 2 * d * 3 * len(projections.gates)
    conv = 2 * model.conv * 3 * d if model.conv > 1 else 0
    memory_carry = inner_loop(level, T, h).carry or 0.0
    for t in _chunks(T, C):
        inner = inner_loop(level, t, h)
        if inner.pullback is None:
            raise NotImplementedError(f"Hope with a {level.name!r} memory is not counted")
        update = 3 * delta_sequence(t, C, d, d, exact=False, reads_used=False)
        parts["inner"] += inner.flops * t
        parts["self_modifying"] += dots(12 * d * d * t) + update
        parts["projections"] += dots((gates + conv) * t)
        pullback += (6 * d * d + conv + 2 * d * h * len(level.gates) + inner.pullback) * t
        # The update's reads (2/3 of it) and P v once, its next states (1/3) twice.
        carry += (update.forward * 4 / 3 + 6 * d * d * t) * looped
    parts = {k: v * (1 / T) for k, v in parts.items()}
    readout = 2 * d * d * model.output_gate + 2 * d * d
    parts["projections"] += dots(readout)
    return parts, Inner(Flops(), pullback / T + readout, carry / T + memory_carry)


def _cms(levels, d: int, L: int, V: int, mixer: Inner) -> dict[str, Flops]:
    """The CMS blocks (forward ``2 sum P`` each) and the outer-loss gradients of every span
    (module docstring): per block ``4 sum P`` weight gradients and pass-through, the lowest
    one's weight gradients ``2 sum P + 2 P_{>1}``; ``cms_grads_carry``: the backward of the
    span's fast-state updates (``Inner.carry``) that JAX's vjp of a chunk scan also runs (the
    carry's tangent is instantiated; its cotangents are zeros)."""
    if mixer.pullback is None:
        raise NotImplementedError("CMS blocks after this mixer are not counted")
    sizes = [_layers(level.memory) for level in levels]
    forward = [2 * sum(o * i for o, i in s) for s in sizes]
    both = [2 * f for f in forward]  # weight gradients and the pass-through
    lowest = forward[0] + 2 * sum(o * i for o, i in sizes[0][1:])
    grads = 2 * d * V + (L - 1) * (mixer.pullback + sum(both)) + sum(both[1:]) + lowest
    return {
        "cms": dots(L * sum(forward)),
        "cms_grads": dots(grads),
        "cms_grads_carry": dots((L - 1) * mixer.carry),
    }


# -- the model --------------------------------------------------------------------------------


def per_token(config, *, attention: str = "causal", seq_len: int | None = None) -> dict:
    """Analytic FLOPs per token of the ``memory_lm`` model of ``config`` (a ConfigDict such as
    ``nested.run.config.load("configs/lm.py:hope-tiny")``, or its built Experiment), on
    sequences of ``seq_len`` tokens (default ``task.seq_len``): the forward FLOPs of each
    part of :data:`PARTS`, ``forward`` (their sum), ``backward`` and ``train`` (forward plus
    backward); the conventions and equations are the module docstring's. ``attention``:
    ``"causal"`` (the pairs attended) or ``"dense"`` (the score matrices computed). Models
    with CMS blocks also get ``cms_grads_carry``, in no total: the zero-cotangent backward of
    the span's fast-state updates that JAX's vjp also runs (:func:`_cms`); XLA counts about
    ``forward + cms_grads_carry`` and ``train + 3 cms_grads_carry``."""
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r}: use one of {ATTENTION}")
    exp = nc.build(config) if isinstance(config, config_dict.ConfigDict) else config
    model = exp.config.model
    if model.name != "memory_lm":
        raise NotImplementedError(f"model.name={model.name!r}: only memory_lm is counted")
    if model.get("experts", 1) > 1 or model.get("turn") is not None:
        raise NotImplementedError("Mixture-of-Storage experts and MemT turns are not counted")
    T = seq_len or exp.task.seq_len
    d, h, L, V = model.dim, model.heads, model.layers, exp.task.vocab_size
    mixer = model.mixer
    level = exp.system[model.level] if model.level else None
    parts = {name: Flops() for name in PARTS}

    def add(new: dict[str, Flops], times: float = 1.0):
        for name, value in new.items():
            parts[name] += value * times

    mixer_inner = Inner(Flops())
    if mixer == "attention":
        add(attention_block(d, T, model.window, attention), L)
    elif mixer == "memory":
        layer, mixer_inner = _memory_layer(level, d, h, T, model)
        add(layer, L)
    elif mixer in ("gate", "layer"):  # Titans MAG, MAL: attention and a memory layer
        add(attention_block(d, T, model.window, attention), L)
        add(_memory_layer(level, d, h, T, model)[0], L)
    elif mixer == "context":
        add(_context(level, d, h, T, model, attention), L)
    elif mixer == "self_modifying":
        projections = exp.system[model.projections]
        # With CMS blocks the mixer runs span by span (nested.core.outer_loss).
        span = min((exp.system[name].every for name in model.cms or ()), default=T)
        layer, mixer_inner = _self_modifying(level, projections, d, h, min(span, T), model)
        add(layer, L)
    else:
        raise NotImplementedError(f"model.mixer={mixer!r} is not counted")
    cms = [exp.system[name] for name in model.cms or ()]
    if cms:
        extra = _cms(cms, d, L, V, mixer_inner)
        carry = extra.pop("cms_grads_carry")
        add(extra)
    else:
        hidden = model.mlp_ratio * d if model.mlp_ratio is not None else 0
        hidden = hidden if model.mlp_hidden is None else model.mlp_hidden
        parts["mlp"] = dots(L * 6 * d * hidden)
    parts["head"] = dots(2 * d * V)
    out = {name: value.forward for name, value in parts.items()}
    out["forward"] = sum(value.forward for value in parts.values())
    out["backward"] = sum(value.backward for value in parts.values())
    out["train"] = out["forward"] + out["backward"]
    if cms:
        out["cms_grads_carry"] = carry.forward  # not model FLOPs: not in the totals
    return out
