"""Strict JAX settings for every test: float64 available, no implicit rank promotion.

The tests' programs are tiny, so their time is XLA's compile time: the CPU backend's code
generation runs unoptimised (``--xla_backend_optimization_level=0``; the suite took 8:46 on 2
cores without it, 6:47 with it; the HLO passes still run), also in the subprocesses the tests
start. Benchmarks and runs keep the default."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
).strip()

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
