"""Analytic FLOPs per token (nested.run.flops) against XLA's own count of the compiled program.

What is compared, and why so:

* XLA's CPU cost analysis counts a while loop's body once, not once per iteration
  (``test_xla_counts_a_loop_body_once``), and every chunk loop of the models is a
  ``lax.scan``. So the programs are traced with ``jax.lax.scan`` unrolled (``unroll=True``:
  one trip of a body holding every iteration) and counted whole.
* ``jax.checkpoint`` is traced as the identity: remat changes no value, and its recomputation
  is hardware FLOPs, not the model FLOPs ``per_token`` counts.
* The loss is ``loss + 1e-6 * sum(final fast state)``: in a rolled scan every iteration runs
  the same body, so a training step computes every chunk's next state and every span's CMS
  gradient; compiled unrolled and alone, a loss would let XLA drop those whose results no
  later token reads (the last chunk's, Hope's slowest CMS block's at short T).
* Attention is compared ``attention="dense"`` (the score matrices the code forms).

Two bounds: the analytic count within 15% of XLA's ``flops`` (which also counts elementwise
work at 1 FLOP per element: norms, gates, masks, the block-doubling inverse's small blocks;
5-12% here) and within 5% of the FLOPs of the ``dot`` instructions of the compiled HLO (the
products the formulas count; the rest of that gap is the short sequences' edges: the first
chunk's momentum is a constant zero with no cotangent, the last chunk's state has none to
pass on). Where a span loops over several chunks, Hope's CMS gradients also run the backward
of the span's fast-state updates, whose cotangents are zeros (JAX's vjp of a chunk scan
instantiates the carry's tangent): not model FLOPs, reported as ``cms_grads_carry`` and added
to the analytic count here (3x in training). A span of one chunk runs without a loop: none.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

from nested.run import config as nc
from nested.run import flops

MODELS = (
    "transformer",
    "deltanet",
    "gated_deltanet",
    "ttt_linear",
    "ttt_mlp",
    "titans",
    "titans_mac",
    "titans_mag",
    "titans_mal",
    "atlas",
    "hope",
)


def xla_cost(compiled) -> dict:
    """``compiled.cost_analysis()`` as one dict (a list of one dict in some JAX versions)."""
    cost = compiled.cost_analysis()
    return cost[0] if isinstance(cost, list | tuple) else cost


_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]")


def dot_flops(hlo: str) -> float:
    """``2 * prod(output) * prod(contracted)`` summed over the ``dot`` instructions of an HLO
    module's text (operand shapes looked up by name)."""
    shapes, total = {}, 0.0
    for line in hlo.splitlines():
        match = _DEF.match(line)
        if match:
            shapes[match.group(1)] = [int(x) for x in match.group(2).split(",") if x]
    for line in hlo.splitlines():
        if " dot(" not in line:
            continue
        out = [int(x) for x in _DEF.match(line).group(2).split(",") if x]
        lhs = re.search(r"dot\(%([\w.\-]+)", line).group(1)
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
        contracted = math.prod(shapes[lhs][int(i)] for i in dims.split(",") if i)
        total += 2.0 * math.prod(out) * contracted
    return total


@pytest.fixture
def model_flops(monkeypatch):
    """Trace with every ``lax.scan`` unrolled and ``jax.checkpoint`` as the identity."""
    scan = jax.lax.scan

    def unrolled(f, init, xs=None, length=None, reverse=False, unroll=1, **kwargs):
        return scan(f, init, xs, length=length, reverse=reverse, unroll=True)

    def identity(fun=None, **kwargs):
        return fun if fun is not None else (lambda f: f)

    monkeypatch.setattr(jax.lax, "scan", unrolled)
    monkeypatch.setattr(jax, "checkpoint", identity)


def small_config(model: str, seq_len: int, layers: int, **keys):
    """``<model>-tiny`` on ``seq_len`` tokens and ``layers`` layers (and other ``model`` keys);
    CMS periods cut to divide the sequence."""
    config = nc.load(f"configs/lm.py:{model}-tiny")
    config.task.seq_len, config.model.layers = seq_len, layers
    config.model.update(keys)
    for name in config.model.cms or ():
        config.levels[name].every = math.gcd(config.levels[name].every, seq_len)
    return config


def compare(model: str, *, seq_len: int, layers: int, train: bool, **keys) -> dict[str, float]:
    """Analytic over XLA, per token: ``{"xla": ratio to cost_analysis()["flops"], "dots":
    ratio to the HLO's dot FLOPs}``, of the forward loss or of its value_and_grad."""
    exp = nc.build(small_config(model, seq_len, layers, **keys))
    program = exp.program
    analytic = flops.per_token(exp, attention="dense")
    carry = analytic.get("cms_grads_carry", 0.0)
    expected = analytic["train"] + 3 * carry if train else analytic["forward"] + carry
    params = jax.eval_shape(lambda: program.init(jax.random.key(0))).params
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)

    def loss(params, batch):  # the final fast state live (module docstring)
        value, (_, fast) = program.loss(params, batch)
        live = [jnp.sum(x) for x in jax.tree.leaves(fast) if jnp.issubdtype(x.dtype, jnp.floating)]
        return value + 1e-6 * sum(live)

    fn = jax.value_and_grad(loss) if train else loss
    compiled = jax.jit(fn).lower(params, {"inputs": tokens, "targets": tokens}).compile()
    return {
        "xla": expected * seq_len / xla_cost(compiled)["flops"],
        "dots": expected * seq_len / dot_flops(compiled.as_text()),
    }


