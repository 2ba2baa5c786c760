"""benchmarks/step_profile.py: a step's products counted from its HLO and its trace, by part
and phase (``lm_throughput.py --profile``)."""

import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import tiny_configs

sys.path.insert(0, str(tiny_configs.ROOT / "benchmarks"))
import step_profile  # noqa: E402

M, K, N, STEPS = 8, 16, 32, 3  # x (M, K) @ w (K, N), in a loop of STEPS iterations


def loss(w, x):
    def body(h, _):
        with jax.named_scope("mlp"):
            return jnp.tanh(h @ w) @ w.T, None

    h, _ = jax.lax.scan(jax.checkpoint(body), x, None, length=STEPS)
    with jax.named_scope("head"):
        return jnp.sum(h @ w)


def step(w, x):
    grad = jax.grad(loss)(w, x)
    with jax.named_scope("optimizer"):
        return w - 0.1 * grad


def test_products_are_counted_per_part_and_phase_with_loop_iterations():
    w = jnp.full((K, N), 0.01)
    x = jnp.ones((M, K))
    rows, totals = step_profile.profile(jax.jit(step), (w, x), steps=2)
    flops = {(r.part, r.phase): r.flops for r in rows}
    one = 2 * M * K * N  # a product of x (M, K) and w (K, N), or of their transposes
    # Forward: two products an iteration, STEPS iterations (the trace counts the loop body's
    # runs); recomputed inside the backward (jax.checkpoint): the first only, whose output
    # tanh' needs; the backward: two products for each (the cotangents of both operands).
    assert flops[("mlp", "forward")] == pytest.approx(2 * one * STEPS)
    assert flops[("mlp", "recompute")] == pytest.approx(one * STEPS)
    assert flops[("mlp", "backward")] == pytest.approx(4 * one * STEPS)
    # The head's value is not used (a gradient only): XLA drops its forward product.
    assert ("head", "forward") not in flops
    assert flops[("head", "backward")] == pytest.approx(2 * one)
    assert ("optimizer", "update") in flops
    assert totals["flops"] == pytest.approx(sum(flops.values()))
    assert all(r.seconds >= 0 for r in rows) and totals["op_seconds"] > 0
    lines = step_profile.tables(rows, totals, peak_tflops=0.1)
    assert any(line.startswith("| mlp |") for line in lines)


def test_names_give_parts_and_phases():
    forward = "jit(run)/while/body/closed_call/jvp(inner.memory)/while/body/closed_call/reads/dot"
    assert step_profile.part_of(forward) == "inner.memory/reads"
    assert step_profile.phase_of(forward) == "forward"
    backward = "jit(run)/transpose(jvp(mlp))/dot_general"
    assert (step_profile.part_of(backward), step_profile.phase_of(backward)) == ("mlp", "backward")
    remat = "jit(f)/transpose(jvp())/while/body/checkpoint/rematted_computation/gradients/dot"
    assert step_profile.phase_of(remat) == "recompute"
    assert step_profile.phase_of("jit(step)/optimizer/mul") == "update"
    assert step_profile.part_of("jit(step)/add") == "other"
    assert step_profile.part_of("") == "copies (no op_name)"


def test_a_dot_and_a_convolution_count_their_multiply_adds():
    shapes = {"a": "f32[4,8,16]{2,1,0}", "b": "f32[4,16,32]{2,1,0}"}
    dot = (
        "f32[4,8,32]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2}, "
        "rhs_batch_dims={0}, rhs_contracting_dims={1}"
    )
    assert step_profile.product_flops(dot, shapes) == 2 * 4 * 8 * 32 * 16
    shapes = {"x": "f32[2,10,6]{2,1,0}", "k": "f32[3,1,6]{2,1,0}"}
    conv = (
        "f32[2,8,6]{2,1,0} convolution(%x, %k), window={size=3}, dim_labels=b0f_0io->b0f, "
        "feature_group_count=6"
    )
    assert step_profile.product_flops(conv, shapes) == 2 * (2 * 8 * 6) * 3  # 3 taps a feature
    assert step_profile.product_flops("f32[4]{0} add(%a, %b)", shapes) == 0.0
