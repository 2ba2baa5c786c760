"""Gradient accumulation (``train.microbatches``) and remat policies (``model.remat``) change
memory and time, never the numbers: a step of k microbatches equals the step of the whole
batch, and every remat policy gives the values and gradients of none."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_configs

from nested.nn.models import REMAT
from nested.run import config as nc
from nested.run import pieces


def run_steps(name: str, microbatches: int, steps: int = 3, **more):
    """Losses and final parameters of ``steps`` training steps of the tiny config ``name``
    (batch 8) on its own task's batches."""
    cfg = tiny_configs.config(
        name,
        train__batch_size=8,
        train__eval_batch_size=8,
        train__microbatches=microbatches,
        **more,
    )
    exp = nc.build(cfg)
    state = pieces.init_state(exp)
    batches = pieces.stacked_batches(exp.task, 0, steps, 8)
    state, metrics = pieces.make_train_fn(exp.program)(state, batches)
    return np.asarray(metrics["loss"]), state, batches


# continual: a fast state carried across sequences, split with the rows; mqar: masks whose
# counts differ between the parts (the parts' losses are weighted by them)
@pytest.mark.parametrize("name", [pytest.param("continual", marks=pytest.mark.slow), "mqar"])
def test_four_microbatches_equal_the_whole_batch(name):
    whole, whole_state, batches = run_steps(name, 1)
    parts, parts_state, _ = run_steps(name, 4)
    counts = batches["mask"][0].reshape(4, 2, -1).sum(axis=(1, 2))
    if name == "mqar":
        assert len(set(counts.tolist())) > 1, counts  # uneven parts: the weighting matters
    np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6)
    assert whole[-1] != whole[0]  # the steps moved the model
    learned = lambda s: (s.params, s.opt_state, s.fast)
    for a, b in zip(*map(jax.tree.leaves, map(learned, (parts_state, whole_state))), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_microbatches_that_do_not_divide_the_rows_are_refused():
    exp = nc.build(tiny_configs.config("mqar", train__batch_size=8, train__microbatches=4))
    state = exp.program.init(jax.random.key(0))
    batch = {k: v[0, :6] for k, v in pieces.stacked_batches(exp.task, 0, 1, 8).items()}
    with pytest.raises(ValueError, match="microbatches=4 does not divide the batch's 6 rows"):
        exp.program.train_step(state, batch)


@pytest.mark.parametrize("policy", [p for p in REMAT if p != "none"])
def test_remat_policies_give_the_values_and_gradients_of_none(policy):
    def loss_and_grads(remat):
        exp = nc.build(tiny_configs.config("mqar", model__remat=remat))
        state = exp.program.init(jax.random.key(0))
        batch = {k: v[0] for k, v in pieces.stacked_batches(exp.task, 0, 1, 4).items()}
        grad_fn = jax.jit(jax.value_and_grad(lambda p: exp.program.loss(p, batch)[0]))
        return grad_fn(state.params)

    (loss, grads), (reference, expected) = loss_and_grads(policy), loss_and_grads("none")
    np.testing.assert_allclose(loss, reference, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_remat_wraps_each_block_in_a_checkpoint_of_its_policy():
    def checkpoints(remat):
        exp = nc.build(tiny_configs.config("mqar", model__remat=remat))
        state = jax.eval_shape(exp.program.init, jax.random.key(0))
        inputs = jnp.zeros((4, 16), jnp.int32)
        batch = {"inputs": inputs, "targets": inputs}
        jaxpr = jax.make_jaxpr(lambda p: exp.program.loss(p, batch)[0])(state.params)
        policies = [e.params["policy"] for e in _equations(jaxpr.jaxpr) if "policy" in e.params]
        return [p for p in policies if p in REMAT.values() and p is not None]

    assert checkpoints("none") == []
    found = checkpoints("save_dots")
    layers = tiny_configs.config("mqar").model.layers
    assert len(found) == layers, found  # one per block, each with the policy asked for
    assert all(p is REMAT["save_dots"] for p in found)


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside its equations (scans, calls)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)