def check(ratios: dict[str, float]) -> None:
    assert abs(ratios["xla"] - 1) < 0.15, ratios
    assert abs(ratios["dots"] - 1) < 0.05, ratios


def test_xla_counts_a_loop_body_once():
    w = jnp.ones((32, 32), jnp.float32)
    body = lambda c, _: (c @ w, None)
    one = 2 * 32**3
    for unroll, count in ((1, 1), (True, 8)):
        fn = lambda x, unroll=unroll: jax.lax.scan(body, x, length=8, unroll=unroll)[0]
        counted = xla_cost(jax.jit(fn).lower(w).compile())["flops"]
        assert count * one <= counted < count * one + 64  # and the loop counter's adds


# With -m slow: Hope, Titans and its hybrids, ATLAS, Gated DeltaNet and TTT-Linear (a member of
# each of their families runs by default; test_tiny_matches_xla below runs every model).
SLOW_XLA = {
    "hope",
    "titans",
    "titans_mac",
    "titans_mag",
    "titans_mal",
    "atlas",
    "gated_deltanet",
    "ttt_linear",
}


@pytest.mark.parametrize(
    "model", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_XLA else m for m in MODELS]
)
def test_matches_xla(model, model_flops):
    """Every model, 1 layer (Hope 2: its CMS gradients run back through the upper layers'
    mixers), 32 tokens: the forward loss and its value_and_grad."""
    layers = 2 if model == "hope" else 1
    for train in (False, True):
        check(compare(model, seq_len=32, layers=layers, train=train))


# At 2 layers XLA's CPU fusion repeats the short convolution's elementwise multiply-adds in
# every fusion that reads its output: ttt_linear's forward then counts 150k such FLOPs a token
# (12k computed), 17% of XLA's total, against 3% without the convolution (conv=0).
CONVOLUTION_REPEATED = {"ttt_linear"}


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_tiny_matches_xla(model, model_flops):
    """Every model at its tiny size (2 layers, 64 tokens), forward and training."""
    for train in (False, True):
        ratios = compare(model, seq_len=64, layers=2, train=train)
        assert abs(ratios["dots"] - 1) < 0.05, ratios
        if model in CONVOLUTION_REPEATED and not train:
            ratios = compare(model, seq_len=64, layers=2, train=train, conv=0)
        check(ratios)


def test_transformer_closed_form():
    d, h, L, m, V, T = 128, 4, 2, 344, 257, 64
    out = flops.per_token(nc.load("configs/lm.py:transformer-tiny"))
    keys = (T + 1) / 2
    assert out["forward"] == 2 * d * V + L * (8 * d * d + 4 * d * keys + 6 * d * m)
    assert out["train"] == 3 * out["forward"]
    assert out["attention"] == L * 4 * d * keys
    assert h == 4  # head dims do not enter: d = h * d / h


@pytest.mark.slow
def test_parts_sum_to_forward():
    for model in MODELS:
        out = flops.per_token(nc.load(f"configs/lm.py:{model}-small"))
        assert math.isclose(sum(out[part] for part in flops.PARTS), out["forward"])
        assert out["train"] > 2.9 * out["forward"]


def test_attention_keys():
    assert flops.attention_keys(64, None) == 32.5
    assert flops.attention_keys(64, None, "dense") == 64
    assert flops.attention_keys(64, 32) == (32 * 33 / 2 + 32 * 32) / 64
    assert flops.attention_keys(64, 32, "dense") == 95
    # Blockwise beyond 512 keys: query block 0 meets key block 0, block 1 blocks 0 and 1.
    assert flops.attention_keys(600, None, "dense") == 3 * 512 * 512 / 600
    with pytest.raises(ValueError, match="attention="):
        flops.attention_keys(64, None, "flash")


def test_inverse_and_delta_chunk():
    # Block doubling of 32 x 32: levels s = 1..16, 2 P s^2 each.
    assert flops.inverse(32) == flops.Flops(2 * 32 * (1 + 4 + 16 + 64 + 256), 4 * 32**3)
    C, dk, dv = 32, 32, 32
    chunk = flops.delta_chunk(C, dk, dv)
    products = 4 * C * C * (dk + dv) + 6 * C * dk * dv
    assert chunk.forward == products + flops.inverse(C).forward
    assert chunk.backward == 2 * products + 4 * C**3


def test_unsupported_raises():
    config = nc.load("configs/lm.py:deltanet-tiny")
    config.levels.memory.rule = "hebbian"
    with pytest.raises(NotImplementedError, match="not counted"):
        flops.per_token(config)
