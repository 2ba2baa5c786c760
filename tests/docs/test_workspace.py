"""WORKSPACE.md's worked examples run as written: a new objective with a kernel (Longhorn's
implicit step) and a new rule without one (sign-SGD)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import kernel_checks, tiny_configs

import nested as nl
from nested.core import inner, kernels


@pytest.fixture(scope="module")
def guide():
    """The namespace of the guide's "Adding a rule" code blocks, run in order; the kernel and
    recipe they register are removed afterwards."""
    text = (tiny_configs.ROOT / "WORKSPACE.md").read_text()
    section = text.split("## Adding a rule")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2
    registered, rules = list(kernels.KERNELS), dict(nl.recipes.RULES)
    namespace = {}
    for block in blocks:
        exec(compile(block, "WORKSPACE.md", "exec"), namespace)
    yield namespace
    kernels.KERNELS[:] = registered
    nl.recipes.RULES.clear()
    nl.recipes.RULES.update(rules)


def test_the_longhorn_kernel_equals_the_generic_path_of_its_declaration(guide):
    for level in kernels.find(guide["longhorn"](d_k=4, d_v=3))[0].examples():
        assert inner.kernel_for(level).name == "longhorn"
        kernel_checks.compare(level, 11)
    assert nl.recipes.RULES["longhorn"] is guide["longhorn"]


def test_the_implicit_step_is_the_proximal_update(guide):
    """One token: W_1 = argmin 1/2 |W - W_0|^2 + b/2 |W k - v|^2, solved as a linear system."""
    level = guide["longhorn"](d_k=4, d_v=3)
    ctx = kernel_checks.context(level, 1)
    _, state = kernel_checks.start_state(level)
    _, final = inner.run(level, state, ctx, path="generic")
    W0, k, v = state.params[0]["w"], ctx.k[:, 0], ctx.v[:, 0]
    b = ctx.gates["beta"][:, 0, :, None, None]
    lhs = jnp.eye(4)[None, None] + b * jnp.einsum("bhi,bhj->bhij", k, k)
    rhs = W0 + b * jnp.einsum("bho,bhi->bhoi", v, k)
    proximal = jnp.swapaxes(jnp.linalg.solve(lhs, jnp.swapaxes(rhs, -1, -2)), -1, -2)
    np.testing.assert_allclose(final.params[0]["w"], proximal, rtol=1e-12)


def test_sign_sgd_runs_the_generic_path_and_steps_by_the_sign(guide):
    level = guide["sign_delta"]
    assert inner.kernel_for(level) is None
    ctx = kernel_checks.context(level, 1)
    _, state = kernel_checks.start_state(level)
    with pytest.raises(ValueError, match="delta_rule: rule is SignSGD, not GradientDescent"):
        inner.run(level, state, ctx, path="kernel")
    _, final = inner.run(level, state, ctx)
    W0, k, v, h = state.params[0]["w"], ctx.k[:, 0], ctx.v[:, 0], ctx.gates["lr"][:, 0]
    grad = jnp.einsum("bho,bhi->bhoi", jnp.einsum("bhoi,bhi->bho", W0, k) - v, k)
    np.testing.assert_allclose(
        final.params[0]["w"], W0 - h[..., None, None] * jnp.sign(grad), rtol=1e-12
    )
